"""The crash-loop guard asks a ``lookup`` tool's provider before it gives a call in flight
up: a run killed again and again while its charge was on its way is not paused for a
person when the provider can say what became of the charge.

The earlier holders are played through the store (each claims the run, sends the call,
and vanishes: its lease expires by the database clock), so the run reaches the
stalled-claims limit with real claims in its journal; then a real worker claims it."""

from __future__ import annotations

import dataclasses
import datetime as dt
import threading
from typing import Any

from runledger import Unknowable
from runledger.flows import Flow, ToolCall
from runledger.present import evidence_lines
from tests.integration.conftest import FAST, Db, StartWorker

# holders that sent the call and vanished; the first also recorded the turn (progress),
# so the claims without progress are the other three's and the worker's: 4, the first
# claim over a limit of 3
GHOSTS = 4
STALLED = GHOSTS
LIMITS = dataclasses.replace(FAST, max_stalled_claims=STALLED - 1)


def _flow(
    name: str, ledger: list[str], *, lookup: str = "ledger", asked: list[str] | None = None
) -> Flow:
    """``charge`` (a lookup tool) charges ``ledger``; its lookup (each noted in
    ``asked``) reads it (``lookup="ledger"``), raises (``"fails"``), or cannot tell
    (``"unknowable"``)."""
    flow = Flow(name, "1")
    lock = threading.Lock()
    asked = [] if asked is None else asked

    @flow.tool(safety="lookup")
    def charge(ctx: Any) -> dict[str, Any]:
        with lock:
            ledger.append(ctx.idempotency_key)
        return {"ok": True}

    @charge.lookup
    def find(ctx: Any) -> dict[str, Any] | None:
        asked.append(ctx.idempotency_key)
        if lookup == "fails":
            raise ConnectionError("the provider's API is down")
        if lookup == "unknowable":
            raise Unknowable("past the provider's retention window")
        with lock:
            hits = [k for k in ledger if k == ctx.idempotency_key]
        return {"charge_id": f"ch_{len(hits)}", "found_by": "lookup"} if hits else None

    @flow.policy
    def decide(ctx: Any, history: list[Any]) -> list[ToolCall]:
        return [] if history else [ToolCall("charge", {}, "c0")]

    return flow


async def _ghosts(store: Any, db_clock: Any, run_id: str, flow: Flow) -> list[int]:
    """GHOSTS holders that each claim the run, send its call and vanish; their tokens."""
    tokens = []
    for i in range(GHOSTS):
        ((ghost, _),) = await store.worker.claim_runs(
            f"ghost{i}", [flow.ref], dt.timedelta(seconds=5), 1
        )
        lease = (ghost.run_id, ghost.lease_id, ghost.fencing_token)
        if i == 0:
            await store.worker.record_turn(
                *lease, 0, [{"call_id": "c0", "tool": "charge", "args": {}}]
            )
        await store.worker.dispatch_call(*lease, f"{run_id}:0:c0")
        tokens.append(ghost.fencing_token)
        db_clock.advance(6)  # past its lease
    return tokens


async def test_a_crash_loop_whose_charge_landed_journals_it_and_goes_on(
    db: Db, store: Any, db_clock: Any, start_worker: StartWorker
) -> None:
    ledger: list[str] = []
    flow = _flow("landed", ledger)
    await db.submit("landed-1", flow)
    await _ghosts(store, db_clock, "landed-1", flow)
    ledger.append("landed-1:0:c0")  # the last ghost's charge reached the provider

    await start_worker(flow, limits=LIMITS)
    run = await db.wait_status("landed-1", "succeeded", "failed", "paused")
    assert (run["status"], run["pause_reason"], run["error"]) == ("succeeded", None, None)
    [call] = await db.calls("landed-1")
    assert call["status"] == "succeeded"
    assert call["receipt"] == {"charge_id": "ch_1", "found_by": "lookup"}
    assert call["attempts"] == GHOSTS  # not sent again
    assert ledger == ["landed-1:0:c0"]
    assert run["stalled_claims"] == 0  # the journaled call is progress


