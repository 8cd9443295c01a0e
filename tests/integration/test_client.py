"""``Client`` (the synchronous API) against a real database and an in-process Worker.

Client calls that block until the worker acts (``wait``) run in a thread, so the
worker in the test's loop keeps going.
"""

from __future__ import annotations

import asyncio
import threading
from collections.abc import Iterator
from typing import Any

import pytest

from runledger import Client, Flow, InvalidTransition, RunConflict, RunNotFound, ToolCall
from runledger.errors import InvalidInput
from tests.integration.conftest import Db, Recorder, StartWorker, eventually

SETTLED = ("succeeded", "failed", "paused", "cancelled")


@pytest.fixture
def client(database_url: str) -> Iterator[Client]:
    with Client(database_url, actor="ops:alice") as c:
        yield c


def _echo_flow(rec: Recorder, version: str = "1") -> Flow:
    flow = Flow("echo", version)

    @flow.tool(safety="idempotent")
    def echo(ctx: Any, text: str) -> str:
        rec.tool(ctx)
        return text.upper()

    @flow.policy
    def decide(ctx: Any, history: list[Any]) -> list[ToolCall]:
        rec.policy(ctx, history)
        return [] if history else [ToolCall("echo", {"text": ctx.input["text"]})]

    return flow


def test_submit_is_idempotent_per_run_id_and_refuses_a_conflict(client: Client) -> None:
    flow = _echo_flow(Recorder())
    first = client.submit(flow, {"text": "hi"}, run_id="cl-1")
    again = client.submit(flow, {"text": "hi"}, run_id="cl-1")
    assert (first.run_id, first.created) == ("cl-1", True)
    assert (again.run_id, again.created) == ("cl-1", False)

    with pytest.raises(RunConflict) as conflict:
        client.submit(flow, {"text": "other"}, run_id="cl-1")
    assert conflict.value.sqlstate == "RL005"
    assert conflict.value.run_id == "cl-1"
    with pytest.raises(RunConflict):
        client.submit(flow, {"text": "hi"}, run_id="cl-1", version="2")
    with pytest.raises(RunConflict):
        client.submit("other-flow@1", {"text": "hi"}, run_id="cl-1")
    assert client.submit("echo@1", {"text": "hi"}, run_id="cl-1").created is False

    run = client.get("cl-1")
    assert (run.status, run.flow, run.flow_version, run.input) == (
        "queued",
        "echo",
        "1",
        {"text": "hi"},
    )
    assert len([e for e in client.events("cl-1") if e.kind == "submitted"]) == 1

    generated = client.submit("echo@1", {"text": "x"})
    assert generated.created and generated.run_id.startswith("run-")
    assert client.get(generated.run_id).status == "queued"


def test_client_refusals_are_typed(client: Client) -> None:
    with pytest.raises(RunNotFound):
        client.get("no-such-run")
    with pytest.raises(InvalidInput):
        client.submit("echo@1", {"text": "x"}, run_id="bad id!")
    with pytest.raises(InvalidInput):
        client.submit("echo", {"text": "x"})  # no version and no worker registered one
    with pytest.raises(RunNotFound):
        client.resolve("no-such-run:0:c0", "applied")
    client.submit("echo@1", {}, run_id="cl-wait")
    with pytest.raises(TimeoutError, match="still queued"):
        client.wait("cl-wait", timeout=0.2)


async def test_wait_and_get_follow_the_run_to_the_end(
    client: Client, start_worker: StartWorker
) -> None:
    rec = Recorder()
    flow = _echo_flow(rec)
    await start_worker(flow)
    # a worker registered echo@1: the bare name now resolves to it
    res = client.submit("echo", {"text": "hello"}, run_id="cl-2")
    assert res.created

    run = await asyncio.to_thread(client.wait, "cl-2", 15.0)
    assert run.status == "succeeded"
    assert run.result == {"turns": 2, "calls": 1}
    assert client.get("cl-2") == run
    [call] = client.calls("cl-2")
    assert (call.idempotency_key, call.status, call.result) == ("cl-2:0:c0", "succeeded", "HELLO")
    assert client.events("cl-2")[-1].kind == "run_succeeded"


