"""MCP tools in agent flows, with a real MCP server process (tests/integration/mcp_server.py,
started over stdio by the agent's own MCP client): the safety class each tool gets from its
annotations, an explicit class winning, the conservative default, and a run through an
in-process worker on a real database whose calls reach the server."""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path
from typing import Any

import pytest
from agents import Agent as SdkAgent
from agents import function_tool, set_tracing_disabled
from agents.items import ModelResponse as SdkResponse
from agents.mcp import MCPServerStdio
from agents.models.interface import Model as SdkModel
from agents.usage import Usage
from fastmcp.client.transports import PythonStdioTransport
from openai.types.responses import (
    ResponseFunctionToolCall,
    ResponseOutputMessage,
    ResponseOutputText,
)
from pydantic_ai import Agent
from pydantic_ai.mcp import MCPToolset
from pydantic_ai.messages import ModelMessage, ModelResponse, TextPart, ToolCallPart
from pydantic_ai.models.function import AgentInfo, FunctionModel

from runledger.flows import Flow
from runledger.integrations import openai_agents, pydantic_ai
from runledger.integrations._mcp import McpToolsUnavailable
from tests.integration.conftest import Db, StartWorker

pytestmark = pytest.mark.timeout(90)
set_tracing_disabled(True)

SERVER = Path(__file__).with_name("mcp_server.py")
DEFAULTS = {
    "get_balance": "read_only",  # readOnlyHint
    "set_status": "unsafe",  # idempotentHint, destructiveHint false: only when trusted
    "delete_ticket": "unsafe",  # idempotentHint but destructive
    "send_note": "unsafe",  # no annotations
}


def effects(log: Path) -> list[dict[str, Any]]:
    return [json.loads(line) for line in log.read_text().splitlines()] if log.exists() else []


def classes(flow: Flow) -> dict[str, str]:
    return {name: str(tool.safety) for name, tool in flow.tools.items()}


# -- Pydantic AI: MCPToolset ------------------------------------------------------------


def pai_agent(log: Path, script: Any = None) -> Agent[None, str]:
    toolset: MCPToolset[None] = MCPToolset(PythonStdioTransport(SERVER, args=[str(log)]))

    def answer(messages: list[ModelMessage], info: AgentInfo) -> ModelResponse:
        n = sum(isinstance(m, ModelResponse) for m in messages)
        return script[n]

    agent: Agent[None, str] = Agent(FunctionModel(answer), toolsets=[toolset])

    @agent.tool_plain
    def create_ticket(subject: str) -> str:
        return f"ticket {subject}"

    return agent


def test_pydantic_ai_mcp_tools_get_their_class_from_annotations(tmp_path: Path) -> None:
    agent = pai_agent(tmp_path / "log")
    flow = pydantic_ai.agent_flow(agent, name="mcp", safety={"create_ticket": "idempotent"})
    assert classes(flow) == {"create_ticket": "idempotent", **DEFAULTS}

    trusted = pydantic_ai.agent_flow(
        agent,
        name="mcp",
        safety={"create_ticket": "idempotent", "get_balance": "unsafe", "send_note": "lookup"},
        lookups={"send_note": lambda ctx: None},
        trust_mcp_hints=True,
    )
    assert classes(trusted) == {
        "create_ticket": "idempotent",
        "get_balance": "unsafe",  # the explicit class wins over readOnlyHint
        "set_status": "idempotent",  # trusted: idempotentHint, destructiveHint false
        "delete_ticket": "unsafe",  # never for a destructive tool
        "send_note": "lookup",  # the explicit class wins over no annotations
    }
    assert effects(tmp_path / "log") == []  # listing the tools called none


def test_pydantic_ai_function_tools_still_need_a_class(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="agent tools without a safety class: create_ticket"):
        pydantic_ai.agent_flow(pai_agent(tmp_path / "log"), name="mcp", safety={})
    with pytest.raises(ValueError, match="safety names tools the agent does not have: nope"):
        pydantic_ai.agent_flow(
            pai_agent(tmp_path / "log"),
            name="mcp",
            safety={"create_ticket": "unsafe", "nope": "unsafe"},
        )


def test_a_server_that_does_not_start_is_one_line(tmp_path: Path) -> None:
    broken = tmp_path / "broken_server.py"
    broken.write_text("raise SystemExit('no configuration')\n")  # exits before it answers
    agent: Agent[None, str] = Agent(
        FunctionModel(lambda m, i: ModelResponse(parts=[TextPart("")])),
        toolsets=[MCPToolset(PythonStdioTransport(broken))],
    )
    with pytest.raises(McpToolsUnavailable) as caught:
        pydantic_ai.agent_flow(agent, name="mcp", safety={})
    said = str(caught.value)
    assert said.startswith("MCP server ") and "tools not listed: " in said
    assert "\n" not in said


