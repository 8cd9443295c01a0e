"""A Pydantic AI tool declared ``requires_approval=True`` is a runledger approval tool:
the run pauses before the tool ever runs; approved, it runs once and the model gets its
return; denied, it never runs and the model gets the person's reason."""

from __future__ import annotations

import asyncio
from typing import Any

from pydantic_ai import Agent
from pydantic_ai.messages import (
    ModelMessage,
    ModelRequest,
    ModelResponse,
    TextPart,
    ToolCallPart,
    ToolReturnPart,
)
from pydantic_ai.models.function import AgentInfo, FunctionModel

from runledger.client import Client
from runledger.integrations.pydantic_ai import agent_flow
from tests.integration.conftest import Db, StartWorker


def script(messages: list[ModelMessage], info: AgentInfo) -> ModelResponse:
    """Ask for a refund; then say what the tool returned."""
    if len(messages) == 1:
        return ModelResponse(parts=[ToolCallPart("refund", {"cents": 1250})])
    last = messages[-1]
    assert isinstance(last, ModelRequest)
    [part] = [p for p in last.parts if isinstance(p, ToolReturnPart)]
    return ModelResponse(parts=[TextPart(f"refund: {part.content}")])


def build(refunds: list[str]) -> Any:
    agent = Agent(FunctionModel(script))

    @agent.tool_plain(requires_approval=True)
    def refund(cents: int) -> str:
        from runledger import tool_context

        refunds.append(tool_context().idempotency_key)
        return f"refunded {cents}"

    flow = agent_flow(agent, name="pai-approval", safety={"refund": "idempotent"})
    assert flow.tools["refund"].approval is True
    return flow


async def test_approved_runs_once_and_denied_never_runs(
    db: Db, database_url: str, start_worker: StartWorker
) -> None:
    refunds: list[str] = []
    flow = build(refunds)
    await start_worker(flow)
    for run_id in ("pai-ok", "pai-no"):
        await db.submit(run_id, flow, {"prompt": "refund my order"})
    for run_id in ("pai-ok", "pai-no"):
        run = await db.wait_status(run_id, "paused", "succeeded", "failed")
        assert run["status"] == "paused", run
        assert "awaits approval" in run["pause_reason"], run["pause_reason"]
    assert refunds == []  # nothing ran before a person said yes

    def decide() -> None:
        with Client(database_url, actor="ops:ana") as client:
            client.approve("pai-ok:0:c0")
            client.deny("pai-no:0:c0", "over the refund limit")

    await asyncio.to_thread(decide)
    ok = await db.wait_status("pai-ok", "succeeded", "failed", "paused")
    no = await db.wait_status("pai-no", "succeeded", "failed", "paused")
    assert refunds == ["pai-ok:0:c0"]
    assert ok["result"] == "refund: refunded 1250", ok
    assert no["result"] == (
        "refund: A person denied this tool call: over the refund limit. It was not run."
    ), no
