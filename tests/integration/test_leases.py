"""Leases held by an in-process Worker: renewal during a long call, self-fencing when
the database says the lease is gone, and the bookkeeping of a run claimed again."""

from __future__ import annotations

import asyncio
import threading
from typing import Any

from runledger.flows import Flow, ToolCall
from tests.integration.conftest import Db, Recorder, StartWorker, eventually


def _flow(rec: Recorder, tool: Any) -> Flow:
    flow = Flow("leased", "1")
    flow.tool(safety="idempotent", name="work")(tool)

    @flow.policy
    def decide(ctx: Any, history: list[Any]) -> list[ToolCall]:
        rec.policy(ctx, history)
        return [] if history else [ToolCall("work", {})]

    return flow


async def test_lease_is_renewed_during_a_call_longer_than_the_lease(
    db: Db, start_worker: StartWorker
) -> None:
    rec = Recorder()

    async def work(ctx: Any) -> str:
        rec.tool(ctx)
        await asyncio.sleep(2.5)  # the call itself: longer than the 2 s lease
        return "done"

    flow = _flow(rec, work)
    await db.submit("renew-1", flow)
    await start_worker(flow, lease_seconds=2.0)
    run = await db.wait_status("renew-1", "succeeded", "failed", "paused")

    assert run["status"] == "succeeded"
    assert (run["fencing_token"], run["claims"]) == (1, 1)
    [call] = await db.calls("renew-1")
    assert (call["status"], call["attempts"], call["result"]) == ("succeeded", 1, "done")
    kinds = await db.kinds("renew-1")
    assert "takeover" not in kinds and "renewal_failed" not in kinds
    assert "stale_write_rejected" not in kinds


async def test_lease_lost_by_the_database_clock_fences_the_running_call(
    db: Db, db_clock: Any, start_worker: StartWorker
) -> None:
    rec = Recorder()
    cancelled: list[int] = []

    async def work(ctx: Any) -> str:
        rec.tool(ctx)
        if ctx.attempt == 1:
            try:
                await asyncio.sleep(30)
            except asyncio.CancelledError:
                cancelled.append(ctx.attempt)
                raise
        return f"attempt {ctx.attempt}"

    flow = _flow(rec, work)
    await db.submit("fence-1", flow)
    # One slot: the claimer cannot take the run again while the first task holds it.
    w = await start_worker(flow, lease_seconds=3.0, concurrency=1)
    await eventually(lambda: rec.tool_calls, what="tool running")
    db_clock.advance(10)  # the lease is now expired by the database clock

    run = await db.wait_status("fence-1", "succeeded", "failed", "paused")
    assert run["status"] == "succeeded"
    assert cancelled == [1]  # the in-flight async tool was cancelled (self-fencing)
    assert rec.tool_calls == [("work", "fence-1:0:c0", 1, 1), ("work", "fence-1:0:c0", 2, 2)]
    [call] = await db.calls("fence-1")
    assert (call["status"], call["attempts"], call["result"], call["completed_token"]) == (
        "succeeded",
        2,
        "attempt 2",
        2,
    )
    [failed] = await db.events("fence-1", "renewal_failed")
    assert failed["actor"] == w.worker_id
    [takeover] = await db.events("fence-1", "takeover")
    assert (takeover["actor"], takeover["fencing_token"]) == (w.worker_id, 2)
    assert takeover["detail"]["previous_token"] == 1
    assert rec.policy_turns == [0, 1]


