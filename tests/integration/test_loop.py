"""The journaled loop, driven by a real in-process Worker against a real database.

Each test defines its flow here, so it can count policy calls and see exactly what
the tools were given; it then checks the rows an auditor would read.
"""

from __future__ import annotations

import asyncio
import datetime as dt
import threading
from typing import Any

import psycopg
import pytest

from runledger.flows import Flow, InvalidDecision, Receipt, ToolCall
from runledger.worker.executor import Limits
from tests.integration.conftest import FAST, Db, Recorder, StartWorker, eventually

# -- happy path -----------------------------------------------------------------------


async def test_happy_path_journals_every_step_in_order(
    db: Db, database_url: str, start_worker: StartWorker
) -> None:
    rec = Recorder()
    seen_by_tool: dict[str, tuple[str, int]] = {}
    seen_by_policy: dict[int, list[tuple[str, str]]] = {}

    def journal() -> list[tuple[str, str]]:
        with psycopg.connect(database_url) as c:
            return [
                (k, s)
                for k, s in c.execute(
                    "SELECT idempotency_key, status FROM runledger.run_calls "
                    "WHERE run_id = 'happy-1' ORDER BY turn, position"
                ).fetchall()
            ]

    flow = Flow("happy", "1")

    @flow.tool(safety="idempotent")
    def create_ticket(ctx: Any, title: str) -> Receipt:
        rec.tool(ctx)
        with psycopg.connect(database_url) as c:
            row = c.execute(
                "SELECT status, attempts FROM runledger.run_calls WHERE idempotency_key = %s",
                (ctx.idempotency_key,),
            ).fetchone()
        assert row is not None
        seen_by_tool[ctx.idempotency_key] = (row[0], row[1])
        return Receipt(result={"ticket_id": f"T-{title}"}, receipt={"provider_id": "p-42"})

    @flow.tool(safety="read_only")
    async def find_user(ctx: Any, name: str) -> dict[str, Any]:
        rec.tool(ctx)
        return {"email": f"{name}@example.com"}

    @flow.tool(safety="unsafe")
    def send_email(ctx: Any, to: str, subject: str) -> dict[str, Any]:
        rec.tool(ctx)
        return {"sent": True}

    @flow.policy
    def decide(ctx: Any, history: list[Any]) -> list[ToolCall]:
        rec.policy(ctx, history)
        seen_by_policy[ctx.turn] = journal()
        if ctx.turn == 0:
            return [
                ToolCall("create_ticket", {"title": ctx.input["title"]}),
                ToolCall("find_user", {"name": "ana"}, call_id="who"),
            ]
        if ctx.turn == 1:
            ticket = history[0].calls[0].result["ticket_id"]
            email = history[0].calls[1].result["email"]
            return [ToolCall("send_email", {"to": email, "subject": f"ticket {ticket}"})]
        return []

    await db.submit("happy-1", flow, {"title": "printer"})
    w = await start_worker(flow)
    run = await db.wait_status("happy-1", "succeeded", "failed", "paused")

    assert run["status"] == "succeeded"
    assert run["result"] == {"turns": 3, "calls": 3}
    assert run["state"] == {"completed_turns": 2}
    assert run["state_version"] == 2
    assert (run["fencing_token"], run["claims"]) == (1, 1)
    assert run["lease_id"] is None and run["lease_owner"] is None and run["finished_at"] is not None
    assert run["error"] is None

    # The policy was called once per turn, and each time turn N-1 was already journaled.
    assert rec.policy_turns == [0, 1, 2]
    assert seen_by_policy[0] == []
    assert seen_by_policy[1] == [("happy-1:0:c0", "succeeded"), ("happy-1:0:who", "succeeded")]
    assert seen_by_policy[2] == [
        ("happy-1:0:c0", "succeeded"),
        ("happy-1:0:who", "succeeded"),
        ("happy-1:1:c0", "succeeded"),
    ]
    h1 = rec.histories[1]
    assert [t.turn for t in h1] == [0]
    assert [(c.call_id, c.tool, c.status, c.result) for c in h1[0].calls] == [
        ("c0", "create_ticket", "succeeded", {"ticket_id": "T-printer"}),
        ("who", "find_user", "succeeded", {"email": "ana@example.com"}),
    ]
    # dispatch_call had committed before the tool ran.
    assert seen_by_tool == {"happy-1:0:c0": ("dispatched", 1)}
    assert rec.tool_calls == [
        ("create_ticket", "happy-1:0:c0", 1, 1),
        ("find_user", "happy-1:0:who", 1, 1),
        ("send_email", "happy-1:1:c0", 1, 1),
    ]

    ledger = await db.ledger("happy-1")
    assert [(x["idempotency_key"], x["tool"], x["status"], x["attempts"]) for x in ledger] == [
        ("happy-1:0:c0", "create_ticket", "succeeded", 1),
        ("happy-1:0:who", "find_user", "succeeded", 1),
        ("happy-1:1:c0", "send_email", "succeeded", 1),
    ]
    assert ledger[0]["receipt"] == {"provider_id": "p-42"}
    assert ledger[1]["receipt"] is None
    assert ledger[2]["args"] == {"to": "ana@example.com", "subject": "ticket T-printer"}
    for x in ledger:
        assert (x["dispatched_by"], x["completed_by"]) == (w.worker_id, w.worker_id)
        assert (x["dispatched_token"], x["completed_token"]) == (1, 1)
        assert (x["flow"], x["flow_version"]) == ("happy", "1")
    assert [t["calls"] for t in await db.turns("happy-1")] == [
        [
            {"call_id": "c0", "tool": "create_ticket", "args": {"title": "printer"}},
            {"call_id": "who", "tool": "find_user", "args": {"name": "ana"}},
        ],
        [
            {
                "call_id": "c0",
                "tool": "send_email",
                "args": {"to": "ana@example.com", "subject": "ticket T-printer"},
            }
        ],
        [],
    ]

    events = await db.events("happy-1")
    assert [e["kind"] for e in events] == [
        "submitted",
        "claimed",
        "turn_recorded",
        "call_dispatched",
        "call_succeeded",
        "call_dispatched",
        "call_succeeded",
        "checkpoint",
        "turn_recorded",
        "call_dispatched",
        "call_succeeded",
        "checkpoint",
        "turn_recorded",
        "run_succeeded",
    ]
    assert all(e["actor"] == w.worker_id for e in events[1:])
    assert all(e["fencing_token"] == 1 for e in events[1:])
    assert [e["detail"]["turn"] for e in events if e["kind"] == "turn_recorded"] == [0, 1, 2]
    assert [e["state_version"] for e in events if e["kind"] == "checkpoint"] == [1, 2]


