"""A Pydantic AI ``Agent`` as a runledger :class:`~runledger.Flow`: :func:`agent_flow`.

- **One model request is one journaled turn.** The policy rebuilds the agent's message
  list from the journal (the prompt, each turn's recorded ``ModelResponse``, each call's
  result), makes exactly one request through ``Agent.iter`` (so the agent's model, tool
  definitions, system prompts, instructions and model settings are those ``agent.run``
  would use), and stops before Pydantic AI would run a tool. The response, serialised by
  ``ModelMessagesTypeAdapter``, is the turn's ``Decision.record``; a recorded turn is never
  asked again.
- **Each agent tool is a runledger tool** with the safety class it is given; a function
  tool without one is refused when the flow is built. The tools of an ``MCPToolset``
  (listed from the server when the flow is built) are runledger tools too: one the flow
  does not name gets its class from the server's annotations (:mod:`.._mcp`), ``unsafe``
  when they say nothing. Tool code reads the idempotency key and
  fencing token from :func:`runledger.tool_context` and still gets a ``RunContext`` (with
  the flow's deps) if it takes one.
- **Failures look as they do under ``agent.run``.** A tool raising ``ModelRetry``, or
  called with arguments that fail validation, is a failed call that the model sees as the
  retried ``ToolReturnPart`` Pydantic AI builds (the tool's retry budget is counted over
  the journal, and exhausting it fails the run as ``agent.run`` raises); ``ToolFailed``
  becomes the failed ``ToolReturnPart``. A call that failed in runledger's own terms (a
  lookup that found nothing on the last attempt) is shown as a failed ``ToolReturnPart``
  that names the reason; one an operator gave up on (``abandoned``) as a failed
  ``ToolReturnPart`` saying that it may or may not have taken effect and must not be
  repeated, with the operator's note. Raising ``ModelRetry`` or ``ToolFailed``
  declares that the effect did not happen (it is runledger's ``NotApplied``); any other
  exception is ambiguous and is recovered by the tool's safety class.

Pydantic AI is imported only here (extra ``runledger-pg[pydantic-ai]``), through its public
API only (a unit test scans for private names): the run context a request or a tool gets
(its model, an ``agent.override`` included, and the tool-retry default) is captured by a
capability (``before_model_request``, ``get_wrapper_model``) on a run that is stopped
before its first request reaches the model; a tool is called through its toolset's
``tool_for_tool_def``. What the adapter assumes of that API is checked when a flow is
built (:mod:`.needs`): a release that breaks it is named, with its version.
"""

from __future__ import annotations

import asyncio
import inspect
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import pydantic_core
from pydantic import ValidationError
from pydantic_ai import Agent, RunContext
from pydantic_ai.capabilities import AbstractCapability
from pydantic_ai.exceptions import ModelRetry, ToolFailed, UnexpectedModelBehavior
from pydantic_ai.messages import (
    ModelMessage,
    ModelRequest,
    ModelResponse,
    RetryInfo,
    TextPart,
    ToolReturnPart,
)
from pydantic_ai.models import Model, ModelRequestContext, ModelRequestParameters
from pydantic_ai.models.wrapper import WrapperModel
from pydantic_ai.settings import ModelSettings
from pydantic_ai.tools import Tool as AgentTool
from pydantic_ai.toolsets import FunctionToolset
from pydantic_ai.usage import RunUsage

from runledger.flows import (
    Decision,
    Flow,
    HistoryTurn,
    LookupFn,
    PolicyContext,
    ToolCall,
    ToolContext,
    using_tool_context,
)
from runledger.integrations._flows import attach_lookups, default_prompt
from runledger.integrations._mcp import (
    McpToolsUnavailable,
    annotations_of,
    resolve_safety,
    run_aside,
)
from runledger.integrations.pydantic_ai import needs
from runledger.integrations.pydantic_ai.records import (
    failure,
    model_visible,
    not_applied,
    record_to_response,
    response_to_record,
    tool_result,
    validation_content,
)
from runledger.model import Safety

__all__ = [
    "McpToolsUnavailable",
    "UnsupportedResponse",
    "agent_flow",
    "record_to_response",
    "response_to_record",
]

PromptFn = Callable[[PolicyContext], Any]
DepsFn = Callable[[PolicyContext | ToolContext], Any]