async def test_reclaiming_its_own_expired_run_keeps_the_current_lease_tracked(
    db: Db, db_clock: Any, start_worker: StartWorker
) -> None:
    rec = Recorder()
    release = asyncio.Event()
    policy_gate, policy_waiting = threading.Event(), threading.Event()
    flow = Flow("leased", "1")

    @flow.tool(safety="idempotent")
    async def work(ctx: Any) -> str:
        rec.tool(ctx)
        await release.wait()
        return "done"

    @flow.policy
    def decide(ctx: Any, history: list[Any]) -> list[ToolCall]:
        rec.policy(ctx, history)
        if not history:
            return [ToolCall("work", {})]
        policy_waiting.set()
        assert policy_gate.wait(15)
        return []

    await db.submit("self-1", flow)
    w = await start_worker(flow)  # lease 30 s: the keeper does not tick during the test

    def run_tasks() -> list[asyncio.Task[Any]]:
        return [t for t in asyncio.all_tasks() if t.get_name() == "run:self-1" and not t.done()]

    try:
        await eventually(lambda: rec.tool_calls, what="tool running")
        db_clock.advance(60)  # lease expired by the database clock; the worker claims it again
        await eventually(lambda: len(rec.tool_calls) == 2, what="recovered call dispatched")
        release.set()
        await eventually(policy_waiting.is_set, what="policy of turn 1 running")
        await eventually(lambda: len(run_tasks()) == 1, what="one task left for the run")

        run = await db.run("self-1")
        assert (run["status"], run["fencing_token"], run["lease_owner"]) == (
            "running",
            2,
            w.worker_id,
        )
        held = w.worker.active.get("self-1")
        assert held is not None, "the worker drives the run but no longer tracks its lease"
        assert held.claim.lease_id == run["lease_id"]
    finally:
        policy_gate.set()
        release.set()
    assert (await db.wait_status("self-1", "succeeded", "failed"))["status"] == "succeeded"


async def test_a_renewal_that_races_the_runs_own_end_does_not_drop_it(
    db: Db, start_worker: StartWorker, caplog: Any
) -> None:
    """The final decision commits; a renewal sent meanwhile no longer finds the run
    running; the keeper sees that before the run's task has heard back from its write.
    That is the run's end, not a lost lease: no "dropping run" warning (3-16 of them per
    20,000 runs before, on a busy worker)."""
    import logging

    rec = Recorder()

    async def work(ctx: Any) -> str:
        rec.tool(ctx)
        return "done"

    flow = _flow(rec, work)
    rw = await start_worker(flow, lease_seconds=1.5)  # the keeper renews every 0.5 s
    store = rw.worker.store
    assert store is not None
    renewed_after_the_end = asyncio.Event()
    final_committed = asyncio.Event()
    real_renew, real_v4, real_fc = (
        store.renew_leases,
        store.record_turn,
        store.finish_and_claim,
    )

    async def renew(*args: Any, **kwargs: Any) -> Any:
        renewed = await real_renew(*args, **kwargs)
        if final_committed.is_set():
            renewed_after_the_end.set()
        return renewed

    async def ending(real: Any, *args: Any, **kwargs: Any) -> Any:
        answer = await real(*args, **kwargs)
        if kwargs.get("finish") or real is real_fc:  # the run's final decision
            final_committed.set()
            # hold the answer until the keeper has renewed without the run
            await asyncio.wait_for(renewed_after_the_end.wait(), timeout=10)
        return answer

    store.renew_leases = renew  # type: ignore[method-assign]
    store.record_turn = lambda *a, **k: ending(real_v4, *a, **k)  # type: ignore[method-assign]
    store.finish_and_claim = lambda *a, **k: ending(real_fc, *a, **k)  # type: ignore[method-assign]
    with caplog.at_level(logging.WARNING, logger="runledger.worker.process"):
        await db.submit("race-end", flow)
        run = await db.wait_status("race-end", "succeeded", "failed", "paused")
        # the race did happen: a renewal ran after the final commit, before its answer
        await asyncio.wait_for(renewed_after_the_end.wait(), timeout=10)
        await eventually(lambda: not rw.worker.active, what="the run's task ended")
    assert run["status"] == "succeeded"
    dropped = [r.getMessage() for r in caplog.records if "dropping run" in r.getMessage()]
    assert dropped == []


