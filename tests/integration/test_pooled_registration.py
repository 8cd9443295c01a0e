"""A worker whose database URL reaches a transaction pooler (revision 0032), in-process.

Told so (``pooler="transaction"``; the database here is PostgreSQL itself, which a
worker told so treats exactly as a pooler), the worker prepares nothing, does not
LISTEN, takes no session lock, and holds its worker id by its heartbeats, not by its
listener's session:

- its registration records no session, and a run it is given is claimed on the poll;
- it claims nothing once its heartbeats have not been answered for nearly its lease
  (another worker may hold its id by then), and claims again once one is;
- when its heartbeat finds the id taken by another process, it stops: ``WorkerFailed``
  with ``WorkerIdTaken``, its runs fenced, the other process's registration untouched.
"""

from __future__ import annotations

import asyncio
import contextlib
import uuid
from collections.abc import AsyncIterator, Callable
from typing import Any

import pytest
import pytest_asyncio

from runledger.flows import Flow, ToolCall
from runledger.worker.crash import CrashPoints
from runledger.worker.listening import WorkerIdTaken
from runledger.worker.process import Worker, WorkerFailed
from tests.integration.conftest import FAST, Db, eventually

LEASE = 2.0  # the keeper heartbeats every 2/3 s; claims pause 1.8 s after the last one


def _flow() -> Flow:
    flow = Flow("pooled", "1")

    @flow.tool(safety="idempotent")
    def act(ctx: Any) -> dict[str, Any]:
        return {"ok": True}

    @flow.policy
    def decide(ctx: Any, history: list[Any]) -> list[ToolCall]:
        return [] if history else [ToolCall("act", {})]

    return flow


@pytest_asyncio.fixture
async def pooled_worker(database_url: str) -> AsyncIterator[Callable[[Flow], Any]]:
    tasks: list[asyncio.Task[None]] = []

    def make(flow: Flow) -> tuple[Worker, asyncio.Task[None]]:
        w = Worker(
            database_url=database_url,
            flows=[flow],
            worker_id="pooled-w",
            limits=FAST,
            crash=CrashPoints(None),
            poll_seconds=0.05,
            lease_seconds=LEASE,
            grace_seconds=1.0,
            pooler="transaction",
        )
        task = asyncio.create_task(w.run(), name="pooled-w")
        tasks.append(task)
        return w, task

    yield make
    for t in tasks:
        if not t.done():
            t.cancel()
        with contextlib.suppress(BaseException):
            await t


async def _registration(db: Db) -> dict[str, Any]:
    [row] = await db.rows(
        "SELECT session_pid, session_lock, incarnation, silent_after, stopped_at, pid"
        " FROM runledger.workers WHERE worker_id = 'pooled-w'"
    )
    return row


async def test_a_worker_behind_a_transaction_pooler_holds_its_id_by_heartbeats(
    db: Db, pooled_worker: Callable[[Flow], Any]
) -> None:
    flow = _flow()
    w, task = pooled_worker(flow)
    await eventually(lambda: w.store is not None, what="worker start")
    reg = await _registration(db)
    assert (reg["session_pid"], reg["session_lock"]) == (None, None)
    assert reg["incarnation"] == w.incarnation and reg["silent_after"].total_seconds() == LEASE
    assert (
        await db.rows(
            "SELECT 1 FROM pg_stat_activity WHERE application_name = 'runledger-listener:pooled-w'"
            " AND query LIKE 'LISTEN%%'"
        )
        == []
    )
    await db.submit("pooled-1", flow)
    await eventually(
        lambda: _status(db, "pooled-1", "succeeded"), what="pooled-1 claimed on the poll"
    )

    # its heartbeats go unanswered: it stops claiming before its silence frees the id
    assert w.store is not None
    store = w.store
    beat = store.registry.heartbeat_worker

    async def unanswered(*args: Any, **kwargs: Any) -> None:
        raise TimeoutError("heartbeat not answered")

    store.registry.heartbeat_worker = unanswered  # type: ignore[method-assign]
    await eventually(lambda: w.claims_paused, timeout=10, what="claims paused")
    assert w.claims_paused_because() == (
        "no heartbeat answered for nearly a lease: claiming paused until one is"
    )
    store.registry.heartbeat_worker = beat  # type: ignore[method-assign]
    await eventually(lambda: not w.claims_paused, timeout=10, what="claims resumed")
    assert not task.done()

    # another process takes the id over (as after this one's silence): the next
    # heartbeat is refused, and the worker stops, leaving the registration to the other
    other = uuid.uuid4()
    await db.rows(
        "UPDATE runledger.workers SET incarnation = %s, pid = 4242 WHERE worker_id = 'pooled-w'",
        other,
    )
    await eventually(task.done, timeout=10, what="the worker to stop")
    with pytest.raises(WorkerFailed) as failed:
        await task
    assert isinstance(failed.value.error, WorkerIdTaken)
    assert "in use by another live worker" in str(failed.value.error)
    reg = await _registration(db)
    assert (reg["incarnation"], reg["pid"], reg["stopped_at"]) == (other, 4242, None)


async def _status(db: Db, run_id: str, status: str) -> bool:
    rows = await db.rows("SELECT status FROM runledger.runs WHERE run_id = %s", run_id)
    return bool(rows) and rows[0]["status"] == status
