"""An OpenAI Agents SDK ``Agent`` as a runledger :class:`~runledger.Flow`: :func:`agent_flow`.

- **One model request is one journaled turn.** The policy rebuilds the SDK's input items
  from the journal (the prompt, each turn's recorded output items, each call's result as
  a ``function_call_output``) the way ``Runner.run`` builds them, and makes exactly one
  ``Model.get_response`` with the agent's own model, instructions, prompt, tools, output
  schema and model settings. The response's output items are the turn's
  ``Decision.record``; a recorded turn is never asked again.
- **Each function tool is a runledger tool** with the safety class it is given; a tool
  without one is refused when the flow is built. The tools of the agent's MCP servers
  (listed when the flow is built) are runledger tools too: one the flow does not name
  gets its class from the server's annotations, ``unsafe`` when they say nothing. Tool
  code reads the idempotency key and fencing token from :func:`runledger.tool_context`
  and still gets the SDK's ``ToolContext`` (with the run context from ``context=``) if
  it takes one.
- **Failures look as they do under ``Runner.run``**: a failed call is shown to the model
  as the tool's ``failure_error_function`` renders it. Arguments the SDK refuses (bad
  JSON, or failing validation) and a tool raising :class:`runledger.NotApplied` fail the
  call at once (certainly no effect); any other exception is ambiguous and recovered by
  the tool's safety class first (where ``Runner.run`` would tell the model at once).
  A call an operator gave up on (``abandoned``) is no failure of the tool: the model is
  told it may or may not have taken effect and must not be repeated, with the
  operator's note, whatever the tool's failure function.
- **Not supported, refused when the flow is built**: handoffs, guardrails (agent and
  tool), hosted and other non-function tools, agents as tools, tools (MCP tools too) that
  need approval or deferred loading, namespaced tools, agent hooks, a
  ``tool_use_behavior`` other than ``"run_llm_again"``, sandbox agents.

The Agents SDK is imported only here (extra ``runledger-pg[openai-agents]``), through its
public API but for two flags the SDK keeps private (a unit test scans for private names
and lists these): the model request is made by ``Runner.run`` itself, through a model
provider whose models end the run once the model has answered; the SDK's own retries are
off by ``ModelRetrySettings(max_retries=0)``. The private flags tell a Codex tool
(refused, as an agent tool is by its public origin) and a plain ``def`` tool (run as a
``def``) from the others. What the
adapter assumes of the SDK is checked when a flow is built (:mod:`.needs`): a release
that breaks it is named, with its version.
"""

from __future__ import annotations

import logging
from collections.abc import Mapping
from typing import Any

from agents import Agent
from agents.tool import FunctionTool

from runledger.flows import Flow, LookupFn
from runledger.integrations._flows import attach_lookups, default_prompt
from runledger.integrations._mcp import McpToolsUnavailable, resolve_safety
from runledger.integrations.openai_agents import needs
from runledger.integrations.openai_agents.mcp import Sessions, mcp_tools
from runledger.integrations.openai_agents.policy import AgentPolicy, PromptFn, UnsupportedResponse
from runledger.integrations.openai_agents.records import record_to_response, response_to_record
from runledger.integrations.openai_agents.tools import (
    ContextFn,
    ToolCallFailed,
    ToolRunner,
    unsupported_tool,
)
from runledger.model import Safety

__all__ = [
    "McpToolsUnavailable",
    "ToolCallFailed",
    "UnsupportedResponse",
    "agent_flow",
    "record_to_response",
    "response_to_record",
]

log = logging.getLogger(__name__)


