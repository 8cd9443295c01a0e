"""The start-up probe (``runledger.db.connecting.probe``): a connection the server ends
while the schema is checked is opened again within the probe's time, so a worker that
starts during a storm of ``pg_terminate_backend`` does not exit with a traceback."""

from __future__ import annotations

import asyncio

import psycopg
import pytest

from runledger import errors
from runledger.db.connecting import probe
from runledger.db.migrate import head

NAME = "runledger-probe-test"


async def _hold_versions(admin: psycopg.AsyncConnection[object]) -> None:
    """Lock the version table the probe reads (made here when the database was installed
    from the living files, which have none), in a transaction of ``admin``."""
    await admin.execute(
        "CREATE TABLE IF NOT EXISTS runledger.alembic_version (version_num varchar(32) NOT NULL)"
    )
    await admin.execute("DELETE FROM runledger.alembic_version")
    await admin.execute("INSERT INTO runledger.alembic_version VALUES (%s)", (head(),))
    await admin.execute("BEGIN")
    await admin.execute("LOCK TABLE runledger.alembic_version IN ACCESS EXCLUSIVE MODE")


async def _blocked_probe(watch: psycopg.AsyncConnection[object]) -> int:
    """The backend of the probe, once it waits on the version table (``watch`` is not in
    a transaction: one would see pg_stat_activity as it was when it began)."""
    for _ in range(400):
        cur = await watch.execute(
            "SELECT pid FROM pg_stat_activity WHERE application_name = %s"
            " AND wait_event_type = 'Lock'",
            (NAME,),
        )
        row = await cur.fetchone()
        if row is not None:
            return int(row[0])
        await asyncio.sleep(0.05)
    raise AssertionError("the probe never waited on the version table")


async def _gone(watch: psycopg.AsyncConnection[object], pid: int) -> None:
    """Wait until backend ``pid`` has left pg_stat_activity: a terminated backend stays
    listed, still waiting on its lock, until it has handled the signal."""
    for _ in range(400):
        cur = await watch.execute("SELECT 1 FROM pg_stat_activity WHERE pid = %s", (pid,))
        if await cur.fetchone() is None:
            return
        await asyncio.sleep(0.05)
    raise AssertionError(f"backend {pid} was terminated but never exited")


async def test_a_connection_ended_during_the_check_is_opened_again(database_url: str) -> None:
    connect = psycopg.AsyncConnection.connect
    async with (
        await connect(database_url, autocommit=True) as admin,
        await connect(database_url, autocommit=True) as watch,
    ):
        await _hold_versions(admin)
        checking = asyncio.create_task(probe(database_url, timeout=20, application_name=NAME))
        first = await _blocked_probe(watch)
        await watch.execute("SELECT pg_terminate_backend(%s)", (first,))
        await _gone(watch, first)
        second = await _blocked_probe(watch)  # a new connection, waiting again
        assert second != first
        assert not checking.done()  # the probe did not give up on the ended connection
        await admin.execute("COMMIT")
        await asyncio.wait_for(checking, timeout=20)  # no error: the schema is fine


async def test_a_connection_that_keeps_ending_is_one_line_once_the_time_is_up(
    database_url: str,
) -> None:
    connect = psycopg.AsyncConnection.connect
    async with (
        await connect(database_url, autocommit=True) as admin,
        await connect(database_url, autocommit=True) as watch,
    ):
        await _hold_versions(admin)
        checking = asyncio.create_task(probe(database_url, timeout=2, application_name=NAME))
        while not checking.done():  # every connection it opens is ended at once
            cur = await watch.execute(
                "SELECT pg_terminate_backend(pid) FROM pg_stat_activity"
                " WHERE application_name = %s",
                (NAME,),
            )
            await cur.fetchall()
            await asyncio.sleep(0.05)
        with pytest.raises(errors.DatabaseUnavailable) as caught:
            checking.result()
        assert "\n" not in str(caught.value)
        await admin.execute("ROLLBACK")
