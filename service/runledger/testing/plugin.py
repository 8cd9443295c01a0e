"""The fixtures of runledger's pytest plugin (loaded through :mod:`runledger.testing`).

Fixtures:

- ``runledger_server`` (session): a running PostgreSQL (see :mod:`runledger.testing.postgres`);
- ``runledger_databases`` (session): the migrated template and per-test clones;
- ``database_url``: a fresh migrated database for this test;
- ``admin_conn``: a superuser psycopg connection to it (autocommit);
- ``db_clock``: moves ``runledger.now()`` for every session of the test database;
- ``store``: a :class:`runledger.db.store.Store` on it (async tests).
"""

from __future__ import annotations

import datetime as dt
from collections.abc import AsyncIterator, Iterator
from typing import Any

import psycopg
import pytest
import pytest_asyncio

from runledger.testing.postgres import Databases, Server, acquire_server


class DbClock:
    """Shifts the database clock (``runledger.settings.clock_offset``) of one database."""

    def __init__(self, conn: psycopg.Connection[Any]) -> None:
        self.conn = conn

    @property
    def offset(self) -> dt.timedelta:
        row = self.conn.execute("SELECT clock_offset FROM runledger.settings").fetchone()
        assert row is not None
        value: dt.timedelta = row[0]
        return value

    def advance(self, seconds: float) -> dt.timedelta:
        self.conn.execute(
            "UPDATE runledger.settings SET clock_offset = clock_offset + %s",
            (dt.timedelta(seconds=seconds),),
        )
        return self.offset

    def now(self) -> dt.datetime:
        row = self.conn.execute("SELECT runledger.now()").fetchone()
        assert row is not None
        value: dt.datetime = row[0]
        return value


@pytest.fixture(scope="session")
def runledger_server() -> Iterator[Server]:
    server = acquire_server()
    try:
        yield server
    finally:
        server.stop()


@pytest.fixture(scope="session")
def runledger_databases(runledger_server: Server) -> Databases:
    dbs = Databases(runledger_server)
    dbs.ensure_template()
    return dbs


@pytest.fixture
def database_url(runledger_databases: Databases) -> Iterator[str]:
    url = runledger_databases.create()
    try:
        yield url
    finally:
        runledger_databases.drop(url)


@pytest.fixture
def admin_conn(database_url: str) -> Iterator[psycopg.Connection[Any]]:
    with psycopg.connect(database_url, autocommit=True) as conn:
        yield conn


@pytest.fixture
def db_clock(admin_conn: psycopg.Connection[Any]) -> DbClock:
    return DbClock(admin_conn)


@pytest_asyncio.fixture
async def store(database_url: str) -> AsyncIterator[Any]:
    from runledger.db.store import Store

    s = await Store.connect(database_url, max_size=8)
    try:
        yield s
    finally:
        await s.close()


@pytest.fixture
def provider() -> Iterator[Any]:
    """The fake provider in its own process; ``.client`` talks to it, ``.url`` is its address."""
    from runledger.testing.processes import ProviderProcess

    p = ProviderProcess()
    try:
        yield p
    finally:
        p.stop()


@pytest.fixture
def workers(database_url: str, provider: Any) -> Iterator[Any]:
    """A :class:`~runledger.testing.processes.WorkerPool` for the demo flows.

    Start workers with ``workers.start(n)``; override the flows with
    ``workers.flows = ["myapp.flows:flow"]`` before starting.
    """
    from runledger.testing.processes import WorkerPool

    pool = WorkerPool(
        database_url,
        ["runledger.demo.flows:flows"],
        env={"RUNLEDGER_PROVIDER_URL": provider.url},
        args=["--poll-seconds", "0.2"],
    )
    try:
        yield pool
    finally:
        pool.close()
