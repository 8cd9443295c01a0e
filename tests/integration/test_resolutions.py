"""What each resolution of an unknown call means, with a real in-process worker.

A run pauses on an ``unsafe`` call whose first attempt raised (ambiguous: unknown). Then
``applied``, ``not_applied`` or ``abandoned``; for each, the call's row, whether the tool
runs again, the run's next state, and the history the policy received next.
"""

from __future__ import annotations

import threading
from typing import Any

import pytest

from runledger import Client, Flow, ToolCall
from runledger.flows import HistoryCall, HistoryTurn
from tests.integration.conftest import Db, Recorder, StartWorker, eventually


async def in_thread(fn: Any) -> None:
    """Run a blocking Client call off the loop, so the worker in this loop keeps going."""
    failure: list[BaseException] = []

    def target() -> None:
        try:
            fn()
        except BaseException as exc:
            failure.append(exc)

    thread = threading.Thread(target=target)
    thread.start()
    await eventually(lambda: not thread.is_alive(), what="the client call")
    if failure:
        raise failure[0]


def _flow(rec: Recorder, *, fail_on_failed_call: bool) -> Flow:
    flow = Flow("resolutions", "1")

    @flow.tool(safety="unsafe")
    def send(ctx: Any, to: str) -> dict[str, str]:
        rec.tool(ctx)
        if len(rec.calls_of("send")) == 1:
            raise ConnectionResetError("no answer")  # ambiguous: the call becomes unknown
        return {"sent_to": to, "attempt": str(ctx.attempt)}

    @flow.policy
    def decide(ctx: Any, history: list[Any]) -> list[ToolCall]:
        rec.policy(ctx, history)
        if not history:
            return [ToolCall("send", {"to": "ops"})]
        if fail_on_failed_call and any(c.status == "failed" for t in history for c in t.calls):
            return [ToolCall("no_such_tool", {})]  # an invalid decision: the run fails
        return []  # "ends on any history"

    return flow


CASES = {
    # resolution: (receipt, call status, call result, tool attempts, run status, seen by policy)
    "applied": (
        {"message_id": "m-1"},
        "succeeded",
        {"message_id": "m-1"},
        1,
        "succeeded",
        ("succeeded", {"message_id": "m-1"}, None),
    ),
    "not_applied": (
        None,
        "succeeded",
        {"sent_to": "ops", "attempt": "2"},
        2,
        "succeeded",
        ("succeeded", {"sent_to": "ops", "attempt": "2"}, None),
    ),
    "abandoned": (
        None,
        "failed",
        None,
        1,
        "succeeded",  # the policy ended on a history with a failed call: the run SUCCEEDS
        ("failed", None, {"reason": "abandoned", "note": "gave up"}),
    ),
}


@pytest.mark.parametrize("resolution", list(CASES))
async def test_each_resolution_call_run_and_history(
    database_url: str, db: Db, start_worker: StartWorker, resolution: str
) -> None:
    receipt, call_status, call_result, attempts, run_status, seen = CASES[resolution]
    rec = Recorder()
    flow = _flow(rec, fail_on_failed_call=False)
    await db.submit("res-1", flow)
    await start_worker(flow)
    paused = await db.wait_status("res-1", "paused")
    assert "res-1:0:c0" in paused["pause_reason"]
    [call] = await db.calls("res-1")
    assert call["status"] == "unknown"

    def resolve() -> None:
        with Client(database_url, actor="ops:alice") as client:
            client.resolve("res-1:0:c0", resolution, receipt, "gave up")

    await in_thread(resolve)
    run = await db.wait_status("res-1", "succeeded", "failed", timeout=20)
    assert run["status"] == run_status
    [call] = await db.calls("res-1")
    assert (call["status"], call["result"], call["resolved_by"]) == (
        call_status,
        call_result,
        "ops:alice",
    )
    assert len(rec.calls_of("send")) == attempts
    assert {c[1] for c in rec.calls_of("send")} == {"res-1:0:c0"}  # the same key every time
    assert sorted(rec.histories) == [0, 1]  # decided once more, never twice for a turn
    status, result, error = seen
    assert rec.histories[1] == [
        HistoryTurn(
            turn=0,
            calls=(
                HistoryCall(
                    call_id="c0",
                    tool="send",
                    args={"to": "ops"},
                    status=status,
                    result=result,
                    error=error,
                ),
            ),
        )
    ]
    [resolved] = await db.events("res-1", "call_resolved")
    assert resolved["detail"]["resolution"] == resolution
    assert len(await db.events("res-1", "run_requeued")) == 1


async def test_abandoned_fails_the_run_only_if_the_policy_says_so(
    database_url: str, db: Db, start_worker: StartWorker
) -> None:
    rec = Recorder()
    flow = _flow(rec, fail_on_failed_call=True)
    await db.submit("res-2", flow)
    await start_worker(flow)
    await db.wait_status("res-2", "paused")

    def resolve() -> None:
        with Client(database_url) as client:
            client.resolve("res-2:0:c0", "abandoned", None, None)

    await in_thread(resolve)
    run = await db.wait_status("res-2", "succeeded", "failed", timeout=20)
    assert run["status"] == "failed"
    assert rec.histories[1][0].calls[0].status == "failed"
    assert len(rec.calls_of("send")) == 1


async def test_resolving_a_cancelled_run_changes_the_call_not_the_run(
    database_url: str, db: Db, start_worker: StartWorker
) -> None:
    rec = Recorder()
    flow = _flow(rec, fail_on_failed_call=False)
    await db.submit("res-3", flow)
    await start_worker(flow)
    await db.wait_status("res-3", "paused")

    def cancel_then_resolve() -> None:
        with Client(database_url) as client:
            client.cancel("res-3", "not needed")
            client.resolve("res-3:0:c0", "applied", {"message_id": "m-9"}, None)

    await in_thread(cancel_then_resolve)
    [call] = await db.calls("res-3")
    assert call["status"] == "succeeded"
    assert (await db.run("res-3"))["status"] == "cancelled"
    assert sorted(rec.histories) == [0]  # the policy was not asked again
