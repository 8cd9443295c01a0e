"""Decisions verbatim: a policy returns ``Decision(calls, record, output)``; the record is
journaled with its turn before any tool runs, the history carries it back with each
call's result and provider id, and the final decision's output is the run's result.
Also: keys never come from provider ids, and ``runledger.tool_context()`` in tools."""

from __future__ import annotations

import asyncio
import threading
from typing import Any

import psycopg
import pytest

import runledger
from runledger.flows import Decision, Flow, HistoryTurn, ToolCall, ToolContext
from tests.integration.conftest import Db, Recorder, StartWorker


def message(turn: int, *tool_ids: str) -> dict[str, Any]:
    """An Anthropic-style assistant message for one turn."""
    return {
        "role": "assistant",
        "content": [
            {"type": "thinking", "thinking": f"turno {turn}: pienso… ✓", "signature": f"sig{turn}"},
            *({"type": "tool_use", "id": i, "name": "create_ticket"} for i in tool_ids),
        ],
        "usage": {"output_tokens": 10 + turn},
    }


async def test_each_turn_is_journaled_with_its_record_and_the_output_is_the_result(
    db: Db, database_url: str, start_worker: StartWorker
) -> None:
    rec = Recorder()
    journaled_before_tool: dict[str, Any] = {}
    flow = Flow("decisions", "1")

    @flow.tool(safety="idempotent")
    def create_ticket(ctx: Any, title: str) -> dict[str, Any]:
        rec.tool(ctx)
        with psycopg.connect(database_url) as c:  # the decision is committed already
            journaled_before_tool[ctx.idempotency_key] = c.execute(
                "SELECT record FROM runledger.run_turns WHERE run_id = %s AND turn = %s",
                (ctx.run_id, ctx.turn),
            ).fetchone()
        return {"ticket": f"T-{title}"}

    @flow.policy
    def decide(ctx: Any, history: list[HistoryTurn]) -> Decision:
        rec.policy(ctx, history)
        if ctx.turn == 0:
            return Decision(
                calls=[
                    ToolCall("create_ticket", {"title": "a"}, provider_id="toolu_A"),
                    ToolCall("create_ticket", {"title": "b"}, provider_id="toolu_B"),
                ],
                record=message(0, "toolu_A", "toolu_B"),
            )
        if ctx.turn == 1:
            return Decision(
                calls=[ToolCall("create_ticket", {"title": "c"}, provider_id="toolu_C")],
                record=message(1, "toolu_C"),
            )
        tickets = [c.result["ticket"] for t in history for c in t.calls]
        return Decision(record=message(2), output={"answer": "listo", "tickets": tickets})

    await db.submit("dec-1", flow)
    await start_worker(flow)
    run = await db.wait_status("dec-1", "succeeded", "failed", "paused")

    assert run["status"] == "succeeded", run
    assert run["result"] == {"answer": "listo", "tickets": ["T-a", "T-b", "T-c"]}
    turns = await db.turns("dec-1")
    assert [(t["turn"], t["record"]) for t in turns] == [
        (0, message(0, "toolu_A", "toolu_B")),
        (1, message(1, "toolu_C")),
        (2, message(2)),
    ]
    assert turns[2]["calls"] == [] and turns[2]["output"] == run["result"]
    assert [t["output"] for t in turns[:2]] == [None, None]
    assert [len(await db.events("dec-1", "turn_recorded"))] == [3]
    # the decision, record included, was committed before its first tool ran
    assert journaled_before_tool == {
        "dec-1:0:c0": (message(0, "toolu_A", "toolu_B"),),
        "dec-1:0:c1": (message(0, "toolu_A", "toolu_B"),),
        "dec-1:1:c0": (message(1, "toolu_C"),),
    }
    calls = await db.calls("dec-1")
    assert [(c["idempotency_key"], c["provider_id"]) for c in calls] == [
        ("dec-1:0:c0", "toolu_A"),
        ("dec-1:0:c1", "toolu_B"),
        ("dec-1:1:c0", "toolu_C"),
    ]

    # one policy call per turn; the history rebuilds the conversation exactly
    assert rec.policy_turns == [0, 1, 2]
    assert rec.histories[0] == []
    h2 = rec.histories[2]
    assert [(t.turn, t.record) for t in h2] == [
        (0, message(0, "toolu_A", "toolu_B")),
        (1, message(1, "toolu_C")),
    ]
    assert [[(c.call_id, c.provider_id, c.status, c.result) for c in t.calls] for t in h2] == [
        [
            ("c0", "toolu_A", "succeeded", {"ticket": "T-a"}),
            ("c1", "toolu_B", "succeeded", {"ticket": "T-b"}),
        ],
        [("c0", "toolu_C", "succeeded", {"ticket": "T-c"})],
    ]
    assert rec.histories[1][0].record == message(0, "toolu_A", "toolu_B")


