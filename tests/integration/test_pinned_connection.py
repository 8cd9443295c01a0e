"""Executor.pinned: a run's statements go through one connection of the pool, checked
out once; a lost connection unpins it and the pool takes over again. The connection
given back last is handed out first, for up to WARM_SECONDS (execution._Warm)."""

from __future__ import annotations

import asyncio
from typing import Any

import psycopg
import pytest

from runledger.db import execution
from runledger.db.store import Store


async def _pid(store: Store) -> int:
    rows = await store.executor.read("SELECT pg_backend_pid() AS pid", ())
    return int(rows[0]["pid"])


async def test_statements_of_a_pinned_task_share_one_checkout(database_url: str) -> None:
    store = await Store.connect(database_url, max_size=4)
    try:
        before = store.executor.pool.get_stats().get("requests_num", 0)
        async with store.executor.pinned():
            pids = {await _pid(store) for _ in range(5)}
            # tasks started inside inherit the pin (the statements serialize on it)
            pids |= set(await asyncio.gather(*(_pid(store) for _ in range(3))))
            assert (
                store.executor.pool.get_stats()["pool_available"]
                == store.executor.pool.get_stats().get("pool_size", 1) - 1
            )  # lent out
        after = store.executor.pool.get_stats().get("requests_num", 0)
        assert len(pids) == 1
        assert after - before == 1  # one checkout for nine statements
        # given back at the exit, and handed out first: the next statement, and the next
        # pinned task, take it without a checkout of the pool
        assert await _pid(store) in pids
        async with store.executor.pinned():
            assert await _pid(store) in pids
        assert store.executor.pool.get_stats().get("requests_num", 0) - after == 0
    finally:
        await store.close()


async def test_a_lost_pinned_connection_falls_back_to_the_pool(database_url: str) -> None:
    store = await Store.connect(database_url, max_size=4)
    try:
        async with store.executor.pinned():
            first = await _pid(store)
            with psycopg.connect(database_url, autocommit=True) as admin:
                admin.execute("SELECT pg_terminate_backend(%s)", (first,))
            # a read is sent again after a connection failure: now through the pool
            second = await _pid(store)
            third = await _pid(store)
        assert second != first
        assert third != first
        stats: dict[str, Any] = store.executor.pool.get_stats()
        assert stats.get("connections_lost", 0) + stats.get("returns_bad", 0) >= 1
    finally:
        await store.close()


async def test_a_statement_in_flight_keeps_the_connection_until_it_ends(
    database_url: str,
) -> None:
    store = await Store.connect(database_url, max_size=4)
    try:
        started = asyncio.Event()

        async def slow() -> list[Any]:
            started.set()
            return await store.executor.read("SELECT pg_sleep(0.3), pg_backend_pid() AS pid", ())

        async with store.executor.pinned():
            late = asyncio.ensure_future(slow())  # as a fenced run's shielded write
            await started.wait()
        # the pin is left while the statement runs: the connection is not back yet, and
        # another statement meanwhile checks out one of its own
        other = await _pid(store)
        lent = store.executor.pool.get_stats()
        rows = await late
        assert rows[0]["pid"] != other
        await asyncio.sleep(0)  # the give-back runs as the statement's task ends
        # back in the pool (the other statement's connection holds the warm place)
        back = store.executor.pool.get_stats()
        assert back["pool_available"] == lent["pool_available"] + 1
    finally:
        await store.close()


async def test_a_connection_given_back_long_ago_goes_back_to_the_pool(
    database_url: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The connection given back last waits out of the pool for WARM_SECONDS at most:
    an older one is returned to the pool, and the statement checks one out."""
    store = await Store.connect(database_url, max_size=4)
    try:
        first = await _pid(store)
        before = store.executor.pool.get_stats().get("requests_num", 0)
        assert await _pid(store) == first  # handed out again, no checkout
        assert store.executor.pool.get_stats().get("requests_num", 0) == before
        monkeypatch.setattr(execution, "WARM_SECONDS", 0.0)
        await asyncio.sleep(0.01)
        await _pid(store)
        assert store.executor.pool.get_stats().get("requests_num", 0) == before + 1
    finally:
        await store.close()
