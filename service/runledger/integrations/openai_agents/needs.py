"""What the OpenAI Agents SDK adapter assumes of the SDK, in words, each with its check:
:func:`check` runs them when a flow is built (``FrameworkMismatch`` names the installed
version when one fails), ``tests/unit/test_adapter_assumptions.py`` in the suite.

Two of them are of flags the SDK keeps private (a Codex tool, a plain ``def`` tool): they
are checked by their effect here, through the adapter's own readers."""

from __future__ import annotations

import functools
from typing import Any

from agents import (
    Agent,
    FunctionTool,
    ItemHelpers,
    ModelRetrySettings,
    ModelSettings,
    RunConfig,
    Runner,
    function_tool,
)
from agents.models.interface import Model, ModelProvider
from agents.tool import (
    maybe_invoke_function_tool_failure_error_function,
    set_function_tool_failure_error_function,
)
from agents.tool_context import ToolContext

from runledger.integrations._flows import Need, has_fields, require, takes
from runledger.integrations._mcp import run_aside
from runledger.integrations.openai_agents.tools import (
    is_sync,
    rejected_arguments,
    sdk_context,
    unsupported_tool,
)

ADAPTER = "OpenAI Agents SDK"
DISTRIBUTION = "openai-agents"


def _sync_probe(x: int) -> int:
    """A plain def tool for the checks."""
    return x


async def _async_probe(x: int) -> int:
    """An async tool for the checks."""
    return x


def _tells_sync_tools_apart() -> bool:
    return is_sync(function_tool(_sync_probe)) and not is_sync(function_tool(_async_probe))


def _tells_agent_tools_apart() -> bool:
    tool: Any = Agent(name="probe").as_tool("probe", "a probe")
    return (unsupported_tool(tool) or "").startswith("an agent as a tool") and (
        unsupported_tool(function_tool(_async_probe)) is None
    )


def _tells_rejected_arguments_apart() -> bool:
    """Arguments that do not validate fail the call before the function runs, with the
    error the adapter reads as "certainly no effect"; an exception of the function is not
    read so."""
    ran: list[int] = []

    @function_tool(failure_error_function=None)
    def probe(x: int) -> int:
        """A tool for the check."""
        ran.append(x)
        raise RuntimeError("the function ran")

    agent: Agent[Any] = Agent(name="probe")

    async def outcomes() -> list[bool]:
        seen = []
        for arguments in ('{"x": "not a number"}', '{"x": 1}'):
            ctx = sdk_context(agent, probe, None, "probe", arguments)
            try:
                await probe.on_invoke_tool(ctx, arguments)
            except Exception as exc:
                seen.append(rejected_arguments(probe, exc))
            else:
                seen.append(False)
        return seen

    return run_aside("the argument check", outcomes) == [True, False] and ran == [1]


NEEDS: list[Need] = [
    (
        "Runner.run(agent, input, context=, max_turns=, run_config=)",
        lambda: takes(Runner.run, "starting_agent", "input", "context", "max_turns", "run_config"),
    ),
    (
        "RunConfig(model_provider=, model_settings=, tracing_disabled=)",
        lambda: has_fields(RunConfig, "model_provider", "model_settings", "tracing_disabled"),
    ),
    (
        "ModelSettings.retry = ModelRetrySettings(max_retries=0) (no retries, the client's too)",
        lambda: (
            has_fields(ModelSettings, "retry", "tool_choice", "extra_args", "extra_body")
            and has_fields(ModelRetrySettings, "max_retries")
        ),
    ),
    (
        "Model.get_response(system_instructions, input, model_settings, tools, output_schema, "
        "handoffs, tracing, previous_response_id=, conversation_id=, prompt=)",
        lambda: takes(
            Model.get_response,
            "system_instructions",
            "input",
            "model_settings",
            "tools",
            "output_schema",
            "handoffs",
            "tracing",
            "previous_response_id",
            "conversation_id",
            "prompt",
        ),
    ),
    ("ModelProvider.get_model(model_name)", lambda: takes(ModelProvider.get_model, "model_name")),
    (
        "Agent.clone(), Agent.get_all_tools(run_context) and Agent's reset_tool_choice",
        lambda: (
            callable(Agent.clone)
            and takes(Agent.get_all_tools, "run_context")
            and has_fields(Agent, "reset_tool_choice", "tool_use_behavior", "model_settings")
        ),
    ),
    (
        "FunctionTool's on_invoke_tool, needs_approval, timeout_seconds, defer_loading, "
        "allowed_callers and output_json_schema",
        lambda: has_fields(
            FunctionTool,
            "on_invoke_tool",
            "needs_approval",
            "timeout_seconds",
            "defer_loading",
            "allowed_callers",
            "output_json_schema",
        ),
    ),
    (
        "ToolContext(context, tool_name, tool_call_id, tool_arguments, tool_call, agent)",
        lambda: takes(
            ToolContext,
            "context",
            "tool_name",
            "tool_call_id",
            "tool_arguments",
            "tool_call",
            "agent",
        ),
    ),
    (
        "ItemHelpers.tool_call_output_item(tool_call, output, output_json_schema=)",
        lambda: takes(
            ItemHelpers.tool_call_output_item, "tool_call", "output", "output_json_schema"
        ),
    ),
    (
        "agents.tool's set_function_tool_failure_error_function(tool, fn) and "
        "maybe_invoke_function_tool_failure_error_function(function_tool=, context=, error=)",
        lambda: (
            takes(set_function_tool_failure_error_function, "function_tool")
            and takes(
                maybe_invoke_function_tool_failure_error_function,
                "function_tool",
                "context",
                "error",
            )
        ),
    ),
    (
        "FunctionTool's flag of a Codex tool (_is_codex_tool)",
        lambda: has_fields(FunctionTool, "_is_codex_tool"),
    ),
    (
        "@function_tool to mark a plain def tool as the SDK's sync tool",
        _tells_sync_tools_apart,
    ),
    (
        "agents.tool.get_function_tool_origin(tool) to tell Agent.as_tool()'s tool by its "
        "ToolOriginType.AGENT_AS_TOOL",
        _tells_agent_tools_apart,
    ),
    (
        "FunctionTool.on_invoke_tool to refuse arguments that do not validate, before the "
        "function runs, with ModelBehaviorError('Invalid JSON input for tool NAME...')",
        _tells_rejected_arguments_apart,
    ),
]


@functools.cache
def check() -> None:
    """``FrameworkMismatch`` unless every need holds (checked once per process)."""
    require(ADAPTER, DISTRIBUTION, NEEDS)