@pytest.mark.parametrize("policy_kind", ["sync", "async"])
@pytest.mark.parametrize("tool_kind", ["sync", "async"])
async def test_sync_and_async_tools_and_policies(
    db: Db, start_worker: StartWorker, policy_kind: str, tool_kind: str
) -> None:
    rec = Recorder()
    flow = Flow("kinds", "1")
    loop_thread = threading.get_ident()

    if tool_kind == "sync":

        @flow.tool(safety="idempotent")
        def double(ctx: Any, n: int) -> dict[str, Any]:
            rec.tool(ctx)
            return {"n": 2 * n}
    else:

        @flow.tool(safety="idempotent")
        async def double(ctx: Any, n: int) -> dict[str, Any]:
            rec.tool(ctx)
            await asyncio.sleep(0)
            return {"n": 2 * n}

    policy_threads: set[int] = set()

    def decide_sync(ctx: Any, history: list[Any]) -> list[ToolCall]:
        rec.policy(ctx, history)
        policy_threads.add(threading.get_ident())
        if not history:
            return [ToolCall("double", {"n": ctx.input["n"]})]
        if len(history) == 1:
            return [ToolCall("double", {"n": history[0].calls[0].result["n"]})]
        return []

    async def decide_async(ctx: Any, history: list[Any]) -> list[ToolCall]:
        await asyncio.sleep(0)
        return decide_sync(ctx, history)

    flow.policy(decide_sync if policy_kind == "sync" else decide_async)

    await db.submit("kinds-1", flow, {"n": 5})
    await start_worker(flow)
    run = await db.wait_status("kinds-1", "succeeded", "failed", "paused")

    assert run["status"] == "succeeded"
    assert [c["result"] for c in await db.calls("kinds-1")] == [{"n": 10}, {"n": 20}]
    assert rec.policy_turns == [0, 1, 2]
    # Plain def code runs in a thread, async code on the worker's loop.
    assert (loop_thread in rec.threads["double"]) == (tool_kind == "async")
    assert (loop_thread in policy_threads) == (policy_kind == "async")


# -- decisions are validated before they are recorded ------------------------------------