# -- resolving an unknown call ----------------------------------------------------------


def _mailer(rec: Recorder, fail_first: bool = True) -> Flow:
    flow = Flow("mailer", "1")

    @flow.tool(safety="unsafe")
    def send(ctx: Any, to: str) -> dict[str, Any]:
        rec.tool(ctx)
        if fail_first and len(rec.tool_calls) == 1:
            raise ConnectionResetError("no response from the mail server")
        return {"message_id": f"m-{ctx.attempt}"}

    @flow.policy
    def decide(ctx: Any, history: list[Any]) -> list[ToolCall]:
        rec.policy(ctx, history)
        return [] if history else [ToolCall("send", {"to": "bob@example.com"})]

    return flow


@pytest.mark.parametrize("resolution", ["applied", "not_applied", "abandoned"])
async def test_resolve_an_unknown_call(
    db: Db, client: Client, start_worker: StartWorker, resolution: str
) -> None:
    rec = Recorder()
    flow = _mailer(rec)
    client.submit(flow, {}, run_id="res-1")
    w = await start_worker(flow)
    paused = await db.wait_status("res-1", *SETTLED)
    assert paused["status"] == "paused"
    key = "res-1:0:c0"
    assert paused["pause_reason"] == (
        f"call {key} is unknown: reconcile it with "
        f"`runledger resolve {key} applied|not_applied|abandoned`"
    )
    with pytest.raises(InvalidTransition):
        client.retry("res-1")  # an unknown call must be resolved first

    receipt = {"message_id": "m-from-the-mail-log"} if resolution == "applied" else None
    client.resolve(key, resolution, receipt=receipt, note="checked the mail log")
    run = await db.wait_status("res-1", "succeeded", "failed", "cancelled")
    assert run["status"] == "succeeded"

    [call] = await db.calls("res-1")
    assert call["resolved_by"] == "ops:alice"
    assert call["resolution_note"] == "checked the mail log"
    seen = rec.histories[1][0].calls[0]
    if resolution == "applied":
        assert (call["status"], call["attempts"]) == ("succeeded", 1)
        assert call["receipt"] == receipt and call["result"] == receipt
        assert len(rec.tool_calls) == 1  # not sent again
        assert (seen.status, seen.result) == ("succeeded", receipt)
    elif resolution == "not_applied":
        assert (call["status"], call["attempts"], call["result"]) == (
            "succeeded",
            2,
            {"message_id": "m-2"},
        )
        # dispatched again with the same key, by the new lease
        assert rec.tool_calls == [("send", key, 1, 1), ("send", key, 2, 2)]
        assert (call["dispatched_token"], call["completed_token"]) == (2, 2)
        assert seen.status == "succeeded"
    else:
        assert (call["status"], call["attempts"]) == ("failed", 1)
        assert call["error"] == {"reason": "abandoned", "note": "checked the mail log"}
        assert len(rec.tool_calls) == 1
        assert (seen.status, seen.error) == (
            "failed",
            {"reason": "abandoned", "note": "checked the mail log"},
        )
    assert rec.policy_turns == [0, 1]

    kinds = await db.kinds("res-1")
    i = kinds.index("run_paused")
    assert kinds[i + 1 : i + 4] == ["call_resolved", "run_requeued", "claimed"]
    [resolved] = await db.events("res-1", "call_resolved")
    assert resolved["actor"] == "ops:alice"
    assert resolved["detail"]["resolution"] == resolution
    [_, second] = await db.events("res-1", "claimed")
    assert (second["actor"], second["fencing_token"]) == (w.worker_id, 2)

    with pytest.raises(InvalidTransition):
        client.resolve(key, "applied")  # no longer unknown


# -- cancel and retry ---------------------------------------------------------------------


