"""A worker with one run in hand claims its next run with that run's final decision
(``finish_and_claim``, revision 0026): one commit ends a run and claims the next. Rows
written by one transaction carry its id (``xmin``)."""

from __future__ import annotations

import asyncio
import itertools
import time
from typing import Any

from runledger.flows import Flow, ToolCall
from runledger.worker.claiming import NextClaim
from tests.integration.conftest import Db, StartWorker, eventually


def _flow(gate: asyncio.Event | None = None, entered: asyncio.Event | None = None) -> Flow:
    """One call, then the end. With ``gate``, the tool sets ``entered`` and waits for it."""
    flow = Flow("relay", "1")

    @flow.tool(safety="idempotent")
    async def step(ctx: Any) -> dict[str, Any]:
        if gate is not None:
            assert entered is not None
            entered.set()
            await gate.wait()
        return {"ok": True}

    @flow.policy
    async def decide(ctx: Any, history: list[Any]) -> list[ToolCall]:
        return [] if history else [ToolCall("step", {})]

    return flow


async def _tx(db: Db, run_id: str, kind: str) -> str:
    rows = await db.rows(
        "SELECT xmin::text AS tx FROM runledger.run_events WHERE run_id = %s AND kind = %s",
        run_id,
        kind,
    )
    assert len(rows) == 1, (run_id, kind, rows)
    return str(rows[0]["tx"])


async def test_a_lone_run_ends_in_the_commit_that_claims_the_next(
    db: Db, start_worker: StartWorker
) -> None:
    flow = _flow()
    ids = [f"relay-{i}" for i in range(4)]
    for run_id in ids:
        await db.submit(run_id, flow)
    await start_worker(flow, concurrency=1)
    for run_id in ids:
        assert (await db.wait_status(run_id, "succeeded", "failed", "paused"))["status"] == (
            "succeeded"
        )
    # the first run came from the claimer; each next one with its predecessor's end
    for before, after in itertools.pairwise(ids):
        assert await _tx(db, before, "run_succeeded") == await _tx(db, after, "claimed")
    # and the claimer's own claim stays apart from any decision
    first_claim = await _tx(db, ids[0], "claimed")
    assert first_claim not in {await _tx(db, r, "run_succeeded") for r in ids}


async def test_runs_claimed_with_a_final_decision_as_the_worker_stops_are_handed_back(
    db: Db, start_worker: StartWorker
) -> None:
    """The worker's drain waits for the runs it had when it began to stop: runs claimed
    by a final decision whose answer comes back after that are released at once."""
    # a run in hand whose tool waits for the test: the drain waits for it, so the
    # worker's store stays open while the claim below is out (the claimer polls every
    # 50 ms; with no run in hand the stop would close the store under a slow claim)
    entered, gate = asyncio.Event(), asyncio.Event()
    held = _flow(gate, entered)
    await db.submit("held", held)
    running = await start_worker(held, concurrency=1, grace_seconds=60.0)
    worker = running.worker
    assert worker.store is not None
    await eventually(entered.is_set, what="the held run's tool to start")
    other = Flow("elsewhere", "1")  # runs its own claimer leaves alone
    await db.submit("late-1", other)
    await db.submit("late-2", other)
    # the claim that went with some final decision, and the stop, came meanwhile
    request = NextClaim(
        worker_id=worker.worker_id,
        flows=(other.ref,),
        lease=worker.lease,
        max_runs=2,
        sent=time.monotonic(),
        generation=worker._generation,
    )
    running.request_stop()
    runs = await worker.store.claim_runs(
        request.worker_id, list(request.flows), request.lease, request.max_runs
    )
    assert sorted(r.run_id for r, _ in runs) == ["late-1", "late-2"]
    finishing = worker.active["held"]
    await worker.claimed(request, runs, finishing)
    for run_id in ("late-1", "late-2"):
        run = await db.run(run_id)
        assert (run["status"], run["lease_id"]) == ("queued", None)
        assert run_id not in worker.active
    kinds = await db.rows(
        "SELECT kind FROM runledger.run_events WHERE run_id = 'late-1' ORDER BY event_id"
    )
    assert [k["kind"] for k in kinds][-2:] == ["claimed", "lease_released"]
    assert not running.task.done()  # the run in hand kept the worker up throughout
    gate.set()
    await eventually(lambda: running.task.done(), what="the worker stopped")
    # the run in hand was draining: its call's result was journaled, then it was handed back
    assert (await db.run("held"))["status"] == "queued"
    calls = await db.rows("SELECT status FROM runledger.run_calls WHERE run_id = 'held'")
    assert [c["status"] for c in calls] == ["succeeded"]
