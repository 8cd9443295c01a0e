"""What the Pydantic AI adapter assumes of Pydantic AI's public API, in words, each with
its check: :func:`check` runs them when a flow is built (``FrameworkMismatch`` names the
installed version when one fails), ``tests/unit/test_adapter_assumptions.py`` in the
suite."""

from __future__ import annotations

import functools

from pydantic import TypeAdapter, ValidationError
from pydantic_ai import Agent, RunContext
from pydantic_ai.capabilities import AbstractCapability
from pydantic_ai.messages import RetryInfo, ToolReturnPart
from pydantic_ai.models.wrapper import WrapperModel
from pydantic_ai.tools import Tool
from pydantic_ai.toolsets import FunctionToolset
from pydantic_ai.toolsets.function import FunctionToolsetTool

from runledger.integrations._flows import Need, has_fields, require, takes
from runledger.integrations.pydantic_ai.records import validation_content

ADAPTER = "Pydantic AI"
DISTRIBUTION = "pydantic-ai-slim"

NEEDS: list[Need] = [
    (
        "Agent.iter(prompt, message_history=, deps=, capabilities=)",
        lambda: takes(Agent.iter, "user_prompt", "message_history", "deps", "capabilities"),
    ),
    (
        "Agent.override(model=)",
        lambda: takes(Agent.override, "model"),
    ),
    (
        "Agent.is_model_request_node, is_call_tools_node and is_end_node",
        lambda: all(
            callable(getattr(Agent, n, None))
            for n in ("is_model_request_node", "is_call_tools_node", "is_end_node")
        ),
    ),
    (
        "the capability hook before_model_request(ctx, request_context)",
        lambda: takes(AbstractCapability.before_model_request, "ctx", "request_context"),
    ),
    (
        "the capability hook get_wrapper_model(model)",
        lambda: takes(AbstractCapability.get_wrapper_model, "model"),
    ),
    (
        "WrapperModel(wrapped).request(messages, model_settings, model_request_parameters)",
        lambda: (
            takes(WrapperModel.__init__, "wrapped")
            and takes(
                WrapperModel.request, "messages", "model_settings", "model_request_parameters"
            )
        ),
    ),
    (
        "FunctionToolset.tool_for_tool_def(tool_def, ctx=, original_name=) and max_retries",
        lambda: (
            takes(FunctionToolset.tool_for_tool_def, "tool_def", "ctx", "original_name")
            and "max_retries" in vars(FunctionToolset())
        ),
    ),
    (
        "FunctionToolsetTool's args_validator and call_func",
        lambda: has_fields(FunctionToolsetTool, "args_validator", "call_func"),
    ),
    (
        "Tool's function, tool_def, max_retries, timeout, sequential and requires_approval",
        lambda: all(
            hasattr(Tool(_probe), n)
            for n in (
                "function",
                "tool_def",
                "max_retries",
                "timeout",
                "sequential",
                "requires_approval",
            )
        ),
    ),
    (
        "RunContext(deps, model, usage, agent, tool_name, max_retries, run_id)",
        lambda: has_fields(
            RunContext, "deps", "model", "usage", "agent", "tool_name", "max_retries", "run_id"
        ),
    ),
    (
        "ToolReturnPart(outcome=, retry=) and RetryInfo(cause, attempt, max_retries)",
        lambda: (
            has_fields(ToolReturnPart, "outcome", "retry", "tool_kind")
            and has_fields(RetryInfo, "cause", "attempt", "max_retries")
        ),
    ),
    (
        "a stored 'retry-prompt' part of a tool loads as its retried ToolReturnPart (what the "
        "model is shown for arguments that fail validation)",
        lambda: _shows_validation_errors(),
    ),
]


def _shows_validation_errors() -> bool:
    try:
        TypeAdapter(int).validate_python("x")
    except ValidationError as exc:
        shown = validation_content(exc)
        return isinstance(shown, list) and [d.get("loc") for d in shown] == [[]]
    return False


def _probe(x: int) -> int:
    """A tool function for the checks."""
    return x


@functools.cache
def check() -> None:
    """``FrameworkMismatch`` unless every need holds (checked once per process)."""
    require(ADAPTER, DISTRIBUTION, NEEDS)