async def test_cancel_of_a_running_run_makes_the_worker_drop_it(
    db: Db, client: Client, start_worker: StartWorker
) -> None:
    rec = Recorder()
    running, release = threading.Event(), threading.Event()
    flow = Flow("long", "1")

    @flow.tool(safety="idempotent")
    def crunch(ctx: Any) -> str:
        rec.tool(ctx)
        running.set()
        assert release.wait(10)
        return "crunched"

    @flow.policy
    def decide(ctx: Any, history: list[Any]) -> list[ToolCall]:
        rec.policy(ctx, history)
        return [] if history else [ToolCall("crunch", {})]

    client.submit(flow, {}, run_id="can-1")
    w = await start_worker(flow)
    try:
        await eventually(running.is_set, what="tool running")
        client.cancel("can-1", reason="user gave up")
    finally:
        release.set()

    stale = await eventually(
        lambda: db.events("can-1", "stale_write_rejected"), what="stale write recorded"
    )
    await eventually(lambda: "can-1" not in w.worker.active, what="worker dropped the run")

    [event] = stale
    assert event["actor"] == w.worker_id
    assert event["fencing_token"] is None  # only current tokens go in the column
    assert event["detail"]["operation"] == "complete_call"
    assert event["detail"]["stale_token"] == 1
    assert event["detail"]["current_owner"] is None

    run = await db.run("can-1")
    assert (run["status"], run["lease_id"], run["fencing_token"]) == ("cancelled", None, 1)
    assert run["error"] == {"reason": "cancelled", "note": "user gave up"}
    [call] = await db.calls("can-1")
    # the call was in flight when the run was cancelled: unknown, for a person to reconcile
    assert (call["status"], call["result"], call["completed_token"]) == ("unknown", None, None)
    assert call["error"] == {"reason": "cancelled while in flight"}
    client.resolve("can-1:0:c0", "applied", {"checked": True}, note="it did crunch")
    [call] = await db.calls("can-1")
    assert call["status"] == "succeeded"
    assert (await db.run("can-1"))["status"] == "cancelled"  # resolved, not resumed
    assert rec.policy_turns == [0]
    kinds = await db.kinds("can-1")
    assert kinds[kinds.index("run_cancelled") :] == [
        "run_cancelled",
        "stale_write_rejected",
        "call_resolved",
    ]
    [cancelled] = await db.events("can-1", "run_cancelled")
    assert cancelled["actor"] == "ops:alice"
    assert cancelled["detail"]["previous_owner"] == w.worker_id

    with pytest.raises(InvalidTransition):
        client.retry("can-1")
    client.cancel("can-1")  # cancelling again is a no-op


async def test_retry_of_a_failed_run_requeues_it(
    db: Db, client: Client, start_worker: StartWorker
) -> None:
    rec = Recorder()
    flow = Flow("second-chance", "1")
    model_up = False

    @flow.policy
    def decide(ctx: Any, history: list[Any]) -> list[ToolCall]:
        rec.policy(ctx, history)
        if not model_up:
            raise RuntimeError("model down")
        return []

    client.submit(flow, {}, run_id="rty-1")
    w = await start_worker(flow)
    failed = await asyncio.to_thread(client.wait, "rty-1", 15.0)
    assert failed.status == "failed"
    assert failed.error["reason"] == "policy_error"
    assert rec.policy_turns == [0, 0, 0]

    with pytest.raises(InvalidTransition):
        client.cancel("rty-1")  # a finished run cannot be cancelled
    model_up = True
    client.retry("rty-1")
    run = await db.wait_status("rty-1", "succeeded")
    assert (run["status"], run["error"], run["claims"], run["fencing_token"]) == (
        "succeeded",
        None,
        2,
        2,
    )
    assert rec.policy_turns == [0, 0, 0, 0]
    [requeued] = await db.events("rty-1", "run_requeued")
    assert requeued["actor"] == "ops:alice"
    assert requeued["detail"] == {"after": "retry_run", "previous_status": "failed"}
    assert [e["actor"] for e in await db.events("rty-1", "claimed")] == [w.worker_id] * 2
    with pytest.raises(InvalidTransition):
        client.retry("rty-1")  # only failed or paused runs