@pytest.mark.parametrize(
    ("decision", "message"),
    [
        (ToolCall("no_such_tool", {}), "unknown tool 'no_such_tool'"),
        (ToolCall("transfer", {"amount": 5}), "missing a required argument: 'to'"),
        (
            ToolCall("transfer", {"amount": 5, "to": "x", "memo": "hi"}),
            "got an unexpected keyword argument 'memo'",
        ),
        ("transfer", "is str, not ToolCall"),
        (ToolCall("transfer", {"amount": 1, "to": "x"}, call_id="bad id"), "invalid or repeated"),
    ],
    ids=["unknown-tool", "missing-arg", "extra-arg", "not-a-toolcall", "bad-call-id"],
)
async def test_invalid_decision_fails_the_run_and_records_nothing(
    db: Db, start_worker: StartWorker, decision: Any, message: str
) -> None:
    rec = Recorder()
    flow = Flow("strict", "1")

    @flow.tool(safety="idempotent")
    def transfer(ctx: Any, amount: int, to: str) -> dict[str, Any]:
        rec.tool(ctx)
        return {}

    @flow.policy
    def decide(ctx: Any, history: list[Any]) -> list[Any]:
        rec.policy(ctx, history)
        return [decision]

    await db.submit("strict-1", flow)
    await start_worker(flow)
    run = await db.wait_status("strict-1", "succeeded", "failed", "paused")

    assert run["status"] == "failed"
    assert run["error"]["reason"] == "invalid_decision"
    assert run["error"]["type"] == "InvalidDecision"
    assert message in run["error"]["message"]
    assert rec.policy_turns == [0]  # a bad decision is not retried
    assert rec.tool_calls == []
    assert await db.turns("strict-1") == []
    assert await db.calls("strict-1") == []
    assert await db.kinds("strict-1") == ["submitted", "claimed", "run_failed"]
    assert (await db.events("strict-1", "run_failed"))[0]["detail"] == {
        "reason": "invalid_decision"
    }


async def test_invalid_decision_raised_by_the_policy_is_not_retried(
    db: Db, start_worker: StartWorker
) -> None:
    rec = Recorder()
    flow = Flow("strict", "1")

    @flow.policy
    def decide(ctx: Any, history: list[Any]) -> list[ToolCall]:
        rec.policy(ctx, history)
        raise InvalidDecision("the model produced garbage")

    await db.submit("strict-2", flow)
    await start_worker(flow)
    run = await db.wait_status("strict-2", "succeeded", "failed", "paused")
    assert run["status"] == "failed"
    assert run["error"] == {
        "reason": "invalid_decision",
        "type": "InvalidDecision",
        "message": "the model produced garbage",
    }
    assert rec.policy_turns == [0]


async def test_decision_with_arguments_that_are_not_json_is_invalid(
    db: Db, start_worker: StartWorker
) -> None:
    rec = Recorder()
    flow = Flow("strict", "1")

    @flow.tool(safety="idempotent")
    def remind(ctx: Any, when: Any) -> None:
        rec.tool(ctx)

    @flow.policy
    def decide(ctx: Any, history: list[Any]) -> list[ToolCall]:
        rec.policy(ctx, history)
        return [ToolCall("remind", {"when": dt.datetime(2030, 1, 1)})]

    await db.submit("strict-3", flow)
    w = await start_worker(flow)
    # The policy runs inside the run's task, so once it was called, the run leaving
    # worker.active means the worker is done with it (finished or dropped).
    await eventually(
        lambda: rec.policy_turns and "strict-3" not in w.worker.active,
        what="worker done with the run",
    )
    run = await db.run("strict-3")
    assert run["status"] == "failed"
    assert run["error"]["reason"] == "invalid_decision"
    assert rec.policy_turns == [0]


# -- a recorded decision is replayed, never decided again --------------------------------


def _booking_flow(rec: Recorder, name: str = "booking") -> Flow:
    flow = Flow(name, "1")

    @flow.tool(safety="idempotent")
    def book(ctx: Any, room: int) -> dict[str, Any]:
        rec.tool(ctx)
        return {"booked": room}

    @flow.policy
    def decide(ctx: Any, history: list[Any]) -> list[ToolCall]:
        rec.policy(ctx, history)
        if not history:
            return [ToolCall("book", {"room": 999})]  # differs from what was recorded
        return []

    return flow


