"""Edges where a worker still has work in flight while it loses (or gives up) a run.

Each test fails on the code before its fix: a plain-def tool past its timeout was
looked up and sent again while its thread still ran; a hung renewal kept every run
unfenced; a drain handed a run back while its tool thread still ran.
"""

from __future__ import annotations

import asyncio
import threading
import time
from typing import Any

import psycopg

from runledger.flows import Flow, ToolCall
from runledger.worker.executor import Limits
from tests.integration.conftest import FAST, Db, StartWorker, eventually


def _charging_flow(
    name: str,
    ledger: list[tuple[str, int]],
    *,
    seconds: float,
    timeout: float | None = None,
    sync: bool = True,
    started: threading.Event | None = None,
) -> Flow:
    """``charge`` takes ``seconds``, then charges (``ledger``); ``started`` is set as
    the tool begins (a plain ``def``: in its thread)."""
    flow = Flow(name, "1")
    lock = threading.Lock()
    began = started or threading.Event()

    if sync:

        @flow.tool(safety="lookup", timeout=timeout)
        def charge(ctx: Any) -> dict[str, Any]:
            began.set()
            time.sleep(seconds)
            with lock:
                ledger.append((ctx.idempotency_key, ctx.fencing_token))
            return {"ok": True}

    else:

        @flow.tool(safety="lookup", timeout=timeout)
        async def charge(ctx: Any) -> dict[str, Any]:
            began.set()
            await asyncio.sleep(seconds)
            ledger.append((ctx.idempotency_key, ctx.fencing_token))
            return {"ok": True}

    @charge.lookup
    def find(ctx: Any) -> dict[str, Any] | None:
        with lock:
            hits = [e for e in ledger if e[0] == ctx.idempotency_key]
        return {"charges": len(hits)} if hits else None

    @flow.policy
    def decide(ctx: Any, history: list[Any]) -> list[ToolCall]:
        return [] if history else [ToolCall(ctx.input.get("tool", "charge"), {})]

    return flow


async def test_a_plain_def_tool_past_its_timeout_is_waited_for_not_sent_again(
    db: Db, start_worker: StartWorker
) -> None:
    ledger: list[tuple[str, int]] = []
    flow = _charging_flow("slowpay", ledger, seconds=0.8, timeout=0.2)
    await db.submit("slow-1", flow)
    await start_worker(flow)
    run = await db.wait_status("slow-1", "succeeded", "failed", "paused")

    assert run["status"] == "succeeded"
    assert ledger == [("slow-1:0:c0", 1)]  # charged once: no lookup-and-resend meanwhile
    [call] = await db.calls("slow-1")
    assert (call["status"], call["attempts"], call["result"]) == ("succeeded", 1, {"ok": True})


async def test_a_hung_renewal_does_not_keep_runs_unfenced(
    db: Db, database_url: str, start_worker: StartWorker
) -> None:
    ledger: list[tuple[str, int]] = []
    flow = _charging_flow("hung", ledger, seconds=4.0, sync=False)

    @flow.tool(safety="read_only")
    async def idle(ctx: Any) -> dict[str, Any]:
        await asyncio.sleep(30)
        return {}

    await db.submit("hung-x", flow, {"tool": "idle"})
    await db.submit("hung-y", flow, {"tool": "charge"})
    w1 = await start_worker(flow, worker_id="w1", lease_seconds=2.0, concurrency=2)
    await eventually(lambda: {"hung-x", "hung-y"} <= set(w1.worker.active), what="both held")

    # An open transaction holds a lock on run X: w1's one renewal statement for both
    # runs hangs behind it. Y's lease still ends by the clocks.
    blocker = await psycopg.AsyncConnection.connect(database_url)
    try:
        await blocker.execute("SELECT 1 FROM runledger.runs WHERE run_id = 'hung-x' FOR SHARE")
        await start_worker(flow, worker_id="w2", lease_seconds=2.0, concurrency=2, limits=FAST)
        run = await db.wait_status("hung-y", "succeeded", "failed", "paused", timeout=30)
    finally:
        await blocker.rollback()
        await blocker.close()
    assert run["status"] == "succeeded"
    # w1 stopped its own charge at its local deadline; only w2 (token 2) charged
    assert ledger == [("hung-y:0:c0", 2)]


