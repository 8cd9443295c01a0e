"""An Agents SDK ``FunctionTool`` as a runledger tool function.

The tool runs through its own ``on_invoke_tool`` (argument parsing and validation, the
``RunContextWrapper``/``ToolContext`` parameter, output validation), on a copy of the tool
whose failure function is switched off, so that an exception reaches runledger: it is
ambiguous and recovered by the tool's safety class, where the SDK would have turned it
into a message for the model at once. What the model is shown for a failed call is made
by the tool's own failure function (:func:`failure_output`).
"""

from __future__ import annotations

import asyncio
import copy
import json
from collections.abc import Callable
from typing import Any, cast

import pydantic_core
from agents import Agent, ToolOriginType
from agents.exceptions import ModelBehaviorError
from agents.items import ItemHelpers
from agents.mcp import MCPServer
from agents.tool import (
    FunctionTool,
    get_function_tool_origin,
    maybe_invoke_function_tool_failure_error_function,
    set_function_tool_failure_error_function,
)
from agents.tool_context import ToolContext as SdkToolContext
from openai.types.responses import ResponseFunctionToolCall

from runledger.flows import NotApplied, ToolContext, using_tool_context
from runledger.integrations.openai_agents.mcp import Sessions
from runledger.integrations.openai_agents.records import not_applied

ContextFn = Callable[[Any], Any]

_SYNC_MARK = "__agents_sync_function_tool__"  # set by @function_tool on a plain def's invoker


class ToolCallFailed(Exception):
    """A failed call, as the tool's failure function is given it when the model is shown
    the failure: ``str()`` is the recorded message (the exception's text, or runledger's
    reason as JSON), ``error`` the call's recorded error. Raised by the policy when the
    tool has no failure function (``failure_error_function=None``): the SDK would fail
    the run with the tool's exception."""

    def __init__(self, message: str, *, tool: str, error: Any = None) -> None:
        super().__init__(message)
        self.tool = tool
        self.error = error


def is_sync(tool: FunctionTool) -> bool:
    """True for a ``@function_tool`` on a plain ``def`` (the SDK runs it in a thread)."""
    return bool(getattr(tool.on_invoke_tool, _SYNC_MARK, False))


def sdk_context(
    agent: Agent[Any], tool: FunctionTool, value: Any, call_id: str, arguments: str
) -> SdkToolContext[Any]:
    """The ``ToolContext`` a tool of ``Runner.run`` gets; its ``tool_call_id`` is the
    call's idempotency key (stable across attempts, never the model's id)."""
    call = ResponseFunctionToolCall(
        type="function_call", name=tool.name, call_id=call_id, arguments=arguments
    )
    return SdkToolContext(
        context=value,
        tool_name=tool.name,
        tool_call_id=call_id,
        tool_arguments=arguments,
        tool_call=call,
        agent=agent,
    )


async def failure_output(
    tool: FunctionTool, ctx: SdkToolContext[Any], error: BaseException
) -> str | None:
    """What ``Runner.run`` shows the model for ``error`` (None: the tool has none)."""
    return await maybe_invoke_function_tool_failure_error_function(
        function_tool=tool, context=ctx, error=error
    )


def rejected_arguments(tool: FunctionTool, exc: Exception) -> bool:
    """The SDK refused the arguments before calling the function (bad JSON, or they do
    not validate against the signature): certainly no effect. The SDK tells such an error
    apart by the start of its text too; ``needs.py`` checks it still does."""
    return isinstance(exc, ModelBehaviorError) and str(exc).startswith(
        f"Invalid JSON input for tool {tool.name}"
    )


class ToolRunner:
    """The runledger tool functions of one agent's function tools."""

    def __init__(
        self, agent: Agent[Any], context: ContextFn | None, sessions: Sessions | None = None
    ) -> None:
        self.agent = agent
        self.context = context
        self.sessions = sessions or Sessions()

    def value(self, ctx: Any) -> Any:
        return self.context(ctx) if self.context is not None else None

    async def invoke(
        self, tool: FunctionTool, raising: FunctionTool, ctx: ToolContext, args: dict[str, Any]
    ) -> Any:
        arguments = json.dumps(args, ensure_ascii=False)
        sdk_ctx = sdk_context(self.agent, tool, self.value(ctx), ctx.idempotency_key, arguments)
        try:
            value = await raising.on_invoke_tool(sdk_ctx, arguments)
        except NotApplied as exc:  # the tool says the effect did not happen
            shown = await failure_output(tool, sdk_ctx, exc)
            raise not_applied(exc.reason, shown, retry=exc.retry) from exc
        except Exception as exc:
            if not rejected_arguments(tool, exc):
                raise  # ambiguous: recovered by the tool's safety class
            shown = await failure_output(tool, sdk_ctx, exc)
            raise not_applied(str(exc), shown) from exc
        # what the model is sent: the SDK's conversion of the return value (a tool with a
        # declared output type returned it validated; the SDK sends it as JSON by alias)
        call = cast(ResponseFunctionToolCall, sdk_ctx.tool_call)
        if tool.output_json_schema is not None and not isinstance(value, str):
            value = pydantic_core.to_jsonable_python(value, by_alias=True)
        item = ItemHelpers.tool_call_output_item(
            call, value, output_json_schema=tool.output_json_schema
        )
        return item["output"]

    def tool_fn(self, tool: FunctionTool, *, server: MCPServer | None = None) -> Callable[..., Any]:
        """A runledger tool function (``ctx`` first) that runs ``tool``: ``def`` for a plain
        ``def`` tool (runledger waits for its thread, it cannot be stopped), ``async def``
        otherwise (cancelled when the lease is lost). A tool of an MCP ``server`` runs
        with a session to it open."""
        raising = copy.copy(tool)  # the copy rebinds its invoker to itself
        set_function_tool_failure_error_function(raising, None)

        if server is not None:

            async def call_mcp(ctx: ToolContext, /, **args: Any) -> Any:
                with using_tool_context(ctx):
                    async with self.sessions.open([server]):
                        return await self.invoke(tool, raising, ctx, args)

            call_mcp.__name__ = tool.name
            call_mcp.__doc__ = tool.description
            return call_mcp

        if is_sync(tool):

            def call(ctx: ToolContext, /, **args: Any) -> Any:
                with using_tool_context(ctx):
                    return asyncio.run(self.invoke(tool, raising, ctx, args))

            call.__name__ = tool.name
            call.__doc__ = tool.description
            return call

        async def call_async(ctx: ToolContext, /, **args: Any) -> Any:
            with using_tool_context(ctx):
                return await self.invoke(tool, raising, ctx, args)

        call_async.__name__ = tool.name
        call_async.__doc__ = tool.description
        return call_async


def unsupported_tool(tool: FunctionTool) -> str | None:
    """Why agent_flow refuses a function tool (None: it does not)."""
    origin = get_function_tool_origin(tool)
    agent_tool = origin is not None and origin.type == ToolOriginType.AGENT_AS_TOOL
    # the SDK marks a Codex tool by a private flag only (needs.py checks it is there)
    if agent_tool or tool._is_codex_tool:
        return "an agent as a tool (its model requests would not be journaled)"
    if tool.needs_approval is not False:
        return "needs approval"
    if tool.tool_input_guardrails or tool.tool_output_guardrails:
        return "tool guardrails"
    if tool.defer_loading:
        return "deferred loading (tool search)"
    if tool.qualified_name != tool.name:
        return "a namespaced tool"
    if tool.allowed_callers not in (None, ["direct"]):
        return "programmatic callers"
    return None