class UnsupportedResponse(Exception):
    """The model's response needs a step a journaled turn cannot hold (Pydantic AI would
    answer it with a retry prompt and ask again: an output that failed validation, or a
    call of a tool the agent does not have, alone). The policy raises; runledger retries
    the policy and fails the run as ``policy_error`` if it keeps happening."""


def agent_flow(
    agent: Agent[Any, Any],
    *,
    name: str,
    version: str = "1",
    safety: Mapping[str, Safety | str],
    prompt: PromptFn | None = None,
    deps: DepsFn | None = None,
    lookups: Mapping[str, LookupFn] | None = None,
    max_attempts: int = 3,
    max_turns: int | None = None,
    max_calls: int | None = None,
    parallel_calls: bool = True,
    trust_mcp_hints: bool = False,
) -> Flow:
    """A :class:`~runledger.Flow` that runs ``agent`` one journaled model request per turn.

    - ``safety``: the safety class of every tool of the agent (a function tool without
      one, or a class for a tool the agent lacks, is a ``ValueError``); a tool of an
      ``MCPToolset`` it does not name gets the class its annotations give:
      ``readOnlyHint`` is ``read_only``, anything else ``unsafe``;
    - ``trust_mcp_hints``: also take ``idempotentHint`` (with ``destructiveHint: false``)
      as ``idempotent``: only for MCP servers you trust (docs/agents.md);
    - ``prompt(ctx)``: the user prompt from the :class:`~runledger.flows.PolicyContext`
      (default ``ctx.input["prompt"]``);
    - ``deps(ctx)``: the agent's deps, built from the ``PolicyContext`` for model requests
      and from the :class:`~runledger.ToolContext` for tool calls (both carry ``run_id``
      and ``flow``);
    - ``lookups``: ``{tool: fn(ctx) -> receipt | None}`` for the ``lookup`` tools;
    - ``max_attempts``: per tool, as ``@flow.tool``; ``max_turns``/``max_calls``: as ``Flow``;
    - a tool declared ``requires_approval=True`` is a runledger approval tool: each call is
      journaled awaiting a person (``runledger approve KEY`` / ``deny KEY --reason``) and
      the run pauses; a denied call reaches the model as a failed tool return with the
      person's reason;
    - ``parallel_calls``: the calls of one model response run at the same time, as under
      ``agent.run`` (``False``: one after another); a tool declared ``sequential=True``
      runs alone, after the calls before it and before the calls after it, as in
      Pydantic AI.
    """
    needs.check()
    tools = _agent_tools(agent)
    mcp = _mcp_tools(agent)
    classes = resolve_safety(
        tools,
        {name: annotations for name, (_, annotations) in mcp.items()},
        safety,
        trust_mcp_hints=trust_mcp_hints,
    )
    adapter = _Adapter(
        agent, tools, {n: t for n, (t, _) in mcp.items()}, prompt or default_prompt, deps
    )
    flow = Flow(
        name, version, max_turns=max_turns, max_calls=max_calls, parallel_calls=parallel_calls
    )
    for tool_name, (tool, _) in tools.items():
        flow.tool(
            safety=classes[tool_name],
            name=tool_name,
            timeout=tool.timeout,
            max_attempts=max_attempts,
            parallel=False if tool.sequential else None,
            # Pydantic AI's requires_approval: each call waits for `runledger approve`
            approval=bool(tool.requires_approval),
        )(adapter.tool_fn(tool))
    for tool_name in mcp:
        flow.tool(safety=classes[tool_name], name=tool_name, max_attempts=max_attempts)(
            adapter.mcp_tool_fn(tool_name)
        )
    attach_lookups(flow, lookups)
    flow.policy(adapter.decide)
    flow.validate()  # a 'lookup' tool without a lookup
    return flow


def _agent_tools(agent: Agent[Any, Any]) -> dict[str, tuple[AgentTool[Any], FunctionToolset[Any]]]:
    """Every function tool of the agent, with its toolset."""
    tools: dict[str, tuple[AgentTool[Any], FunctionToolset[Any]]] = {}
    mcp_class = _mcp_toolset_class()
    for toolset in agent.toolsets:
        if mcp_class is not None and isinstance(toolset, mcp_class):
            continue  # _mcp_tools
        if not isinstance(toolset, FunctionToolset):
            raise ValueError(
                f"toolset {toolset.label} is not a function toolset or an MCPToolset: only "
                "function and MCP tools can be journaled"
            )
        for tool_name, tool in toolset.tools.items():
            tools[tool_name] = (tool, toolset)
    return tools