async def test_policy_is_not_called_again_for_a_turn_a_previous_worker_recorded(
    db: Db, store: Any, db_clock: Any, start_worker: StartWorker
) -> None:
    rec = Recorder()
    flow = _booking_flow(rec)
    await db.submit("replay-1", flow)
    [(ghost, _)] = await store.worker.claim_runs(
        "ghost-worker", [flow.ref], dt.timedelta(seconds=30), 1
    )
    await store.worker.record_turn(
        "replay-1",
        ghost.lease_id,
        ghost.fencing_token,
        0,
        [{"call_id": "c0", "tool": "book", "args": {"room": 101}}],
    )
    db_clock.advance(60)  # the ghost's lease is now expired by the database clock

    w = await start_worker(flow)
    run = await db.wait_status("replay-1", "succeeded", "failed", "paused")

    assert run["status"] == "succeeded"
    assert rec.policy_turns == [1]  # never for turn 0
    assert rec.tool_calls == [("book", "replay-1:0:c0", 1, 2)]
    [call] = await db.calls("replay-1")
    assert (call["args"], call["status"], call["result"], call["attempts"]) == (
        {"room": 101},
        "succeeded",
        {"booked": 101},
        1,
    )
    assert (call["dispatched_token"], call["completed_token"]) == (2, 2)
    [takeover] = await db.events("replay-1", "takeover")
    assert takeover["actor"] == w.worker_id
    assert takeover["detail"]["previous_owner"] == "ghost-worker"
    assert takeover["detail"]["previous_token"] == 1
    assert [t["turn"] for t in await db.turns("replay-1")] == [0, 1]
    assert [t["fencing_token"] for t in await db.turns("replay-1")] == [1, 2]


@pytest.mark.parametrize(
    ("safety", "found", "expect"),
    [
        ("idempotent", None, "rerun"),
        ("read_only", None, "rerun"),
        ("lookup", {"charge_id": "ch-7"}, "found"),
        ("lookup", None, "rerun"),
        ("unsafe", None, "unknown"),
    ],
    ids=["idempotent", "read_only", "lookup-found", "lookup-missing", "unsafe"],
)
async def test_call_in_flight_when_its_worker_died_is_recovered_by_safety_class(
    db: Db,
    store: Any,
    db_clock: Any,
    start_worker: StartWorker,
    safety: str,
    found: dict[str, Any] | None,
    expect: str,
) -> None:
    rec = Recorder()
    flow = Flow("recover", "1")

    @flow.tool(safety=safety)
    def act(ctx: Any) -> dict[str, Any]:
        rec.tool(ctx)
        return {"done_by_attempt": ctx.attempt}

    if safety == "lookup":

        @act.lookup
        def find(ctx: Any) -> dict[str, Any] | None:
            rec.lookups.append(ctx.idempotency_key)
            return found

    @flow.policy
    def decide(ctx: Any, history: list[Any]) -> list[ToolCall]:
        rec.policy(ctx, history)
        return [] if history else [ToolCall("act", {})]

    await db.submit("rec-1", flow)
    [(ghost, _)] = await store.worker.claim_runs(
        "ghost-worker", [flow.ref], dt.timedelta(seconds=30), 1
    )
    await store.worker.record_turn(
        "rec-1",
        ghost.lease_id,
        ghost.fencing_token,
        0,
        [{"call_id": "c0", "tool": "act", "args": {}}],
    )
    assert (
        await store.worker.dispatch_call("rec-1", ghost.lease_id, ghost.fencing_token, "rec-1:0:c0")
        == 1
    )
    db_clock.advance(60)

    await start_worker(flow)
    run = await db.wait_status("rec-1", "succeeded", "failed", "paused")
    [call] = await db.calls("rec-1")
    assert rec.lookups == (["rec-1:0:c0"] if safety == "lookup" else [])

    if expect == "rerun":
        assert run["status"] == "succeeded"
        assert rec.tool_calls == [("act", "rec-1:0:c0", 2, 2)]  # same key, next attempt
        assert (call["status"], call["attempts"], call["result"]) == (
            "succeeded",
            2,
            {"done_by_attempt": 2},
        )
        assert rec.policy_turns == [1]
    elif expect == "found":
        assert run["status"] == "succeeded"
        assert rec.tool_calls == []  # not sent again
        assert (call["status"], call["attempts"]) == ("succeeded", 1)
        assert call["receipt"] == {"charge_id": "ch-7"}
        assert call["completed_token"] == 2
        assert len(await db.events("rec-1", "call_dispatched")) == 1
        assert rec.policy_turns == [1]
    else:
        assert run["status"] == "paused"
        assert run["pause_reason"] == (
            "call rec-1:0:c0 is unknown: reconcile it with "
            "`runledger resolve rec-1:0:c0 applied|not_applied|abandoned`"
        )
        assert rec.tool_calls == []
        assert (call["status"], call["attempts"]) == ("unknown", 1)
        error = dict(call["error"])
        [waited] = error.pop("evidence")  # the earlier sender, waited for
        assert error == {
            # the ghost said nothing before its lease ran out: it may still be running
            "reason": "in flight when its worker lost the run: its lease ended without word "
            "from it; unsafe to repeat",
            "attempts": 1,
        }
        assert (waited["step"], waited["ended"], waited["attempt"]) == (
            "earlier sender",
            "lease_expired",
            1,
        )
        assert rec.policy_turns == []
        assert run["lease_id"] is None


