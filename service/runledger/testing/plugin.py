"""The fixtures of runledger's pytest plugin (loaded with ``-p runledger.testing``).

Every fixture is prefixed ``runledger_``:

- ``runledger_server`` (session): a running PostgreSQL (see :mod:`runledger.testing.postgres`);
- ``runledger_databases`` (session): the migrated template and per-test clones;
- ``runledger_database_url``: a fresh migrated database for this test;
- ``runledger_admin_conn``: a superuser psycopg connection to it (autocommit);
- ``runledger_db_clock``: moves ``runledger.now()`` for every session of the test database;
- ``runledger_store``: a :class:`runledger.db.store.Store` on it (async tests);
- ``runledger_provider``: the gated fake provider in its own process;
- ``runledger_flows``: the flows the workers load (``[]``; override it, or set
  ``runledger_workers.flows``);
- ``runledger_workers``: a :class:`~runledger.testing.processes.WorkerPool` of real
  ``python -m runledger worker`` processes on the test database.

The plugin needs pytest, pytest-asyncio and runledger's own dependencies, nothing more.
It leaves pytest-asyncio's ``asyncio_default_fixture_loop_scope`` to the project; when the
project does not set it, the plugin sets the value that keeps pytest-asyncio's behaviour
(``fixture-scope``), so that a project that installed pytest-asyncio only for runledger
gets no deprecation warning on every run (see :func:`pytest_configure`).
"""

from __future__ import annotations

import datetime as dt
import importlib.metadata
import os
from collections.abc import AsyncIterator, Iterator
from typing import TYPE_CHECKING, Any

import psycopg
import pytest
import pytest_asyncio

from runledger.db import harness
from runledger.testing.postgres import Databases, Server, acquire_server
from runledger.testing.processes import ProviderProcess, WorkerPool

if TYPE_CHECKING:
    from runledger.db.store import Store

FIXTURE_LOOP_SCOPE = "asyncio_default_fixture_loop_scope"
KEEP_FIXTURE_SCOPE = "fixture-scope"  # accepted from pytest-asyncio 1.5 on


@pytest.hookimpl(tryfirst=True)  # before pytest-asyncio's own, which warns
def pytest_configure(config: pytest.Config) -> None:
    """Give pytest-asyncio's ``asyncio_default_fixture_loop_scope`` a value when the
    project sets none (in its ini file or with ``-o``).

    Unset, pytest-asyncio warns (``PytestDeprecationWarning``) on every run of every
    project that installed it, runledger's users included. ``fixture-scope`` is what unset
    means today (each async fixture's loop is its own scope), so nothing changes for the
    project's fixtures; ``function`` would break a session-scoped async fixture that has
    no ``loop_scope``. pytest-asyncio before 1.5 refuses ``fixture-scope`` and has no value
    that keeps its behaviour: there the option is left unset, and so is its warning.
    """
    try:
        if config.getini(FIXTURE_LOOP_SCOPE) or not _accepts_fixture_scope():
            return
    except ValueError:  # pytest-asyncio is not loaded (-p no:asyncio): nothing to set
        return
    cache = getattr(config, "_inicache", None)  # pytest has no public setter for an ini value
    if isinstance(cache, dict):
        cache[FIXTURE_LOOP_SCOPE] = KEEP_FIXTURE_SCOPE


def _accepts_fixture_scope() -> bool:
    try:
        version = importlib.metadata.version("pytest-asyncio")
    except importlib.metadata.PackageNotFoundError:
        return False
    from packaging.version import InvalidVersion, Version  # a dependency of pytest

    try:
        return Version(version).release[:2] >= (1, 5)
    except InvalidVersion:
        return False


class DbClock:
    """Shifts the database clock (``runledger.settings.clock_offset``) of one database."""

    def __init__(self, conn: psycopg.Connection[Any]) -> None:
        self.conn = conn

    @property
    def offset(self) -> dt.timedelta:
        return harness.clock_offset(self.conn)

    def advance(self, seconds: float) -> dt.timedelta:
        harness.advance_clock(self.conn, seconds)
        return self.offset

    def now(self) -> dt.datetime:
        return harness.database_now(self.conn)


@pytest.fixture(scope="session")
def runledger_server() -> Iterator[Server]:
    """A running PostgreSQL for the whole session (never a mock; fails, never skips)."""
    server = acquire_server()
    try:
        yield server
    finally:
        server.stop()


@pytest.fixture(scope="session")
def runledger_databases(runledger_server: Server) -> Databases:
    """The migrated template database; ``.create()`` clones it."""
    dbs = Databases(runledger_server)
    dbs.ensure_template()
    return dbs


@pytest.fixture
def runledger_database_url(runledger_databases: Databases) -> Iterator[str]:
    """A fresh database, migrated to head, for this test; dropped afterwards."""
    url = runledger_databases.create()
    try:
        yield url
    finally:
        runledger_databases.drop(url)


@pytest.fixture
def runledger_admin_conn(runledger_database_url: str) -> Iterator[psycopg.Connection[Any]]:
    """A superuser connection (autocommit) to the test database."""
    with psycopg.connect(runledger_database_url, autocommit=True) as conn:
        yield conn


@pytest.fixture
def runledger_db_clock(runledger_admin_conn: psycopg.Connection[Any]) -> DbClock:
    """Moves the database clock of the test database: ``advance(seconds)`` expires leases."""
    return DbClock(runledger_admin_conn)


@pytest_asyncio.fixture
async def runledger_store(runledger_database_url: str) -> AsyncIterator[Store]:
    """A :class:`runledger.db.store.Store` on the test database (async tests)."""
    from runledger.db.store import Store

    s = await Store.connect(runledger_database_url, max_size=8)
    try:
        yield s
    finally:
        await s.close()


@pytest.fixture
def runledger_provider() -> Iterator[ProviderProcess]:
    """The gated fake provider in its own process: ``.client`` talks to it, ``.url`` is it."""
    p = ProviderProcess()
    try:
        yield p
    finally:
        p.stop()


@pytest.fixture
def runledger_flows() -> list[str]:
    """``package.module:attribute`` specs the workers load; override it in your conftest."""
    return []


@pytest.fixture
def runledger_workers(
    request: pytest.FixtureRequest, runledger_database_url: str, runledger_flows: list[str]
) -> Iterator[WorkerPool]:
    """Real ``python -m runledger worker`` processes on the test database.

    Start them with ``runledger_workers.start(n, args=[...])``; the flows come from
    ``runledger_flows`` or ``runledger_workers.flows = ["myapp.flows:flow"]`` set before
    starting. When the test uses ``runledger_provider``, the workers get
    ``RUNLEDGER_PROVIDER_URL``. The test's directory and the rootdir are put on the
    workers' ``PYTHONPATH`` so they can import a flow module that sits beside the test.
    """
    env: dict[str, str] = {}
    if "runledger_provider" in request.fixturenames:
        provider: ProviderProcess = request.getfixturevalue("runledger_provider")
        env["RUNLEDGER_PROVIDER_URL"] = provider.url
    paths = [str(request.path.parent), str(request.config.rootpath)]
    if os.environ.get("PYTHONPATH"):
        paths.append(os.environ["PYTHONPATH"])
    env["PYTHONPATH"] = os.pathsep.join(dict.fromkeys(paths))
    pool = WorkerPool(
        runledger_database_url,
        list(runledger_flows),
        env=env,
        args=["--poll-seconds", "0.2"],
        cwd=str(request.config.invocation_params.dir),
    )
    try:
        yield pool
    finally:
        pool.close()
