"""What the worker does with each way a tool can end: a result, ``NotApplied``, an
ambiguous exception, a timeout -- per safety class, with the same idempotency key on
every retry."""

from __future__ import annotations

import asyncio
import time
from typing import Any

from runledger.flows import Flow, NotApplied, Receipt, ToolCall
from tests.integration.conftest import Db, Recorder, StartWorker, eventually

SETTLED = ("succeeded", "failed", "paused")


def _one_call_flow(rec: Recorder, tool_name: str = "act") -> Flow:
    """A flow whose policy calls ``tool_name`` once in turn 0 and ends in turn 1."""
    flow = Flow("outcomes", "1")

    @flow.policy
    def decide(ctx: Any, history: list[Any]) -> list[ToolCall]:
        rec.policy(ctx, history)
        return [] if history else [ToolCall(tool_name, {"amount": 7})]

    return flow


async def _run(db: Db, start_worker: StartWorker, flow: Flow, run_id: str) -> dict[str, Any]:
    await db.submit(run_id, flow)
    await start_worker(flow)
    return await db.wait_status(run_id, *SETTLED)


# -- NotApplied ----------------------------------------------------------------------------


async def test_not_applied_fails_the_call_and_the_policy_sees_it(
    db: Db, start_worker: StartWorker
) -> None:
    rec = Recorder()
    flow = _one_call_flow(rec)

    @flow.tool(safety="unsafe")
    def act(ctx: Any, amount: int) -> dict[str, Any]:
        rec.tool(ctx)
        raise NotApplied("card declined")

    run = await _run(db, start_worker, flow, "na-1")

    assert run["status"] == "succeeded"  # a failed call is a result the policy acts on
    [call] = await db.calls("na-1")
    assert (call["status"], call["attempts"], call["result"]) == ("failed", 1, None)
    assert call["error"] == {"reason": "card declined", "not_applied": True}
    assert rec.tool_calls == [("act", "na-1:0:c0", 1, 1)]
    assert rec.policy_turns == [0, 1]
    [seen] = rec.histories[1][0].calls
    assert (seen.status, seen.result, seen.error) == (
        "failed",
        None,
        {"reason": "card declined", "not_applied": True},
    )
    assert await db.kinds("na-1") == [
        "submitted",
        "claimed",
        "turn_recorded",
        "call_dispatched",
        "call_failed",
        "checkpoint",
        "turn_recorded",
        "run_succeeded",
    ]


async def test_not_applied_retry_repeats_with_the_same_key_then_fails(
    db: Db, start_worker: StartWorker
) -> None:
    rec = Recorder()
    flow = _one_call_flow(rec)

    @flow.tool(safety="unsafe", max_attempts=3)
    async def act(ctx: Any, amount: int) -> dict[str, Any]:
        rec.tool(ctx)
        raise NotApplied("rate limited", retry=True)

    run = await _run(db, start_worker, flow, "na-2")

    assert run["status"] == "succeeded"
    assert rec.tool_calls == [("act", "na-2:0:c0", n, 1) for n in (1, 2, 3)]
    [call] = await db.calls("na-2")
    assert (call["status"], call["attempts"]) == ("failed", 3)
    assert call["error"] == {"reason": "rate limited", "not_applied": True}
    dispatched = await db.events("na-2", "call_dispatched")
    assert [(e["detail"]["attempt"], e["detail"]["idempotency_key"]) for e in dispatched] == [
        (1, "na-2:0:c0"),
        (2, "na-2:0:c0"),
        (3, "na-2:0:c0"),
    ]
    # between attempts the call is back to planned: a certain "no" is never left looking
    # like "in flight", which a crash would turn into unknown
    assert [e["detail"]["previous_status"] for e in dispatched] == ["planned"] * 3
    assert len(await db.events("na-2", "call_not_applied")) == 2
    assert len(await db.events("na-2", "call_failed")) == 1
    assert rec.histories[1][0].calls[0].status == "failed"