# -- budgets and crash loops ---------------------------------------------------------------


def _looping_flow(
    rec: Recorder, *, calls_per_turn: int = 1, stop_after: int | None = None, **budget: Any
) -> Flow:
    flow = Flow("loop", "1", **budget)

    @flow.tool(safety="read_only")
    def tick(ctx: Any) -> int:
        rec.tool(ctx)
        return int(ctx.turn)

    @flow.policy
    def decide(ctx: Any, history: list[Any]) -> list[ToolCall]:
        rec.policy(ctx, history)
        if stop_after is not None and ctx.turn >= stop_after:
            return []
        return [ToolCall("tick", {}) for _ in range(calls_per_turn)]

    return flow


async def test_the_final_empty_decision_is_within_max_turns(
    db: Db, start_worker: StartWorker
) -> None:
    rec = Recorder()
    flow = _looping_flow(rec, stop_after=1, max_turns=1)  # one turn of calls, then done
    await db.submit("loop-5", flow)
    await start_worker(flow)
    run = await db.wait_status("loop-5", "succeeded", "failed", "paused")
    assert run["status"] == "succeeded", run["error"]
    assert rec.policy_turns == [0, 1]
    assert run["state"] == {"completed_turns": 1}


@pytest.mark.parametrize("where", ["flow", "worker"])
async def test_max_turns_exceeded_fails_the_run(
    db: Db, start_worker: StartWorker, where: str
) -> None:
    rec = Recorder()
    if where == "flow":
        flow = _looping_flow(rec, max_turns=3)
        limits = FAST
    else:
        flow = _looping_flow(rec)
        limits = Limits(max_turns=3, backoff=0.01, max_backoff=0.05)
    await db.submit("loop-1", flow)
    await start_worker(flow, limits=limits)
    run = await db.wait_status("loop-1", "succeeded", "failed", "paused")

    assert run["status"] == "failed"
    assert run["error"] == {"reason": "budget_exceeded", "max_turns": 3}
    assert run["result"] is None
    assert rec.policy_turns == [0, 1, 2, 3]  # turn 3 asked for calls: over the budget
    assert [t["turn"] for t in await db.turns("loop-1")] == [0, 1, 2]
    assert [c["status"] for c in await db.calls("loop-1")] == ["succeeded"] * 3
    assert (await db.events("loop-1"))[-1]["kind"] == "run_failed"


@pytest.mark.parametrize("where", ["flow", "worker"])
async def test_max_calls_exceeded_fails_the_run_before_recording_the_turn(
    db: Db, start_worker: StartWorker, where: str
) -> None:
    rec = Recorder()
    if where == "flow":
        flow = _looping_flow(rec, calls_per_turn=2, max_calls=3)
        limits = FAST
    else:
        flow = _looping_flow(rec, calls_per_turn=2)
        limits = Limits(max_calls=3, backoff=0.01, max_backoff=0.05)
    await db.submit("loop-2", flow)
    await start_worker(flow, limits=limits)
    run = await db.wait_status("loop-2", "succeeded", "failed", "paused")

    assert run["status"] == "failed"
    assert run["error"] == {"reason": "budget_exceeded", "max_calls": 3}
    assert rec.policy_turns == [0, 1]
    assert [t["turn"] for t in await db.turns("loop-2")] == [0]  # turn 1 (2 more) not recorded
    assert len(await db.calls("loop-2")) == 2
    assert len(rec.tool_calls) == 2