async def test_a_policy_returning_a_bare_list_still_works(
    db: Db, start_worker: StartWorker
) -> None:
    rec = Recorder()
    flow = Flow("bare", "1")

    @flow.tool(safety="read_only")
    async def look(ctx: Any, q: str) -> dict[str, Any]:
        return {"q": q}

    @flow.policy
    def decide(ctx: Any, history: list[HistoryTurn]) -> list[ToolCall]:
        rec.policy(ctx, history)
        return [ToolCall("look", {"q": "x"})] if ctx.turn == 0 else []

    await db.submit("bare-1", flow)
    await start_worker(flow)
    run = await db.wait_status("bare-1", "succeeded", "failed", "paused")

    assert run["status"] == "succeeded"
    assert run["result"] == {"turns": 2, "calls": 1}  # the summary, as before
    turns = await db.turns("bare-1")
    assert [(t["calls"], t["record"], t["output"]) for t in turns] == [
        ([{"call_id": "c0", "tool": "look", "args": {"q": "x"}}], None, None),
        ([], None, None),
    ]
    [h] = rec.histories[1]
    assert h.record is None and [(c.provider_id, c.result) for c in h.calls] == [(None, {"q": "x"})]


async def test_a_final_decision_without_output_keeps_the_summary(
    db: Db, start_worker: StartWorker
) -> None:
    flow = Flow("nooutput", "1")

    @flow.policy
    def decide(ctx: Any, history: list[HistoryTurn]) -> Decision:
        return Decision(record={"role": "assistant", "content": "nothing to do"})

    await db.submit("noout-1", flow)
    await start_worker(flow)
    run = await db.wait_status("noout-1", "succeeded", "failed", "paused")
    assert run["result"] == {"turns": 1, "calls": 0}
    [t] = await db.turns("noout-1")
    assert (t["record"], t["output"]) == ({"role": "assistant", "content": "nothing to do"}, None)


async def test_an_output_with_calls_is_an_invalid_decision(
    db: Db, start_worker: StartWorker
) -> None:
    flow = Flow("outwithcalls", "1")

    @flow.tool(safety="read_only")
    def look(ctx: Any) -> None:
        raise AssertionError("never runs")

    @flow.policy
    def decide(ctx: Any, history: list[HistoryTurn]) -> Decision:
        return Decision(calls=[ToolCall("look")], output="too early")

    await db.submit("owc-1", flow)
    await start_worker(flow)
    run = await db.wait_status("owc-1", "succeeded", "failed", "paused")
    assert (run["status"], run["error"]["reason"]) == ("failed", "invalid_decision")
    assert await db.turns("owc-1") == []


async def test_keys_never_come_from_provider_ids(db: Db, start_worker: StartWorker) -> None:
    """Two runs whose model emits the same provider id (as Pydantic AI's TestModel does)
    get distinct keys; a provider id that is not a valid call id still gets ``c<n>``."""
    rec = Recorder()
    flow = Flow("sameid", "1")

    @flow.tool(safety="idempotent")
    def create_ticket(ctx: Any, title: str) -> dict[str, Any]:
        rec.tool(ctx)
        return {"ok": title}

    @flow.policy
    def decide(ctx: Any, history: list[HistoryTurn]) -> Decision:
        if ctx.turn == 0:
            return Decision(
                calls=[
                    ToolCall("create_ticket", {"title": "x"}, provider_id="pyd_ai_tool_call_id"),
                    ToolCall("create_ticket", {"title": "y"}, provider_id="call:1/ñ ok?"),
                ],
                record={"id": "same"},
            )
        return Decision(output=ctx.run_id)

    for run_id in ("same-1", "same-2"):
        await db.submit(run_id, flow)
    await start_worker(flow)
    for run_id in ("same-1", "same-2"):
        run = await db.wait_status(run_id, "succeeded", "failed", "paused")
        assert (run["status"], run["result"]) == ("succeeded", run_id)

    rows = [*await db.calls("same-1"), *await db.calls("same-2")]
    found = sorted((c["idempotency_key"], c["call_id"], c["provider_id"]) for c in rows)
    assert found == [
        ("same-1:0:c0", "c0", "pyd_ai_tool_call_id"),
        ("same-1:0:c1", "c1", "call:1/ñ ok?"),
        ("same-2:0:c0", "c0", "pyd_ai_tool_call_id"),
        ("same-2:0:c1", "c1", "call:1/ñ ok?"),
    ]
    assert sorted(k for _, k, _, _ in rec.tool_calls) == [k for k, _, _ in found]


