"""The worker after a failover (docs/failover.md), in-process, with the timeline change
made as in tests/contract/test_failover.py (a row says the schema last saw another
timeline).

What the lost timeline did is played on the test's provider (a dict of effects by key):
a charge and an email sent under keys whose dispatch, or whose whole decision, the
database no longer has. The worker must recover those calls by safety class -- the
lookup finds the charge, the email becomes unknown and the run pauses -- and send
nothing as new that may have been sent.
"""

from __future__ import annotations

import datetime as dt
import threading
from typing import Any

from runledger.flows import Flow, Receipt, ToolCall
from tests.integration.conftest import Db, StartWorker

PLAN = {
    "fo-lost": [["charge"], ["email"]],
    "fo-queued": [["ticket"], ["charge"]],
}


def make_flow(effects: dict[str, list[str]], lookups: list[str]) -> Flow:
    flow = Flow("failover", "1")
    lock = threading.Lock()

    def effect(key: str, kind: str) -> dict[str, Any]:
        with lock:
            effects.setdefault(key, []).append(kind)
            return {"key": key, "n": len(effects[key])}

    @flow.tool(safety="idempotent")
    def ticket(ctx: Any) -> dict[str, Any]:
        with lock:
            if ctx.idempotency_key in effects:  # the provider deduplicates the key
                return {"key": ctx.idempotency_key, "n": 1}
        return effect(ctx.idempotency_key, "ticket")

    @flow.tool(safety="lookup")
    def charge(ctx: Any) -> Receipt:
        found = effect(ctx.idempotency_key, "charge")
        return Receipt(result={"charged": True}, receipt=found)

    @charge.lookup
    def find_charge(ctx: Any) -> dict[str, Any] | None:
        with lock:
            lookups.append(ctx.idempotency_key)
            return {"key": ctx.idempotency_key} if ctx.idempotency_key in effects else None

    @flow.tool(safety="unsafe")
    def email(ctx: Any) -> dict[str, Any]:
        return effect(ctx.idempotency_key, "email")

    @flow.policy
    def decide(ctx: Any, history: list[Any]) -> list[ToolCall]:
        plan = PLAN.get(ctx.run_id, [["charge"]])
        if ctx.turn >= len(plan):
            return []
        return [ToolCall(tool, {}) for tool in plan[ctx.turn]]

    return flow


async def test_calls_that_may_have_been_sent_on_the_lost_timeline_are_recovered_by_class(
    db: Db, start_worker: StartWorker
) -> None:
    effects: dict[str, list[str]] = {}
    lookups: list[str] = []
    flow = make_flow(effects, lookups)
    # fo-lost: a worker of the old timeline recorded turn 0; its dispatch of the charge,
    # the charge's result and the whole of turn 1 (an email, sent) are lost
    await db.submit("fo-lost", flow)
    (held,) = await db.rows(
        "SELECT * FROM runledger.claim_runs_v4('old-worker', ARRAY['failover@1'], %s, 1)",
        dt.timedelta(hours=1),
    )
    await db.rows(
        "SELECT runledger.record_turn_v4(%s, %s, %s, 0, %s::jsonb,"
        " NULL, NULL, NULL, NULL, false, NULL)",
        "fo-lost",
        held["lease_id"],
        held["fencing_token"],
        '[{"call_id": "c0", "tool": "charge", "args": {}}]',
    )
    effects["fo-lost:0:c0"] = ["charge"]
    effects["fo-lost:1:c0"] = ["email"]
    # fo-queued: queued here; the lost timeline may have run it too (it did not)
    await db.submit("fo-queued", flow)
    await db.rows(
        "INSERT INTO runledger.timelines (position, timeline, seen_at) "
        "SELECT max(position) + 1, runledger._timeline() + 1, now() FROM runledger.timelines"
    )

    await start_worker(flow)
    lost = await db.wait_status("fo-lost", "paused", "succeeded", "failed")
    queued = await db.wait_status("fo-queued", "paused", "succeeded", "failed")

    # the charge whose dispatch was lost was looked up, found, and never sent again
    assert effects["fo-lost:0:c0"] == ["charge"]
    calls = {c["idempotency_key"]: c for c in await db.calls("fo-lost")}
    assert calls["fo-lost:0:c0"]["status"] == "succeeded"
    assert calls["fo-lost:0:c0"]["receipt"] == {"key": "fo-lost:0:c0"}
    # the email of a turn decided again under the same key was not sent: unknown, paused
    assert effects["fo-lost:1:c0"] == ["email"]
    assert calls["fo-lost:1:c0"]["status"] == "unknown"
    assert "failover" in calls["fo-lost:1:c0"]["error"]["reason"]
    assert lost["status"] == "paused"
    assert "fo-lost:1:c0" in lost["pause_reason"]
    # the queued run: the idempotent ticket went out with its key, the charge was looked
    # up first (not found), then sent once
    assert queued["status"] == "succeeded"
    assert effects["fo-queued:0:c0"] == ["ticket"]
    assert effects["fo-queued:1:c0"] == ["charge"]
    assert lookups.count("fo-queued:1:c0") == 1
    assert lookups.count("fo-lost:0:c0") == 1
    # both were listed as affected, and their failover is in their events
    for run_id in ("fo-lost", "fo-queued"):
        assert len(await db.events(run_id, "failover_detected")) == 1


async def test_a_run_submitted_after_the_failover_is_not_doubted(
    db: Db, start_worker: StartWorker
) -> None:
    effects: dict[str, list[str]] = {}
    lookups: list[str] = []
    flow = make_flow(effects, lookups)
    await db.rows(
        "INSERT INTO runledger.timelines (position, timeline, seen_at) "
        "SELECT max(position) + 1, runledger._timeline() + 1, now() FROM runledger.timelines"
    )
    await db.submit("fo-first", flow)
    await start_worker(flow)
    await db.wait_status("fo-first", "succeeded")  # it was affected: queued at detection
    await db.submit("fo-after", flow)
    after = await db.wait_status("fo-after", "succeeded", "paused", "failed")
    assert after["status"] == "succeeded"
    assert effects["fo-after:0:c0"] == ["charge"]
    assert "fo-after:0:c0" not in lookups  # sent at once: no failover doubts it
    assert "fo-first:0:c0" in lookups