async def test_crash_loop_fails_the_run_without_calling_the_policy(
    db: Db, start_worker: StartWorker
) -> None:
    rec = Recorder()
    flow = _looping_flow(rec)
    await db.submit("loop-3", flow)
    # As if the run had been claimed 10 times without progress (allowed by the triggers).
    await db.rows("UPDATE runledger.runs SET stalled_claims = 10 WHERE run_id = 'loop-3'")

    w = await start_worker(flow)
    run = await db.wait_status("loop-3", "succeeded", "failed", "paused")

    assert run["status"] == "failed"
    assert run["error"] == {"reason": "crash_loop", "claims_without_progress": 11}
    assert run["stalled_claims"] == 11 and run["claims"] == 1
    assert rec.policy_turns == [] and rec.tool_calls == []
    assert await db.kinds("loop-3") == ["submitted", "claimed", "run_failed"]
    [failed] = await db.events("loop-3", "run_failed")
    assert failed["actor"] == w.worker_id
    assert failed["detail"] == {"reason": "crash_loop"}


async def test_runs_under_the_stall_limit_are_not_a_crash_loop(
    db: Db, start_worker: StartWorker
) -> None:
    rec = Recorder()
    flow = _looping_flow(rec, max_turns=1)
    await db.submit("loop-4", flow)
    await db.rows("UPDATE runledger.runs SET stalled_claims = 4 WHERE run_id = 'loop-4'")
    await start_worker(flow)  # claims it a 5th time: max_stalled_claims is 5, not exceeded
    run = await db.wait_status("loop-4", "succeeded", "failed", "paused")
    assert run["error"] == {"reason": "budget_exceeded", "max_turns": 1}
    assert rec.policy_turns == [0, 1]
    assert run["stalled_claims"] == 0  # progress (a recorded turn) resets the count


# -- policy failures ----------------------------------------------------------------------


async def test_policy_exception_is_retried_then_the_run_fails(
    db: Db, start_worker: StartWorker
) -> None:
    rec = Recorder()
    flow = Flow("flaky-model", "1")

    @flow.policy
    def decide(ctx: Any, history: list[Any]) -> list[ToolCall]:
        rec.policy(ctx, history)
        raise RuntimeError("model unavailable")

    await db.submit("pol-1", flow)
    await start_worker(flow, limits=Limits(policy_attempts=3, backoff=0.01, max_backoff=0.05))
    run = await db.wait_status("pol-1", "succeeded", "failed", "paused")

    assert run["status"] == "failed"
    assert run["error"] == {
        "reason": "policy_error",
        "type": "RuntimeError",
        "message": "model unavailable",
    }
    assert rec.policy_turns == [0, 0, 0]
    assert await db.turns("pol-1") == []
    assert await db.kinds("pol-1") == ["submitted", "claimed", "run_failed"]


async def test_transient_policy_failure_and_timeout_are_retried(
    db: Db, start_worker: StartWorker
) -> None:
    rec = Recorder()
    flow = Flow("flaky-model", "1")

    @flow.tool(safety="read_only")
    def noop(ctx: Any) -> None:
        rec.tool(ctx)

    @flow.policy
    async def decide(ctx: Any, history: list[Any]) -> list[ToolCall]:
        rec.policy(ctx, history)
        attempt = rec.policy_turns.count(ctx.turn)
        if ctx.turn == 0 and attempt == 1:
            raise ConnectionError("model hiccup")
        if ctx.turn == 1 and attempt == 1:
            await asyncio.sleep(5)  # cut by policy_timeout
        return [] if history else [ToolCall("noop", {})]

    await db.submit("pol-2", flow)
    await start_worker(flow, limits=Limits(policy_timeout=0.2, backoff=0.01, max_backoff=0.05))
    run = await db.wait_status("pol-2", "succeeded", "failed", "paused")

    assert run["status"] == "succeeded"
    assert rec.policy_turns == [0, 0, 1, 1]
    assert [t["turn"] for t in await db.turns("pol-2")] == [0, 1]
    assert len(rec.tool_calls) == 1


# -- flow version pinning -----------------------------------------------------------------


def _versioned(version: str, rec: Recorder) -> Flow:
    flow = Flow("pinned", version)

    @flow.tool(safety="read_only")
    def which(ctx: Any) -> str:
        rec.tool(ctx)
        return str(ctx.flow)

    @flow.policy
    def decide(ctx: Any, history: list[Any]) -> list[ToolCall]:
        rec.policy(ctx, history)
        return [] if history else [ToolCall("which", {})]

    return flow