async def test_not_applied_retry_then_success(db: Db, start_worker: StartWorker) -> None:
    rec = Recorder()
    flow = _one_call_flow(rec)

    @flow.tool(safety="unsafe", max_attempts=3)
    def act(ctx: Any, amount: int) -> dict[str, Any]:
        rec.tool(ctx)
        if ctx.attempt == 1:
            raise NotApplied("busy", retry=True)
        return {"charged": amount}

    run = await _run(db, start_worker, flow, "na-3")
    assert run["status"] == "succeeded"
    [call] = await db.calls("na-3")
    assert (call["status"], call["attempts"], call["result"], call["error"]) == (
        "succeeded",
        2,
        {"charged": 7},
        None,
    )
    assert [c[1] for c in rec.tool_calls] == ["na-3:0:c0", "na-3:0:c0"]


# -- ambiguous failures ----------------------------------------------------------------------


async def test_idempotent_tool_raising_is_retried_with_the_same_key(
    db: Db, start_worker: StartWorker
) -> None:
    rec = Recorder()
    flow = _one_call_flow(rec)

    @flow.tool(safety="idempotent")
    def act(ctx: Any, amount: int) -> Receipt:
        rec.tool(ctx)
        if ctx.attempt == 1:
            raise ConnectionResetError("connection reset after sending")
        return Receipt(result={"charged": amount}, receipt={"charge": ctx.idempotency_key})

    run = await _run(db, start_worker, flow, "amb-1")

    assert run["status"] == "succeeded"
    assert rec.tool_calls == [("act", "amb-1:0:c0", 1, 1), ("act", "amb-1:0:c0", 2, 1)]
    [call] = await db.calls("amb-1")
    assert (call["status"], call["attempts"], call["result"], call["receipt"]) == (
        "succeeded",
        2,
        {"charged": 7},
        {"charge": "amb-1:0:c0"},
    )
    assert [e["kind"] for e in await db.events("amb-1") if e["kind"].startswith("call_")] == [
        "call_dispatched",
        "call_dispatched",
        "call_succeeded",
    ]


async def test_idempotent_tool_failing_every_attempt_becomes_unknown(
    db: Db, start_worker: StartWorker
) -> None:
    rec = Recorder()
    flow = _one_call_flow(rec)

    @flow.tool(safety="idempotent", max_attempts=2)
    def act(ctx: Any, amount: int) -> dict[str, Any]:
        rec.tool(ctx)
        raise ConnectionResetError("reset")

    run = await _run(db, start_worker, flow, "amb-2")

    assert run["status"] == "paused"
    assert run["pause_reason"] == (
        "call amb-2:0:c0 is unknown: reconcile it with "
        "`runledger resolve amb-2:0:c0 applied|not_applied|abandoned`"
    )
    [call] = await db.calls("amb-2")
    assert (call["status"], call["attempts"]) == ("unknown", 2)
    error = dict(call["error"])
    sends = error.pop("evidence")
    assert error == {
        "reason": "retries exhausted",
        "type": "ConnectionResetError",
        "message": "reset",
    }
    # each send, with how it ended: the person sees both attempts
    assert [(s["step"], s["attempt"], s["ended"]) for s in sends] == [
        ("send", 1, "raised"),
        ("send", 2, "raised"),
    ]
    assert sends[1]["error"] == {"type": "ConnectionResetError", "message": "reset"}
    assert len(rec.tool_calls) == 2
    assert rec.policy_turns == [0]