async def test_a_drain_past_grace_keeps_the_lease_while_a_tool_thread_runs(
    db: Db, start_worker: StartWorker
) -> None:
    ledger: list[tuple[str, int]] = []
    started = threading.Event()
    flow = _charging_flow("drainpay", ledger, seconds=2.0, started=started)
    w1 = await start_worker(flow, worker_id="w1", grace_seconds=0.3, lease_seconds=10.0)
    await db.submit("drain-1", flow)
    # the drain must come while the tool runs in its 2 s thread (a drain before the
    # send hands the run back, rightly): wait for the thread, not for a guess of time
    await eventually(started.is_set, what="w1's tool thread running")
    await start_worker(flow, worker_id="w2", lease_seconds=10.0)
    await w1.stop()

    run = await db.wait_status("drain-1", "succeeded", "failed", "paused", timeout=30)
    assert run["status"] == "succeeded"
    assert ledger == [("drain-1:0:c0", 1)]  # the thread's charge, journaled, not repeated
    [call] = await db.calls("drain-1")
    assert (call["completed_by"], call["completed_token"], call["attempts"]) == ("w1", 1, 1)
    assert await db.events("drain-1", "lease_released") == []


async def test_the_tool_context_deadline_follows_renewals(
    db: Db, start_worker: StartWorker
) -> None:
    seen: list[float] = []
    flow = Flow("renewing", "1")

    @flow.tool(safety="read_only")
    async def watch(ctx: Any) -> dict[str, Any]:
        seen.append(ctx.deadline)
        await asyncio.sleep(1.6)  # two renewals of a 1.5 s lease
        seen.append(ctx.deadline)
        return {}

    @flow.policy
    def decide(ctx: Any, history: list[Any]) -> list[ToolCall]:
        return [] if history else [ToolCall("watch", {})]

    await db.submit("ren-1", flow)
    await start_worker(flow, lease_seconds=1.5, limits=Limits(backoff=0.01))
    run = await db.wait_status("ren-1", "succeeded", "failed", "paused")
    assert run["status"] == "succeeded"
    assert seen[1] > seen[0] + 0.5


async def test_a_crash_loop_with_a_call_in_flight_pauses_instead_of_failing(
    db: Db, store: Any, db_clock: Any, start_worker: StartWorker
) -> None:
    import datetime as dt

    ledger: list[tuple[str, int]] = []
    flow = _charging_flow("loopy", ledger, seconds=0.0)
    await db.submit("loopy-1", flow)
    # a previous holder recorded the turn and sent the call, then died ... many times
    ((ghost, _),) = await store.worker.claim_runs("ghost", ["loopy@1"], dt.timedelta(seconds=5), 1)
    lease = (ghost.run_id, ghost.lease_id, ghost.fencing_token)
    await store.worker.record_turn(*lease, 0, [{"call_id": "c0", "tool": "charge", "args": {}}])
    await store.worker.dispatch_call(*lease, "loopy-1:0:c0")
    await db.rows("UPDATE runledger.runs SET stalled_claims = 9 WHERE run_id = 'loopy-1'")
    db_clock.advance(6)

    await start_worker(flow)
    run = await db.wait_status("loopy-1", "succeeded", "failed", "paused")
    assert run["status"] == "paused"
    assert run["pause_reason"].startswith("crash_loop")
    [call] = await db.calls("loopy-1")
    assert call["status"] == "unknown"
    assert ledger == []  # nothing was sent again


async def test_a_tool_that_swallows_the_runs_cancellation_does_not_write_its_result(
    db: Db, start_worker: StartWorker
) -> None:
    """Fencing a run stops it at once and cancels its async tool. A tool that swallows
    the cancellation and returns must not have its value journaled by the fenced holder,
    whose lease the database would still take: the run stops there."""
    swallowed: list[str] = []
    inside = asyncio.Event()
    flow = Flow("swallow", "1")

    @flow.tool(safety="idempotent")
    async def stubborn(ctx: Any) -> dict[str, Any]:
        inside.set()
        try:
            await asyncio.sleep(30)
        except asyncio.CancelledError:
            swallowed.append(ctx.idempotency_key)
            return {"swallowed": True}
        return {"slept": True}

    @flow.policy
    def decide(ctx: Any, history: list[Any]) -> list[ToolCall]:
        return [] if history else [ToolCall("stubborn", {})]

    await db.submit("sw-1", flow)
    w1 = await start_worker(flow, worker_id="w1", lease_seconds=30.0)
    await asyncio.wait_for(inside.wait(), timeout=15)  # the tool waits: it was dispatched
    active = w1.worker.active["sw-1"]
    w1.worker._fence(active, "fenced by the test")
    assert active.task is not None
    await eventually(active.task.done, what="the run's task ended")

    assert swallowed == ["sw-1:0:c0"]
    assert active.task.cancelled()
    [call] = await db.calls("sw-1")
    assert (call["status"], call["completed_by"], call["result"]) == ("dispatched", None, None)
    assert await db.events("sw-1", "call_succeeded") == []