async def test_worker_claims_only_the_flow_versions_it_registered(
    db: Db, start_worker: StartWorker
) -> None:
    rec1, rec2 = Recorder(), Recorder()
    v1, v2 = _versioned("1", rec1), _versioned("2", rec2)
    await db.submit("pin-v2", v2)  # older: it would be claimed first if it were eligible
    await db.submit("pin-v1", v1)

    w1 = await start_worker(v1, worker_id="worker-v1")
    r1 = await db.wait_status("pin-v1", "succeeded", "failed", "paused")
    assert r1["status"] == "succeeded"
    assert [c["result"] for c in await db.calls("pin-v1")] == ["pinned@1"]

    r2 = await db.run("pin-v2")
    assert (r2["status"], r2["claims"], r2["fencing_token"], r2["lease_owner"]) == (
        "queued",
        0,
        0,
        None,
    )
    assert await db.kinds("pin-v2") == ["submitted"]
    assert rec2.policy_turns == []
    await w1.stop()

    await start_worker(v2, worker_id="worker-v2")
    r2 = await db.wait_status("pin-v2", "succeeded", "failed", "paused")
    assert r2["status"] == "succeeded"
    assert [c["result"] for c in await db.calls("pin-v2")] == ["pinned@2"]
    [claimed] = await db.events("pin-v2", "claimed")
    assert claimed["actor"] == "worker-v2"
    assert rec1.policy_turns == [0, 1] and rec2.policy_turns == [0, 1]


# -- graceful stop ------------------------------------------------------------------------


async def test_stop_lets_the_call_finish_then_releases_the_lease(
    db: Db, start_worker: StartWorker
) -> None:
    rec = Recorder()
    running, release = threading.Event(), threading.Event()
    flow = Flow("drain", "1")

    @flow.tool(safety="unsafe")
    def slow(ctx: Any) -> str:
        rec.tool(ctx)
        running.set()
        assert release.wait(10)
        return "done"

    @flow.policy
    def decide(ctx: Any, history: list[Any]) -> list[ToolCall]:
        rec.policy(ctx, history)
        return [] if history else [ToolCall("slow", {})]

    await db.submit("drain-1", flow)
    w1 = await start_worker(flow, worker_id="drainer", grace_seconds=10.0)
    try:
        await eventually(running.is_set, what="tool running")
        w1.request_stop()
        # the stop reaches the run on the worker's loop: only then may the tool return
        await eventually(lambda: w1.worker.active["drain-1"].draining, what="run draining")
    finally:
        release.set()
    await w1.stop()

    run = await db.run("drain-1")
    assert (run["status"], run["lease_id"], run["state_version"]) == ("queued", None, 1)
    [call] = await db.calls("drain-1")
    assert (call["status"], call["result"], call["attempts"]) == ("succeeded", "done", 1)
    kinds = await db.kinds("drain-1")
    assert kinds[-3:] == ["call_succeeded", "checkpoint", "lease_released"]
    assert rec.policy_turns == [0]

    await start_worker(flow, worker_id="successor")
    run = await db.wait_status("drain-1", "succeeded", "failed", "paused")
    assert run["status"] == "succeeded"
    assert len(rec.tool_calls) == 1  # the unsafe call was not repeated
    assert rec.policy_turns == [0, 1]


async def test_every_run_slot_gets_a_thread_for_its_plain_def_tool(
    db: Db, start_worker: StartWorker
) -> None:
    slots = 12  # more than the default thread pool has on a 2-core machine (cpu + 4)
    together = threading.Barrier(slots, timeout=20)
    flow = Flow("slots", "1")

    @flow.tool(safety="read_only")
    def meet(ctx: Any) -> int:
        return together.wait()  # returns only when all `slots` calls run at once

    @flow.policy
    def decide(ctx: Any, history: list[Any]) -> list[ToolCall]:
        return [] if history else [ToolCall("meet", {})]

    for n in range(slots):
        await db.submit(f"slot-{n}", flow)
    await start_worker(flow, concurrency=slots)
    for n in range(slots):
        run = await db.wait_status(f"slot-{n}", "succeeded", "failed", "paused", timeout=40)
        assert run["status"] == "succeeded", run
        [call] = await db.calls(f"slot-{n}")
        assert (call["status"], call["attempts"]) == ("succeeded", 1), call