def _mcp_toolset_class() -> type[Any] | None:
    """``pydantic_ai.mcp.MCPToolset``, None when its client (FastMCP) is not installed."""
    try:
        from pydantic_ai.mcp import MCPToolset
    except ImportError:
        return None
    return MCPToolset


def _mcp_tools(agent: Agent[Any, Any]) -> dict[str, tuple[Any, dict[str, Any] | None]]:
    """Every tool of the agent's ``MCPToolset``s that the model is shown, with its toolset
    and its annotations, listed from the servers now (each connected and closed again)."""
    mcp_class = _mcp_toolset_class()
    toolsets = [t for t in agent.toolsets if mcp_class is not None and isinstance(t, mcp_class)]
    tools: dict[str, tuple[Any, dict[str, Any] | None]] = {}
    for toolset in toolsets:

        async def listed(toolset: Any = toolset) -> list[Any]:
            async with toolset:
                return list(await toolset.list_tools())

        for mcp_tool in run_aside(f"MCP server {toolset.label}: tools not listed", listed):
            if not _visible_to_model(mcp_tool):
                continue
            if mcp_tool.name in tools:
                raise ValueError(f"two MCP servers of the agent have a tool {mcp_tool.name}")
            tools[mcp_tool.name] = (toolset, annotations_of(mcp_tool.annotations))
    return tools


def _visible_to_model(mcp_tool: Any) -> bool:
    """MCP Apps: a tool whose ``_meta.ui.visibility`` leaves out ``model`` is not shown to
    the model (Pydantic AI leaves it out of the agent's tools)."""
    meta = mcp_tool.meta if isinstance(mcp_tool.meta, dict) else {}
    ui = meta.get("ui")
    visibility = ui.get("visibility") if isinstance(ui, dict) else None
    return not isinstance(visibility, list) or "model" in visibility


