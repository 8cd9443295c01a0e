"""The calls of one model response run at the same time through ``agent_flow``, as under
``agent.run``; a tool declared ``sequential=True`` runs alone (Pydantic AI's barrier)."""

from __future__ import annotations

import asyncio
from typing import Any

from pydantic_ai import Agent
from pydantic_ai.messages import ModelMessage, ModelResponse, TextPart, ToolCallPart
from pydantic_ai.models.function import AgentInfo, FunctionModel

from runledger.integrations.pydantic_ai import agent_flow
from tests.integration.conftest import Db, StartWorker


def fan_out(messages: list[ModelMessage], info: AgentInfo) -> ModelResponse:
    """First request: five calls at once (ping, ping, note, ping, ping); then an answer."""
    if len(messages) == 1:
        return ModelResponse(
            parts=[
                ToolCallPart("ping", {"n": 0}),
                ToolCallPart("ping", {"n": 1}),
                ToolCallPart("note", {"n": 2}),
                ToolCallPart("ping", {"n": 3}),
                ToolCallPart("ping", {"n": 4}),
            ]
        )
    return ModelResponse(parts=[TextPart("done")])


def build(name: str, *, parallel_calls: bool) -> tuple[Any, list[str]]:
    agent = Agent(FunctionModel(fan_out))
    order: list[str] = []
    met = asyncio.Barrier(2)

    @agent.tool_plain
    async def ping(n: int) -> int:
        order.append(f"start {n}")
        if parallel_calls:
            await asyncio.wait_for(met.wait(), 5)  # passes only with two pings in flight
        order.append(f"end {n}")
        return n

    @agent.tool_plain(sequential=True)
    async def note(n: int) -> int:
        order.append(f"start {n}")
        await asyncio.sleep(0)
        order.append(f"end {n}")
        return n

    flow = agent_flow(
        agent,
        name=name,
        safety={"ping": "idempotent", "note": "idempotent"},
        parallel_calls=parallel_calls,
    )
    return flow, order


async def test_calls_of_one_response_run_together_and_a_sequential_tool_alone(
    db: Db, start_worker: StartWorker
) -> None:
    flow, order = build("pai-parallel", parallel_calls=True)
    await start_worker(flow)
    await db.submit("pai-par-1", flow, {"prompt": "go"})
    run = await db.wait_status("pai-par-1", "succeeded", "failed", "paused")
    assert run["status"] == "succeeded", (run, await db.calls("pai-par-1"))
    # pings 0 and 1 together, then note 2 alone, then pings 3 and 4 together
    assert sorted(order[:4]) == ["end 0", "end 1", "start 0", "start 1"]
    assert order[4:6] == ["start 2", "end 2"]
    assert sorted(order[6:]) == ["end 3", "end 4", "start 3", "start 4"]
    calls = await db.calls("pai-par-1")
    assert [(c["tool"], c["status"], c["attempts"]) for c in calls] == [
        ("ping", "succeeded", 1),
        ("ping", "succeeded", 1),
        ("note", "succeeded", 1),
        ("ping", "succeeded", 1),
        ("ping", "succeeded", 1),
    ]


async def test_parallel_calls_false_runs_them_in_order(db: Db, start_worker: StartWorker) -> None:
    flow, order = build("pai-serial", parallel_calls=False)
    await start_worker(flow)
    await db.submit("pai-ser-1", flow, {"prompt": "go"})
    run = await db.wait_status("pai-ser-1", "succeeded", "failed", "paused")
    assert run["status"] == "succeeded", run
    assert order == [f"{w} {n}" for n in range(5) for w in ("start", "end")]
