"""The policy of an ``agent_flow``: one model request per turn, on the input items a plain
``Runner.run`` of the agent would send after the journal's turns."""

from __future__ import annotations

import asyncio
import dataclasses
import hashlib
import json
from collections.abc import Callable, Sequence
from typing import Any

import pydantic_core
from agents import Agent, RunConfig, RunContextWrapper
from agents.exceptions import ModelRefusalError, ModelTimeoutError
from agents.items import ItemHelpers, ModelResponse, TResponseInputItem
from agents.models._retry_runtime import provider_managed_retries_disabled
from agents.models.interface import Model, ModelTracing
from agents.run_internal.items import (
    deduplicate_input_items_preferring_latest,
    prepare_model_input_items,
)
from agents.run_internal.prompt_cache_key import model_settings_with_prompt_cache_key
from agents.run_internal.turn_preparation import get_model, get_model_settings, get_output_schema
from agents.tool import FunctionTool, Tool
from openai.types.responses import ResponseOutputMessage

from runledger.flows import (
    Decision,
    HistoryCall,
    HistoryTurn,
    InvalidDecision,
    PolicyContext,
    ToolCall,
)
from runledger.integrations._history import UnusableHistory, abandoned, pair_calls
from runledger.integrations.openai import InvalidToolArguments
from runledger.integrations.openai_agents.records import (
    call_output,
    failure,
    function_calls,
    replayed_items,
    response_to_record,
)
from runledger.integrations.openai_agents.tools import (
    ContextFn,
    ToolCallFailed,
    failure_output,
    sdk_context,
)

PromptFn = Callable[[PolicyContext], Any]


class UnsupportedResponse(Exception):
    """The model's response needs a step a journaled turn cannot hold: ``Runner.run`` would
    ask the model again in the same turn (a structured output type, and no text to parse).
    The policy raises; runledger retries the policy and fails the run as ``policy_error``
    if it keeps happening."""