async def test_a_call_dispatched_by_a_write_that_lands_after_the_fence_is_released(
    db: Db, start_worker: StartWorker
) -> None:
    """The decision that dispatches the first call is on its way when the run is fenced
    locally; it lands, and no tool will ever send that call: it is released as not_sent
    (revision 0031), so the next holder sends it without waiting for this lease."""
    rec = Recorder()

    async def work(ctx: Any) -> str:
        rec.tool(ctx)
        return "done"

    flow = _flow(rec, work)
    rw = await start_worker(flow)
    store = rw.worker.store
    assert store is not None
    on_its_way, land = asyncio.Event(), asyncio.Event()
    real = store.record_turn

    async def held(*args: Any, **kwargs: Any) -> Any:
        on_its_way.set()
        await land.wait()
        return await real(*args, **kwargs)

    store.record_turn = held  # type: ignore[method-assign]
    await db.submit("fenced-dispatch", flow)
    await asyncio.wait_for(on_its_way.wait(), timeout=10)
    rw.worker._fence(rw.worker.active["fenced-dispatch"], "the test fences it")
    land.set()
    await eventually(lambda: db.events("fenced-dispatch", "send_released"), what="the release")
    [told] = await db.events("fenced-dispatch", "send_released")
    assert told["detail"]["ended"] == "not_sent" and told["detail"]["by"] == "sender"
    assert told["detail"]["idempotency_key"] == "fenced-dispatch:0:c0"
    [call] = await db.calls("fenced-dispatch")
    assert call["status"] == "dispatched"
    assert rec.calls_of("work") == []  # never sent


async def test_a_dispatch_that_lands_after_the_fence_is_released_as_not_sent(
    db: Db, start_worker: StartWorker
) -> None:
    """The same for a call sent again on its own (``dispatch_call``): the provider
    refused the first attempt (NotApplied, retry), the second one's dispatch is on its way
    when the run is fenced, and lands."""
    from runledger.flows import NotApplied

    rec = Recorder()

    async def work(ctx: Any) -> str:
        rec.tool(ctx)
        if ctx.attempt == 1:
            raise NotApplied("busy", retry=True)
        return "done"

    flow = _flow(rec, work)
    rw = await start_worker(flow)
    store = rw.worker.store
    assert store is not None
    on_its_way, land = asyncio.Event(), asyncio.Event()
    real = store.dispatch_call

    async def held(*args: Any, **kwargs: Any) -> Any:
        on_its_way.set()
        await land.wait()
        return await real(*args, **kwargs)

    store.dispatch_call = held  # type: ignore[method-assign]
    await db.submit("fenced-resend", flow)
    await asyncio.wait_for(on_its_way.wait(), timeout=10)
    rw.worker._fence(rw.worker.active["fenced-resend"], "the test fences it")
    land.set()
    await eventually(lambda: db.events("fenced-resend", "send_released"), what="the release")
    [told] = await db.events("fenced-resend", "send_released")
    assert told["detail"]["ended"] == "not_sent" and told["detail"]["attempt"] == 2
    assert [c[2] for c in rec.calls_of("work")] == [1]  # the second attempt never ran


async def test_a_release_under_way_when_the_run_is_fenced_still_lands(
    db: Db, start_worker: StartWorker
) -> None:
    """The tool returned but its result could not be written (the database went away, as
    in a failover); the worker tells the next holder, with the result, and that release
    is still on its way when the run is fenced (its listener lost: issue #36). It goes on
    in the background and lands: the next holder journals the result instead of pausing
    an unsafe call for a person."""
    from runledger import errors

    rec = Recorder()

    async def work(ctx: Any) -> str:
        rec.tool(ctx)
        return "done"

    flow = _flow(rec, work)
    rw = await start_worker(flow)
    store = rw.worker.store
    assert store is not None
    on_its_way, land = asyncio.Event(), asyncio.Event()
    real_release = store.release_call

    async def gone(*args: Any, **kwargs: Any) -> Any:
        raise errors.DatabaseUnavailable("the test: the primary went away")

    async def held(*args: Any, **kwargs: Any) -> Any:
        on_its_way.set()
        await land.wait()
        return await real_release(*args, **kwargs)

    store.complete_checked = gone  # type: ignore[method-assign]
    store.complete_and_dispatch = gone  # type: ignore[method-assign]
    store.release_call = held  # type: ignore[method-assign]
    await db.submit("fenced-release", flow)
    await asyncio.wait_for(on_its_way.wait(), timeout=10)
    rw.worker._fence(rw.worker.active["fenced-release"], "the test fences it")
    await eventually(lambda: "fenced-release" not in rw.worker.active, what="the run dropped")
    land.set()
    await eventually(lambda: db.events("fenced-release", "send_released"), what="the release")
    [told] = await db.events("fenced-release", "send_released")
    assert (told["detail"]["ended"], told["detail"]["result"]) == ("returned", "done")
    assert told["detail"]["by"] == "sender"
    assert [c[2] for c in rec.calls_of("work")] == [1]