async def test_unsafe_tool_raising_becomes_unknown_and_pauses_the_run(
    db: Db, start_worker: StartWorker
) -> None:
    rec = Recorder()
    flow = _one_call_flow(rec)

    @flow.tool(safety="unsafe")
    def act(ctx: Any, amount: int) -> dict[str, Any]:
        rec.tool(ctx)
        raise OSError("socket closed mid-request")

    run = await _run(db, start_worker, flow, "amb-3")

    assert run["status"] == "paused"
    assert run["pause_reason"] == (
        "call amb-3:0:c0 is unknown: reconcile it with "
        "`runledger resolve amb-3:0:c0 applied|not_applied|abandoned`"
    )
    assert (run["lease_id"], run["lease_owner"], run["finished_at"]) == (None, None, None)
    [call] = await db.calls("amb-3")
    assert (call["status"], call["attempts"]) == ("unknown", 1)
    error = dict(call["error"])
    [send] = error.pop("evidence")
    assert error == {
        "reason": "ambiguous failure of an unsafe tool",
        "type": "OSError",
        "message": "socket closed mid-request",
    }
    assert (send["step"], send["ended"], send["error"]["type"]) == ("send", "raised", "OSError")
    assert len(rec.tool_calls) == 1  # never repeated
    assert rec.policy_turns == [0]
    assert await db.kinds("amb-3") == [
        "submitted",
        "claimed",
        "turn_recorded",
        "call_dispatched",
        "call_unknown",
        "run_paused",
    ]
    [paused] = await db.events("amb-3", "run_paused")
    assert paused["detail"] == {
        "reason": (
            "call amb-3:0:c0 is unknown: reconcile it with "
            "`runledger resolve amb-3:0:c0 applied|not_applied|abandoned`"
        )
    }


async def test_lookup_tool_raising_whose_effect_is_found_succeeds_without_resending(
    db: Db, start_worker: StartWorker
) -> None:
    rec = Recorder()
    flow = _one_call_flow(rec)
    provider: dict[str, str] = {}

    @flow.tool(safety="lookup")
    def act(ctx: Any, amount: int) -> Receipt:
        rec.tool(ctx)
        provider[ctx.idempotency_key] = "pay-1"  # the effect happens...
        raise TimeoutError("...but the response is lost")

    @act.lookup
    def find(ctx: Any) -> dict[str, Any] | None:
        rec.lookups.append(ctx.idempotency_key)
        pid = provider.get(ctx.idempotency_key)
        return None if pid is None else {"payment_id": pid}

    run = await _run(db, start_worker, flow, "amb-4")

    assert run["status"] == "succeeded"
    assert len(rec.tool_calls) == 1
    assert rec.lookups == ["amb-4:0:c0"]
    [call] = await db.calls("amb-4")
    assert (call["status"], call["attempts"]) == ("succeeded", 1)
    assert call["receipt"] == {"payment_id": "pay-1"}
    assert call["result"] == {"payment_id": "pay-1"}
    assert len(await db.events("amb-4", "call_dispatched")) == 1
    assert rec.histories[1][0].calls[0].status == "succeeded"


async def test_lookup_tool_raising_whose_effect_is_missing_is_sent_again_same_key(
    db: Db, start_worker: StartWorker
) -> None:
    rec = Recorder()
    flow = _one_call_flow(rec)

    @flow.tool(safety="lookup")
    def act(ctx: Any, amount: int) -> dict[str, Any]:
        rec.tool(ctx)
        if ctx.attempt == 1:
            raise ConnectionRefusedError("never reached the provider")
        return {"paid": amount}

    @act.lookup
    def find(ctx: Any) -> None:
        rec.lookups.append(ctx.idempotency_key)

    run = await _run(db, start_worker, flow, "amb-5")

    assert run["status"] == "succeeded"
    assert rec.tool_calls == [("act", "amb-5:0:c0", 1, 1), ("act", "amb-5:0:c0", 2, 1)]
    assert rec.lookups == ["amb-5:0:c0"]
    [call] = await db.calls("amb-5")
    assert (call["status"], call["attempts"], call["result"]) == ("succeeded", 2, {"paid": 7})


async def test_read_only_tool_failing_every_attempt_fails_the_call(
    db: Db, start_worker: StartWorker
) -> None:
    rec = Recorder()
    flow = _one_call_flow(rec)

    @flow.tool(safety="read_only", max_attempts=3)
    def act(ctx: Any, amount: int) -> dict[str, Any]:
        rec.tool(ctx)
        raise ValueError("bad response")

    run = await _run(db, start_worker, flow, "amb-6")

    assert run["status"] == "succeeded"
    [call] = await db.calls("amb-6")
    assert (call["status"], call["attempts"]) == ("failed", 3)
    assert call["error"] == {"type": "ValueError", "message": "bad response"}
    assert len(rec.tool_calls) == 3
    assert rec.histories[1][0].calls[0].status == "failed"


# -- timeouts are ambiguous ------------------------------------------------------------------