async def test_a_crash_loop_whose_charge_never_landed_fails_with_nothing_in_flight(
    db: Db, store: Any, db_clock: Any, start_worker: StartWorker
) -> None:
    ledger: list[str] = []
    flow = _flow("missed", ledger)
    await db.submit("missed-1", flow)
    await _ghosts(store, db_clock, "missed-1", flow)

    await start_worker(flow, limits=LIMITS)
    run = await db.wait_status("missed-1", "succeeded", "failed", "paused")
    assert run["status"] == "failed"
    assert run["error"] == {"reason": "crash_loop", "claims_without_progress": STALLED}
    [call] = await db.calls("missed-1")
    # certainly without effect: back to planned (a retry sends it), never unknown
    assert call["status"] == "planned" and call["attempts"] == GHOSTS
    assert call["error"]["not_applied"] is True
    steps = [s["step"] for s in call["error"]["evidence"]]
    assert steps == ["stalled claim"] * (STALLED - 1) + ["earlier sender", "lookup"]
    assert ledger == []  # nothing was sent again


async def test_a_crash_loop_whose_charge_a_lookup_cannot_settle_pauses_with_the_claims(
    db: Db, store: Any, db_clock: Any, start_worker: StartWorker
) -> None:
    ledger: list[str] = []
    flow = _flow("blind", ledger, lookup="fails")
    await db.submit("blind-1", flow)
    tokens = await _ghosts(store, db_clock, "blind-1", flow)

    w = await start_worker(flow, limits=LIMITS)
    run = await db.wait_status("blind-1", "succeeded", "failed", "paused")
    assert run["status"] == "paused"
    assert run["pause_reason"].startswith(f"crash_loop: {STALLED} claims without progress")
    [call] = await db.calls("blind-1")
    assert call["status"] == "unknown"
    error = call["error"]
    assert (error["reason"], error["claims_without_progress"]) == ("crash_loop", STALLED)
    # the claims since the last progress (ghost0 recorded the turn), the worker's aside
    claims = [s for s in error["evidence"] if s["step"] == "stalled claim"]
    assert [(s["worker"], s["fencing_token"], s["ended"]) for s in claims] == [
        (f"ghost{i}", tokens[i], "lease_expired") for i in range(1, GHOSTS)
    ]
    for i, s in enumerate(claims, start=2):
        [sent] = s["observed"]  # what each holder did under its lease: it sent the call
        assert (sent["event"], sent["idempotency_key"], sent["attempt"]) == (
            "call_dispatched",
            "blind-1:0:c0",
            i,
        )
    lookups = [s for s in error["evidence"] if s["step"] == "lookup"]
    assert lookups and all(s["saw"] == "failed" for s in lookups)
    # as `runledger show` and `runledger unknown` print it
    lines = evidence_lines(error)
    assert lines[0].startswith("stalled claim at ")
    assert "ended lease_expired; worker ghost1; fencing_token " in lines[0]
    assert "event: call_dispatched" in lines[0]
    assert ledger == []
    assert w.worker_id not in [s.get("worker") for s in claims]  # its own claim is not one


async def test_a_crash_loop_whose_provider_cannot_tell_pauses(
    db: Db, store: Any, db_clock: Any, start_worker: StartWorker
) -> None:
    ledger: list[str] = []
    flow = _flow("forgot", ledger, lookup="unknowable")
    await db.submit("forgot-1", flow)
    await _ghosts(store, db_clock, "forgot-1", flow)

    await start_worker(flow, limits=LIMITS)
    run = await db.wait_status("forgot-1", "succeeded", "failed", "paused")
    assert run["status"] == "paused"
    [call] = await db.calls("forgot-1")
    assert call["status"] == "unknown"
    [lookup] = [s for s in call["error"]["evidence"] if s["step"] == "lookup"]
    assert lookup["saw"] == "unknowable"
    assert ledger == []


async def test_a_later_claim_over_the_limit_gives_up_without_looking_up(
    db: Db, store: Any, db_clock: Any, start_worker: StartWorker
) -> None:
    """Past the first claim over the limit, that claim ended without a word (its worker
    died, perhaps in the lookup itself): the run is given up without a lookup, so a
    lookup that kills the worker cannot keep it from being given up."""
    ledger: list[str] = []
    asked: list[str] = []
    flow = _flow("late", ledger, asked=asked)
    await db.submit("late-1", flow)
    await _ghosts(store, db_clock, "late-1", flow)
    ledger.append("late-1:0:c0")

    await start_worker(flow, limits=dataclasses.replace(LIMITS, max_stalled_claims=STALLED - 2))
    run = await db.wait_status("late-1", "succeeded", "failed", "paused")
    assert run["status"] == "paused"
    [call] = await db.calls("late-1")
    assert call["status"] == "unknown"
    assert [s["step"] for s in call["error"]["evidence"]] == ["stalled claim"] * (STALLED - 1)
    assert asked == []