@pytest.mark.parametrize("kind", ["def", "async def"])
async def test_tool_context_returns_the_calls_context(
    db: Db, start_worker: StartWorker, kind: str
) -> None:
    seen: list[tuple[ToolContext, ToolContext, bool]] = []  # (passed ctx, tool_context(), thread)
    flow = Flow("toolctx", "1")
    main_thread = threading.get_ident()

    if kind == "def":

        @flow.tool(safety="idempotent", name="work")
        def work_sync(ctx: ToolContext, n: int) -> int:
            seen.append((ctx, runledger.tool_context(), threading.get_ident() != main_thread))
            return n

    else:

        @flow.tool(safety="idempotent", name="work")
        async def work_async(ctx: ToolContext, n: int) -> int:
            await asyncio.sleep(0)  # other tasks run meanwhile; the context stays this call's
            seen.append((ctx, runledger.tool_context(), threading.get_ident() != main_thread))
            return n

    @flow.policy
    def decide(ctx: Any, history: list[HistoryTurn]) -> list[ToolCall]:
        if ctx.turn < 2:
            return [ToolCall("work", {"n": 1}), ToolCall("work", {"n": 2})]
        return []

    await db.submit("ctx-1", flow)
    await start_worker(flow)
    run = await db.wait_status("ctx-1", "succeeded", "failed", "paused")
    assert run["status"] == "succeeded", run

    assert [got.idempotency_key for _, got, _ in seen] == [
        "ctx-1:0:c0",
        "ctx-1:0:c1",
        "ctx-1:1:c0",
        "ctx-1:1:c1",
    ]
    for passed, got, in_thread in seen:
        assert got is passed
        assert (got.fencing_token, got.attempt, got.run_id, got.tool) == (1, 1, "ctx-1", "work")
        assert in_thread is (kind == "def")
    with pytest.raises(LookupError, match="outside a runledger tool call"):
        runledger.tool_context()


async def test_tool_context_in_a_lookup(db: Db, start_worker: StartWorker) -> None:
    """A lookup tool whose send is ambiguous is looked up; the lookup (a plain def, as a
    framework's function would be) reads its key from ``runledger.tool_context()``."""
    sent: list[str] = []
    looked_up: list[tuple[str, int, int]] = []
    flow = Flow("lookupctx", "1")

    @flow.tool(safety="lookup")
    def charge(ctx: ToolContext, amount: int) -> dict[str, Any]:
        sent.append(runledger.tool_context().idempotency_key)
        raise ConnectionError("the provider hung up after taking the charge")

    @charge.lookup
    def find_charge(ctx: ToolContext) -> dict[str, Any] | None:
        now = runledger.tool_context()
        assert now is ctx
        looked_up.append((now.idempotency_key, now.fencing_token, now.attempt))
        return {"charge_id": f"ch-{now.idempotency_key}"}

    @flow.policy
    def decide(ctx: Any, history: list[HistoryTurn]) -> list[ToolCall]:
        return [ToolCall("charge", {"amount": 5})] if ctx.turn == 0 else []

    await db.submit("lk-1", flow)
    await start_worker(flow)
    run = await db.wait_status("lk-1", "succeeded", "failed", "paused")
    assert run["status"] == "succeeded", run
    assert sent == ["lk-1:0:c0"]
    assert looked_up == [("lk-1:0:c0", 1, 1)]
    [call] = await db.calls("lk-1")
    assert (call["status"], call["receipt"]) == ("succeeded", {"charge_id": "ch-lk-1:0:c0"})