async def test_unsafe_tool_timeout_is_ambiguous_and_pauses(
    db: Db, start_worker: StartWorker
) -> None:
    rec = Recorder()
    flow = _one_call_flow(rec)
    cancelled: list[str] = []

    @flow.tool(safety="unsafe", timeout=0.2)
    async def act(ctx: Any, amount: int) -> dict[str, Any]:
        rec.tool(ctx)
        try:
            await asyncio.sleep(5)
        except asyncio.CancelledError:
            cancelled.append(ctx.idempotency_key)
            raise
        return {"too": "late"}

    started = time.monotonic()
    run = await _run(db, start_worker, flow, "to-1")
    elapsed = time.monotonic() - started

    assert run["status"] == "paused"
    assert elapsed < 4.0  # cut at 0.2 s, not after the 5 s sleep
    assert cancelled == ["to-1:0:c0"]
    [call] = await db.calls("to-1")
    assert (call["status"], call["attempts"]) == ("unknown", 1)
    assert call["error"]["reason"] == "ambiguous failure of an unsafe tool"
    assert call["error"]["type"] == "TimeoutError"
    assert len(rec.tool_calls) == 1


async def test_idempotent_tool_timeout_is_retried_with_the_same_key(
    db: Db, start_worker: StartWorker
) -> None:
    rec = Recorder()
    flow = _one_call_flow(rec)

    @flow.tool(safety="idempotent", timeout=0.2)
    async def act(ctx: Any, amount: int) -> dict[str, Any]:
        rec.tool(ctx)
        if ctx.attempt == 1:
            await asyncio.sleep(5)
        return {"attempt": ctx.attempt}

    run = await _run(db, start_worker, flow, "to-2")

    assert run["status"] == "succeeded"
    assert rec.tool_calls == [("act", "to-2:0:c0", 1, 1), ("act", "to-2:0:c0", 2, 1)]
    [call] = await db.calls("to-2")
    assert (call["status"], call["attempts"], call["result"]) == ("succeeded", 2, {"attempt": 2})


# -- bugs ----------------------------------------------------------------------------------


async def _let_go(db: Db, w: Any, run_id: str) -> dict[str, Any]:
    """The run once the worker has finished it, or dropped it with a call in flight."""

    async def check() -> dict[str, Any] | None:
        run = await db.run(run_id)
        in_flight = any(c["status"] == "dispatched" for c in await db.calls(run_id))
        if run_id in w.worker.active:
            return None
        return run if run["status"] in SETTLED or in_flight else None

    run: dict[str, Any] = await eventually(check, what=f"worker done with {run_id}")
    return run


async def test_tool_with_an_argument_named_timeout(db: Db, start_worker: StartWorker) -> None:
    rec = Recorder()
    flow = Flow("names", "1")

    @flow.tool(safety="idempotent")
    def wait_for_job(ctx: Any, job: str, timeout: int) -> dict[str, Any]:
        rec.tool(ctx)
        return {"job": job, "waited": timeout}

    @flow.policy
    def decide(ctx: Any, history: list[Any]) -> list[ToolCall]:
        rec.policy(ctx, history)
        return [] if history else [ToolCall("wait_for_job", {"job": "j1", "timeout": 3})]

    await db.submit("names-1", flow)
    w = await start_worker(flow)
    run = await _let_go(db, w, "names-1")
    assert run["status"] == "succeeded"
    [call] = await db.calls("names-1")
    assert call["result"] == {"job": "j1", "waited": 3}


async def test_tool_result_with_nan_is_journaled(db: Db, start_worker: StartWorker) -> None:
    rec = Recorder()
    flow = _one_call_flow(rec)

    @flow.tool(safety="idempotent")
    def act(ctx: Any, amount: int) -> dict[str, Any]:
        rec.tool(ctx)
        return {"score": float("nan")}

    await db.submit("nan-1", flow)
    w = await start_worker(flow)
    run = await _let_go(db, w, "nan-1")
    assert run["status"] in SETTLED
    [call] = await db.calls("nan-1")
    assert call["status"] in ("succeeded", "failed", "unknown")
    assert len(rec.tool_calls) == 1