class _Adapter:
    """The policy and the tool functions of one ``agent_flow``."""

    def __init__(
        self,
        agent: Agent[Any, Any],
        tools: dict[str, tuple[AgentTool[Any], FunctionToolset[Any]]],
        mcp: dict[str, Any],
        prompt: PromptFn,
        deps: DepsFn | None,
    ) -> None:
        self.agent = agent
        self.tools = tools
        self.mcp = mcp  # MCP tool name -> its MCPToolset
        self.prompt = prompt
        self.deps = deps

    # -- tools --------------------------------------------------------------------------

    def max_retries(self, tool_name: str, run: RunContext[Any]) -> int:
        """The tool's retry budget: the tool's own, its toolset's, or the run's default (the
        agent's ``retries``, or what ``agent.override``/``run`` set), as Pydantic AI
        resolves it."""
        if tool_name in self.mcp:
            budget = self.mcp[tool_name].max_retries
            return run.max_retries if budget is None else int(budget)
        tool, toolset = self.tools[tool_name]
        if tool.max_retries is not None:
            return tool.max_retries
        if toolset.max_retries is not None:
            return toolset.max_retries
        return run.max_retries

    def tool_fn(self, tool: AgentTool[Any]) -> Callable[..., Any]:
        """A runledger tool function (``ctx`` first) that runs the agent's tool function:
        ``def`` for a ``def`` (runledger waits for the thread), ``async def`` otherwise."""
        if inspect.iscoroutinefunction(tool.function):

            async def call_async(ctx: ToolContext, /, **args: Any) -> Any:
                with using_tool_context(ctx):
                    return await self.invoke(ctx, tool, args)

            call_async.__name__ = tool.name
            call_async.__doc__ = tool.description
            return call_async

        def call(ctx: ToolContext, /, **args: Any) -> Any:
            # the worker runs a def in a thread of its own: no event loop runs here
            with using_tool_context(ctx):
                return asyncio.run(self.invoke(ctx, tool, args))

        call.__name__ = tool.name
        call.__doc__ = tool.description
        return call

    def mcp_tool_fn(self, tool_name: str) -> Callable[..., Any]:
        """A runledger tool function that calls the MCP tool ``tool_name`` as Pydantic AI
        calls it (its toolset's ``call_tool``), on a session of its own: the toolset is
        entered for the call (a stdio server's process lives for one call)."""

        async def call_mcp(ctx: ToolContext, /, **args: Any) -> Any:
            with using_tool_context(ctx):
                return await self.invoke_mcp(ctx, tool_name, args)

        call_mcp.__name__ = tool_name
        return call_mcp

    async def invoke_mcp(self, ctx: ToolContext, tool_name: str, args: dict[str, Any]) -> Any:
        run = await self.run_context(ctx, tool_name)
        toolset = self.mcp[tool_name]
        async with toolset:
            built = (await toolset.get_tools(run)).get(tool_name)
            if built is None:
                raise not_applied("failed", f"the MCP server no longer has a tool {tool_name}")
            try:
                validated = dict(built.args_validator.validate_python(args))
            except ValidationError as exc:
                raise not_applied("retried", validation_content(exc), "validation_error") from exc
            try:
                return tool_result(await toolset.call_tool(tool_name, validated, run, built))
            except (ModelRetry, ToolFailed) as exc:
                raise model_visible(exc) from exc

    async def invoke(self, ctx: ToolContext, tool: AgentTool[Any], args: dict[str, Any]) -> Any:
        """Validate the arguments and call the tool as its toolset calls it (the tool's own
        timeout is runledger's: a call that outlives it is ambiguous, not retried)."""
        run = await self.run_context(ctx, tool.name)
        toolset = self.tools[tool.name][1]
        built = toolset.tool_for_tool_def(tool.tool_def, ctx=run, original_name=tool.name)
        try:
            validated = dict(built.args_validator.validate_python(args))
        except ValidationError as exc:
            raise not_applied("retried", validation_content(exc), "validation_error") from exc
        try:
            return tool_result(await built.call_func(validated, run))
        except (ModelRetry, ToolFailed) as exc:
            raise model_visible(exc) from exc

    async def run_context(self, ctx: ToolContext, tool_name: str) -> RunContext[Any]:
        """The ``RunContext`` a Pydantic AI tool gets, with the model ``agent.run`` would use
        now. ``retry`` is 0 and ``tool_call_id`` is None: the journal, not the run context,
        counts attempts (``ctx.attempt``)."""
        deps = self.deps(ctx) if self.deps else None
        captured = await self.capture("", deps)
        return RunContext(
            deps=deps,
            model=captured.run.model,
            usage=RunUsage(),
            agent=self.agent,
            tool_name=tool_name,
            max_retries=self.max_retries(tool_name, captured.run),
            run_id=ctx.run_id,
        )

    # -- the policy ---------------------------------------------------------------------

    async def decide(self, ctx: PolicyContext, history: Sequence[HistoryTurn]) -> Decision:
        """One model request on the journal's messages, as a :class:`~runledger.Decision`."""
        prompt = self.prompt(ctx)
        deps = self.deps(ctx) if self.deps else None
        if not history:
            return await self.request(prompt, None, deps)
        first = await self.capture(prompt, deps)
        messages: list[ModelMessage] = [first.sent]
        retries: dict[str, int] = {}
        for turn in history:
            response = record_to_response(turn.record)
            parts, retries = self.returns(turn, response, retries, first.run)
            messages += [response, ModelRequest(parts=parts, instructions=first.sent.instructions)]
        return await self.request(None, messages, deps)

    async def capture(self, prompt: Any, deps: Any) -> _Capture:
        """The run's first request (system prompts, prompt, instructions) as ``agent.run``
        builds it, and its run context, captured without asking the model."""
        capture = _Capture()
        async with self.agent.iter(prompt, deps=deps, capabilities=[capture]) as run:
            async for _ in run:
                if capture.model is not None and capture.model.sent is not None:
                    break
        return capture

    async def request(
        self, prompt: Any, messages: list[ModelMessage] | None, deps: Any
    ) -> Decision:
        """Drive ``agent.iter`` through one model request; stop before any tool runs."""
        response: ModelResponse | None = None
        async with self.agent.iter(prompt, message_history=messages, deps=deps) as run:
            node: Any = run.next_node
            while True:
                if Agent.is_model_request_node(node) and response is not None:
                    raise UnsupportedResponse(
                        "the model's response was not accepted as the final output and Pydantic "
                        "AI would ask again in the same turn (output validation or an unknown "
                        f"tool): {response.parts!r:.500}"
                    )
                if Agent.is_call_tools_node(node):
                    response = node.model_response
                    calls = self.calls(response)
                    if calls:
                        return Decision(calls=calls, record=response_to_record(response))
                if Agent.is_end_node(node):
                    assert response is not None
                    output = pydantic_core.to_jsonable_python(node.data.output, fallback=str)
                    return Decision(record=response_to_record(response), output=output)
                node = await run.next(node)

    def calls(self, response: ModelResponse) -> list[ToolCall]:
        """The turn's calls: every tool call of a response that calls a function tool (a
        call the flow has no tool for then fails the run as ``invalid_decision``); none
        when it calls no function tool (the output, decided by Pydantic AI)."""
        parts = response.tool_calls
        if not any(p.tool_name in self.tools or p.tool_name in self.mcp for p in parts):
            return []
        return [ToolCall(p.tool_name, p.args_as_dict(), provider_id=p.tool_call_id) for p in parts]

    def returns(
        self,
        turn: HistoryTurn,
        response: ModelResponse,
        retries: dict[str, int],
        run: RunContext[Any],
    ) -> tuple[list[ToolReturnPart], dict[str, int]]:
        """The tool results of one turn as ``agent.run`` would send them, and the tools'
        retry counts after the turn (Pydantic AI's rule: a success resets a tool's count,
        each failing step adds one)."""
        parts = response.tool_calls
        if [p.tool_name for p in parts] != [c.tool for c in turn.calls]:
            raise ValueError(f"turn {turn.turn}: the journal's calls do not match its record")
        out: list[ToolReturnPart] = []
        failed: set[str] = set()
        succeeded: set[str] = set()
        for part, call in zip(parts, turn.calls, strict=True):
            tool_call_id = call.provider_id or part.tool_call_id
            if call.status == "succeeded":
                succeeded.add(call.tool)
                returned = ToolReturnPart(
                    tool_name=call.tool,
                    content=call.result,
                    tool_call_id=tool_call_id,
                    tool_kind=part.tool_kind,
                )
                out.append(ToolReturnPart.narrow_type(returned))
                continue
            kind, cause, content = failure(call)
            retry: RetryInfo[Any] | None = None
            if kind == "retried":
                limit = self.max_retries(call.tool, run)
                used = retries.get(call.tool, 0)
                if used >= limit:
                    raise UnexpectedModelBehavior(
                        f"Tool {call.tool!r} exceeded max retries count of {limit}"
                    )
                failed.add(call.tool)
                retry = RetryInfo(cause=cause or "model_retry", attempt=used + 1, max_retries=limit)
            out.append(
                ToolReturnPart(
                    tool_name=call.tool,
                    content=content,
                    tool_call_id=tool_call_id,
                    tool_kind=part.tool_kind,
                    outcome="retried" if kind == "retried" else "failed",
                    retry=retry,
                )
            )
        after = {k: v for k, v in retries.items() if k not in succeeded}
        after.update({name: retries.get(name, 0) + 1 for name in failed})
        return out, after