def agent_flow(
    agent: Agent[Any],
    *,
    name: str,
    version: str = "1",
    safety: Mapping[str, Safety | str],
    prompt: PromptFn | None = None,
    context: ContextFn | None = None,
    lookups: Mapping[str, LookupFn] | None = None,
    max_attempts: int = 3,
    max_turns: int | None = None,
    max_calls: int | None = None,
    parallel_calls: bool = True,
    trust_mcp_hints: bool = False,
) -> Flow:
    """A :class:`~runledger.Flow` that runs ``agent`` one journaled model request per turn.

    - ``safety``: the safety class of every function tool of the agent (a tool without
      one, or a class for a tool the agent lacks, is a ``ValueError``); a tool of an MCP
      server it does not name gets the class its annotations give: ``readOnlyHint`` is
      ``read_only``, anything else ``unsafe``;
    - ``trust_mcp_hints``: also take ``idempotentHint`` (with ``destructiveHint: false``)
      as ``idempotent``: only for MCP servers you trust (docs/agents.md);
    - ``prompt(ctx)``: the input from the :class:`~runledger.flows.PolicyContext`, a string
      or a list of input items, as ``Runner.run`` takes it (default ``ctx.input["prompt"]``);
    - ``context(ctx)``: the run context (``Runner.run(context=...)``), built from the
      ``PolicyContext`` for model requests and from the :class:`~runledger.ToolContext` for
      tool calls (both carry ``run_id`` and ``flow``);
    - ``lookups``: ``{tool: fn(ctx) -> receipt | None}`` for the ``lookup`` tools;
    - ``max_attempts``: per tool, as ``@flow.tool``; ``max_turns``/``max_calls``: as ``Flow``
      (``Runner.run``'s ``max_turns`` is not used);
    - ``parallel_calls``: the function calls of one response run at the same time, as
      ``Runner.run`` runs them (``False``: one after another).
    """
    needs.check()
    _refuse_unsupported(agent)
    tools = _function_tools(agent)
    mcp = mcp_tools(agent)
    for name, found in mcp.items():
        why = unsupported_tool(found.tool)
        if why:
            raise ValueError(f"MCP tool {name}: {why}: not supported by agent_flow")
        if name in tools:
            raise ValueError(f"an MCP server's tool has the name of a function tool: {name}")
    classes = resolve_safety(
        tools,
        {name: found.annotations for name, found in mcp.items()},
        safety,
        trust_mcp_hints=trust_mcp_hints,
    )
    if agent.model_settings.retry is not None:
        log.warning(
            "agent %s: ModelSettings.retry is not used: runledger retries the model request "
            "(the worker's policy_attempts)",
            agent.name,
        )
    sessions = Sessions()
    runner = ToolRunner(agent, context, sessions)
    flow = Flow(
        name, version, max_turns=max_turns, max_calls=max_calls, parallel_calls=parallel_calls
    )
    for tool_name, tool in tools.items():
        flow.tool(
            safety=classes[tool_name],
            name=tool_name,
            timeout=tool.timeout_seconds,
            max_attempts=max_attempts,
        )(runner.tool_fn(tool))
    for tool_name, found in mcp.items():
        flow.tool(
            safety=classes[tool_name],
            name=tool_name,
            timeout=found.tool.timeout_seconds,
            max_attempts=max_attempts,
        )(runner.tool_fn(found.tool, server=found.server))
    attach_lookups(flow, lookups)
    every = {**tools, **{name: found.tool for name, found in mcp.items()}}
    policy = AgentPolicy(agent, every, prompt or default_prompt, context, sessions)
    flow.policy(policy.decide)
    flow.validate()  # a 'lookup' tool without a lookup
    return flow


def _refuse_unsupported(agent: Agent[Any]) -> None:
    """Refuse what a journaled turn cannot hold, naming it."""
    if not isinstance(agent, Agent):
        raise TypeError(f"expected an agents.Agent, got {type(agent).__name__}")
    if type(agent).__name__ == "SandboxAgent":
        raise ValueError(f"agent {agent.name}: sandbox agents are not supported")
    refused = [
        (agent.handoffs, "handoffs"),
        (agent.input_guardrails, "input guardrails"),
        (agent.output_guardrails, "output guardrails"),
        (agent.hooks, "agent hooks"),
    ]
    for present, what in refused:
        if present:
            raise ValueError(f"agent {agent.name} has {what}: not supported by agent_flow")
    if agent.tool_use_behavior != "run_llm_again":
        raise ValueError(
            f"agent {agent.name}: tool_use_behavior={agent.tool_use_behavior!r} is not "
            "supported (only 'run_llm_again': the model sees every tool result)"
        )


def _function_tools(agent: Agent[Any]) -> dict[str, FunctionTool]:
    """Every tool of the agent, which must be a plain function tool."""
    tools: dict[str, FunctionTool] = {}
    for tool in agent.tools:
        label = getattr(tool, "name", type(tool).__name__)
        if not isinstance(tool, FunctionTool):
            raise ValueError(
                f"tool {label} is a {type(tool).__name__}: only function tools can be journaled "
                "(hosted tools run outside the journal)"
            )
        why = unsupported_tool(tool)
        if why:
            raise ValueError(f"tool {tool.name}: {why}: not supported by agent_flow")
        if tool.name in tools:
            raise ValueError(f"agent {agent.name} has two tools named {tool.name}")
        tools[tool.name] = tool
    return tools