async def test_pydantic_ai_run_calls_the_mcp_server(
    tmp_path: Path, db: Db, start_worker: StartWorker
) -> None:
    log = tmp_path / "log"
    script = [
        ModelResponse(
            parts=[
                ToolCallPart("get_balance", {"account": "a-1"}, tool_call_id="t1"),
                ToolCallPart("set_status", {"ticket": "T-1", "status": "open"}, tool_call_id="t2"),
            ]
        ),
        ModelResponse(parts=[TextPart("done")]),
    ]
    flow = pydantic_ai.agent_flow(
        pai_agent(log, script), name="mcp", safety={"create_ticket": "idempotent"}
    )
    await db.submit("mcp-1", flow, {"prompt": "open T-1"})
    await start_worker(flow)
    run = await db.wait_status("mcp-1", "succeeded", "failed", "paused", timeout=60)
    assert (run["status"], run["result"]) == ("succeeded", "done")
    calls = await db.calls("mcp-1")
    assert [(c["tool"], c["status"], c["result"]) for c in calls] == [
        ("get_balance", "succeeded", "a-1: 100"),
        ("set_status", "succeeded", "T-1 is open"),
    ]
    done = effects(log)
    assert [(e["tool"], e["args"]) for e in done] == [
        ("set_status", {"ticket": "T-1", "status": "open"})
    ]
    assert done[0]["pid"] != os.getpid()  # a server process of its own


# -- OpenAI Agents SDK: agents.mcp.MCPServerStdio ---------------------------------------


class Script(SdkModel):
    """Calls get_balance and send_note, then says "done"."""

    async def get_response(self, *args: Any, **kwargs: Any) -> SdkResponse:
        given = kwargs.get("input", args[1] if len(args) > 1 else None)
        if not any(isinstance(i, dict) and i.get("type") == "function_call_output" for i in given):
            output: list[Any] = [
                ResponseFunctionToolCall(
                    type="function_call",
                    name="get_balance",
                    call_id="call_1",
                    arguments=json.dumps({"account": "a-1"}),
                ),
                ResponseFunctionToolCall(
                    type="function_call",
                    name="send_note",
                    call_id="call_2",
                    arguments=json.dumps({"text": "hi"}),
                ),
            ]
        else:
            output = [
                ResponseOutputMessage(
                    id="msg_1",
                    type="message",
                    role="assistant",
                    status="completed",
                    content=[ResponseOutputText(type="output_text", text="done", annotations=[])],
                )
            ]
        return SdkResponse(output=output, usage=Usage(), response_id=None)

    def stream_response(self, *args: Any, **kwargs: Any) -> Any:
        raise NotImplementedError


@function_tool
def create_ticket(subject: str) -> str:
    """Open a ticket."""
    return f"ticket {subject}"


def sdk_agent(log: Path) -> SdkAgent[Any]:
    server = MCPServerStdio(
        params={"command": sys.executable, "args": [str(SERVER), str(log)]}, name="test-server"
    )
    return SdkAgent(name="mcp", model=Script(), tools=[create_ticket], mcp_servers=[server])


def test_agents_sdk_mcp_tools_get_their_class_from_annotations(tmp_path: Path) -> None:
    agent = sdk_agent(tmp_path / "log")
    flow = openai_agents.agent_flow(agent, name="mcp", safety={"create_ticket": "idempotent"})
    assert classes(flow) == {"create_ticket": "idempotent", **DEFAULTS}

    trusted = openai_agents.agent_flow(
        agent,
        name="mcp",
        safety={"create_ticket": "idempotent", "get_balance": "unsafe"},
        trust_mcp_hints=True,
    )
    assert classes(trusted) == {
        "create_ticket": "idempotent",
        "get_balance": "unsafe",
        "set_status": "idempotent",
        "delete_ticket": "unsafe",
        "send_note": "unsafe",
    }
    with pytest.raises(TypeError, match="trust_mcp_hints must be True or False"):
        openai_agents.agent_flow(
            agent,
            name="mcp",
            safety={"create_ticket": "idempotent"},
            trust_mcp_hints="yes",  # type: ignore[arg-type]
        )


async def test_agents_sdk_run_calls_the_mcp_server(
    tmp_path: Path, db: Db, start_worker: StartWorker
) -> None:
    log = tmp_path / "log"
    flow = openai_agents.agent_flow(
        sdk_agent(log), name="mcp", safety={"create_ticket": "idempotent"}
    )
    await db.submit("mcp-2", flow, {"prompt": "note it"})
    await start_worker(flow)
    run = await db.wait_status("mcp-2", "succeeded", "failed", "paused", timeout=60)
    assert (run["status"], run["result"]) == ("succeeded", "done")
    calls = await db.calls("mcp-2")
    assert [(c["tool"], c["status"]) for c in calls] == [
        ("get_balance", "succeeded"),
        ("send_note", "succeeded"),
    ]
    # the result is what the SDK sends the model for the server's content
    assert [c["result"] for c in calls] == [
        [{"type": "input_text", "text": "a-1: 100"}],
        [{"type": "input_text", "text": "sent"}],
    ]
    assert [(e["tool"], e["args"]) for e in effects(log)] == [("send_note", {"text": "hi"})]
