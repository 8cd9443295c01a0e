"""Parallel tool calls: the calls of one turn run at the same time when the flow (or
the tool) allows it, each dispatched before it is sent and completed as it returns.

The tools are async and meet at an ``asyncio.Barrier``: a turn whose calls ran one
after another would never get past it (the tool's timeout fails the call instead).
"""

from __future__ import annotations

import asyncio
import itertools
from typing import Any

from runledger.flows import Flow, ToolCall
from runledger.worker.executor import call_groups
from tests.integration.conftest import Db, StartWorker


def _flow(name: str, tools: list[str], *, parallel: bool, meet: int) -> tuple[Flow, list[str]]:
    """A flow with turn 0 = one call of each of ``tools``; each call of an ``a``-tool
    waits at a barrier of ``meet`` parties; ``s``-tools opt out of parallelism."""
    flow = Flow(name, "1", parallel_calls=parallel)
    barrier = asyncio.Barrier(meet)
    order: list[str] = []

    @flow.tool(safety="idempotent", timeout=5)
    async def a(ctx: Any) -> dict[str, Any]:
        order.append(f"start {ctx.call_id}")
        await barrier.wait()
        order.append(f"end {ctx.call_id}")
        return {"call": ctx.call_id}

    @flow.tool(safety="idempotent", parallel=False)
    async def s(ctx: Any) -> dict[str, Any]:
        order.append(f"start {ctx.call_id}")
        await asyncio.sleep(0)
        order.append(f"end {ctx.call_id}")
        return {"call": ctx.call_id}

    @flow.policy
    def decide(ctx: Any, history: list[Any]) -> list[ToolCall]:
        return [] if history else [ToolCall(t) for t in tools]

    return flow, order


async def test_calls_of_a_turn_run_at_the_same_time_and_each_is_journaled(
    db: Db, start_worker: StartWorker
) -> None:
    flow, order = _flow("fan", ["a", "a", "a"], parallel=True, meet=3)
    await start_worker(flow)
    await db.submit("fan-1", flow)
    run = await db.wait_status("fan-1", "succeeded", "failed", "paused")
    assert run["status"] == "succeeded", run
    assert sorted(order[:3]) == ["start c0", "start c1", "start c2"]  # all in flight at once
    calls = await db.calls("fan-1")
    assert [(c["call_id"], c["status"], c["attempts"]) for c in calls] == [
        ("c0", "succeeded", 1),
        ("c1", "succeeded", 1),
        ("c2", "succeeded", 1),
    ]
    # every dispatch committed before any result: the three were in flight together
    assert max(c["dispatched_at"] for c in calls) < min(c["completed_at"] for c in calls)
    events = await db.events("fan-1")
    kinds = [(e["kind"], e["detail"].get("idempotency_key")) for e in events]
    for c in calls:  # each call's dispatch event precedes its completion event
        key = c["idempotency_key"]
        assert kinds.index(("call_dispatched", key)) < kinds.index(("call_succeeded", key))


async def test_without_parallel_calls_one_call_runs_at_a_time(
    db: Db, start_worker: StartWorker
) -> None:
    flow, order = _flow("seq", ["s", "s", "s"], parallel=False, meet=1)
    await start_worker(flow)
    await db.submit("seq-1", flow)
    run = await db.wait_status("seq-1", "succeeded", "failed", "paused")
    assert run["status"] == "succeeded", run
    assert order == [f"{w} c{i}" for i in range(3) for w in ("start", "end")]
    calls = await db.calls("seq-1")
    for before, after in itertools.pairwise(calls):
        assert before["completed_at"] <= after["dispatched_at"]


async def test_a_tool_that_opts_out_runs_alone_between_parallel_groups(
    db: Db, start_worker: StartWorker
) -> None:
    flow, order = _flow("mixed", ["a", "a", "s", "a", "a"], parallel=True, meet=2)
    await start_worker(flow)
    await db.submit("mixed-1", flow)
    run = await db.wait_status("mixed-1", "succeeded", "failed", "paused")
    assert run["status"] == "succeeded", run
    first, middle, last = order[:4], order[4:6], order[6:]
    assert sorted(first) == ["end c0", "end c1", "start c0", "start c1"]
    assert middle == ["start c2", "end c2"]
    assert sorted(last) == ["end c3", "end c4", "start c3", "start c4"]


async def test_an_unknown_call_pauses_the_run_after_its_siblings_finish(
    db: Db, start_worker: StartWorker
) -> None:
    flow = Flow("halfway", "1", parallel_calls=True)
    barrier = asyncio.Barrier(3)

    @flow.tool(safety="idempotent", timeout=5)
    async def ticket(ctx: Any) -> dict[str, Any]:
        await barrier.wait()
        return {"ticket": ctx.call_id}

    @flow.tool(safety="unsafe", timeout=5)
    async def email(ctx: Any) -> dict[str, Any]:
        await barrier.wait()
        raise ConnectionResetError("the connection dropped after sending")

    @flow.policy
    def decide(ctx: Any, history: list[Any]) -> list[ToolCall]:
        return [] if history else [ToolCall("email"), ToolCall("ticket"), ToolCall("email")]

    await start_worker(flow)
    await db.submit("halfway-1", flow)
    run = await db.wait_status("halfway-1", "paused", "succeeded", "failed")
    assert run["status"] == "paused", run
    calls = await db.calls("halfway-1")
    assert [(c["tool"], c["status"]) for c in calls] == [
        ("email", "unknown"),
        ("ticket", "succeeded"),
        ("email", "unknown"),
    ]
    assert run["pause_reason"].startswith(
        "calls halfway-1:0:c0, halfway-1:0:c2 are unknown: reconcile each with "
        "`runledger resolve <key> applied|not_applied|abandoned`"
    ), run["pause_reason"]


def test_call_groups_put_consecutive_parallel_calls_together() -> None:
    flow, _ = _flow("groups", [], parallel=True, meet=1)

    class C:
        def __init__(self, tool: str) -> None:
            self.tool = tool

    calls: list[Any] = [C(t) for t in ["a", "a", "s", "a", "missing", "a", "a"]]
    groups = call_groups(flow, calls)
    assert [[c.tool for c in g] for g in groups] == [
        ["a", "a"],
        ["s"],
        ["a"],
        ["missing"],
        ["a", "a"],
    ]
    serial, _ = _flow("serial", [], parallel=False, meet=1)
    assert [len(g) for g in call_groups(serial, calls)] == [1] * len(calls)