class _CaptureRequest(WrapperModel):
    """Keeps the last message of the first request and answers it with an empty text."""

    sent: ModelRequest | None = None

    async def request(
        self,
        messages: list[ModelMessage],
        model_settings: ModelSettings | None,
        model_request_parameters: ModelRequestParameters,
    ) -> ModelResponse:
        last = messages[-1]
        assert isinstance(last, ModelRequest)
        self.sent = last
        return ModelResponse(parts=[TextPart("")], model_name=self.model_name)


class _Capture(AbstractCapability[Any]):
    """A capability that keeps the run context of the run's first model request and
    serves that request with :class:`_CaptureRequest` around the model the run chose."""

    def __init__(self) -> None:
        self.model: _CaptureRequest | None = None
        self.context: RunContext[Any] | None = None

    async def before_model_request(
        self, ctx: RunContext[Any], request_context: ModelRequestContext
    ) -> ModelRequestContext:
        if self.context is None:
            self.context = ctx
        return request_context

    def get_wrapper_model(self, model: Model) -> Model | None:
        if self.model is None:
            self.model = _CaptureRequest(model)
        return self.model

    @property
    def sent(self) -> ModelRequest:
        if self.model is None or self.model.sent is None:
            raise RuntimeError("the agent run ended before its first model request")
        return self.model.sent

    @property
    def run(self) -> RunContext[Any]:
        if self.context is None:
            raise RuntimeError("the agent run ended before its first model request")
        return self.context