class AgentPolicy:
    """``decide(ctx, history)``: the flow's policy."""

    def __init__(
        self,
        agent: Agent[Any],
        tools: dict[str, FunctionTool],
        prompt: PromptFn,
        context: ContextFn | None,
    ) -> None:
        self.agent = agent
        self.tools = tools
        self.prompt = prompt
        self.context = context
        self.run_config = RunConfig()  # what Runner.run uses when given none

    def model(self) -> Model:
        """The model ``Runner.run(agent, ...)`` would use."""
        return get_model(self.agent, self.run_config)

    async def decide(self, ctx: PolicyContext, history: Sequence[HistoryTurn]) -> Decision:
        """One model request on the journal's items, as a :class:`~runledger.Decision`."""
        value = self.context(ctx) if self.context is not None else None
        wrapper: RunContextWrapper[Any] = RunContextWrapper(context=value)
        caller = ItemHelpers.input_to_new_input_list(self.prompt(ctx))
        generated: list[TResponseInputItem] = []
        for turn in history:
            generated += replayed_items(turn.record)
            generated += await self.outputs(ctx, turn, value)
        items = deduplicate_input_items_preferring_latest(
            prepare_model_input_items(caller, generated)
        )
        wrapper.turn_input = list(caller)
        used_tools = any(t.calls for t in history)
        tools = await self.agent.get_all_tools(wrapper)  # the enabled ones
        response = await self.request(ctx, wrapper, items, tools, used_tools=used_tools)
        return self.decision(response, {t.name for t in tools})

    async def request(
        self,
        ctx: PolicyContext,
        wrapper: RunContextWrapper[Any],
        items: list[TResponseInputItem],
        tools: list[Tool],
        *,
        used_tools: bool,
    ) -> ModelResponse:
        """Exactly one ``Model.get_response`` with what ``Runner.run`` passes: the agent's
        instructions, prompt, enabled tools, output schema and model settings (``tool_choice``
        reset once tools were used, as ``reset_tool_choice`` asks). The SDK's own retries
        (runner and client) are off: runledger retries the policy."""
        agent = self.agent
        system, prompt = await asyncio.gather(
            agent.get_system_prompt(wrapper), agent.get_prompt(wrapper)
        )
        model = self.model()
        settings = get_model_settings(agent, self.run_config)
        if agent.reset_tool_choice is True and used_tools:
            settings = dataclasses.replace(settings, tool_choice=None)
        settings = model_settings_with_prompt_cache_key(settings, self.cache_key(model, ctx))
        with provider_managed_retries_disabled(True):
            call = model.get_response(
                system_instructions=system,
                input=items,
                model_settings=settings,
                tools=tools,
                output_schema=get_output_schema(agent),
                handoffs=[],
                tracing=ModelTracing.DISABLED,
                previous_response_id=None,
                conversation_id=None,
                prompt=prompt,
            )
            if settings.timeout is None:
                return await call
            try:
                return await asyncio.wait_for(call, settings.timeout)
            except TimeoutError:
                raise ModelTimeoutError(settings.timeout) from None

    def cache_key(self, model: Model, ctx: PolicyContext) -> str | None:
        """The ``prompt_cache_key`` ``Runner.run`` adds for OpenAI models, one per run: here
        derived from the run id, so that every worker sends the same one."""
        supports = getattr(model, "_supports_default_prompt_cache_key", None)
        if not (callable(supports) and supports()):
            return None
        digest = hashlib.sha256(ctx.run_id.encode()).hexdigest()[:32]
        return f"agents-sdk:run:{digest}"

    def decision(self, response: ModelResponse, enabled: set[str]) -> Decision:
        """The calls of a response that calls tools; otherwise its final output, decided as
        ``Runner.run`` decides it."""
        record = response_to_record(response)
        calls = [self.call(item) for item in function_calls(response.output)]
        for c in calls:
            if c.tool in self.tools and c.tool not in enabled:
                raise InvalidDecision(f"tool {c.tool!r} is not enabled for this request")
        if calls:
            return Decision(calls=calls, record=record)
        messages = [i for i in response.output if isinstance(i, ResponseOutputMessage)]
        last = messages[-1] if messages else None
        refusal = ItemHelpers.extract_refusal(last) if last is not None else None
        if refusal:
            raise ModelRefusalError(refusal)
        text = ItemHelpers.extract_text(last) if last is not None else None
        schema = get_output_schema(self.agent)
        if schema is None or schema.is_plain_text():
            return Decision(record=record, output=text or "")
        if not text:
            raise UnsupportedResponse(
                "Model returned no final output for the structured output type (Runner.run "
                f"would ask again in the same turn): {record['output']!r:.500}"
            )
        output = schema.validate_json(text)  # ModelBehaviorError, as Runner.run raises
        return Decision(
            record=record, output=pydantic_core.to_jsonable_python(output, fallback=str)
        )

    def call(self, item: Any) -> ToolCall:
        """A ``function_call`` item as a :class:`~runledger.ToolCall` (a tool the flow does not
        have fails the run as ``invalid_decision``, as ``Runner.run`` raises)."""
        raw = item.arguments
        try:
            args = json.loads(raw) if raw else {}
        except ValueError as exc:
            raise InvalidToolArguments(
                tool=item.name, provider_id=item.call_id, arguments=raw, reason=str(exc)
            ) from exc
        if not isinstance(args, dict):
            raise InvalidToolArguments(
                tool=item.name, provider_id=item.call_id, arguments=raw, reason="not an object"
            )
        if getattr(item, "namespace", None):  # the agent has no namespaced tools
            raise InvalidDecision(f"unknown tool {item.namespace}.{item.name}")
        return ToolCall(item.name, args, provider_id=item.call_id)

    async def outputs(
        self, ctx: PolicyContext, turn: HistoryTurn, value: Any
    ) -> list[TResponseInputItem]:
        """One ``function_call_output`` per call of the turn, in the record's order."""
        ids = [_get(i, "call_id") for i in function_calls(replayed_items(turn.record))]
        try:
            pairs = pair_calls(turn, ids)
        except UnusableHistory as exc:
            raise ValueError(str(exc)) from exc
        out: list[TResponseInputItem] = []
        for call_id, call in pairs:
            output = call_output(call) if call.status == "succeeded" else None
            if output is None:
                key = f"{ctx.run_id}:{turn.turn}:{call.call_id}"
                output = await self.failed_output(call, key, value)
            out.append({"call_id": call_id, "output": output, "type": "function_call_output"})
        return out

    async def failed_output(self, call: HistoryCall, key: str, value: Any) -> str:
        """What ``Runner.run`` shows the model for a failed call: the tool's failure function
        applied to the failure (the SDK's default: a fixed "An error occurred" message).

        A call an operator gave up on is no failure of the tool: it may have taken effect,
        and the SDK's "Please try again" would have the model send it again. The model is
        told so, with the operator's note, whatever the tool's failure function."""
        given_up = abandoned(call)
        if given_up is not None:
            return given_up
        rendered, output, message = failure(call)
        if rendered and output is not None:
            return output
        tool = self.tools.get(call.tool)
        error = ToolCallFailed(message, tool=call.tool, error=call.error)
        if tool is None or rendered:
            raise error
        args = json.dumps(call.args, ensure_ascii=False)
        shown = await failure_output(tool, sdk_context(self.agent, tool, value, key, args), error)
        if shown is None:
            raise error
        return shown


def _get(item: Any, key: str) -> Any:
    return item.get(key) if isinstance(item, dict) else getattr(item, key, None)


__all__ = ["AgentPolicy", "UnsupportedResponse"]
