"""The policy of an ``agent_flow``: one model request per turn, on the input items a plain
``Runner.run`` of the agent would send after the journal's turns."""

from __future__ import annotations

import dataclasses
import hashlib
import inspect
import json
from collections.abc import Callable, Sequence
from typing import Any

import pydantic_core
from agents import (
    Agent,
    AgentOutputSchema,
    AgentOutputSchemaBase,
    ModelRetrySettings,
    ModelSettings,
    RunConfig,
    RunContextWrapper,
    Runner,
)
from agents.exceptions import ModelRefusalError
from agents.items import ItemHelpers, ModelResponse, TResponseInputItem
from agents.models.interface import Model, ModelProvider
from agents.tool import FunctionTool
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
from runledger.integrations.openai_agents.mcp import Sessions
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
        sessions: Sessions | None = None,
    ) -> None:
        self.agent = agent
        self.tools = tools
        self.prompt = prompt
        self.context = context
        self.sessions = sessions or Sessions()

    async def decide(self, ctx: PolicyContext, history: Sequence[HistoryTurn]) -> Decision:
        """One model request on the journal's items, as a :class:`~runledger.Decision`."""
        value = self.context(ctx) if self.context is not None else None
        wrapper: RunContextWrapper[Any] = RunContextWrapper(context=value)
        items = ItemHelpers.input_to_new_input_list(self.prompt(ctx))
        for turn in history:
            items += replayed_items(turn.record)
            items += await self.outputs(ctx, turn, value)
        used_tools = any(t.calls for t in history)
        # the agent's MCP servers, connected while the request lists and shows their tools
        async with self.sessions.open(self.agent.mcp_servers):
            enabled = {t.name for t in await self.agent.get_all_tools(wrapper)}
            response = await self.request(ctx, items, value, used_tools=used_tools)
        return self.decision(response, enabled)

    async def request(
        self,
        ctx: PolicyContext,
        items: list[TResponseInputItem],
        value: Any,
        *,
        used_tools: bool,
    ) -> ModelResponse:
        """Exactly one model request, made by ``Runner.run`` itself (the agent's model,
        instructions, prompt, enabled tools, output schema and model settings, with
        ``tool_choice`` reset once tools were used, as ``reset_tool_choice`` asks) and
        stopped as soon as the model has answered, before any tool runs. The SDK's own
        retries (runner and client) are off (``ModelRetrySettings(max_retries=0)``):
        runledger retries the policy. Tracing is off."""
        agent = self.agent
        if agent.reset_tool_choice is True and used_tools:
            settings = dataclasses.replace(agent.model_settings, tool_choice=None)
            agent = agent.clone(model_settings=settings)
        one = _OneRequest.factory(agent, self.cache_key(ctx))
        provider = _OneRequestProvider(RunConfig().model_provider, one)
        if isinstance(agent.model, Model):
            agent = agent.clone(model=one(agent.model))
        config = RunConfig(
            model_provider=provider,
            model_settings=ModelSettings(retry=ModelRetrySettings(max_retries=0)),
            tracing_disabled=True,
        )
        try:
            await Runner.run(agent, items, context=value, max_turns=1, run_config=config)
        except _Answered as answered:
            return answered.response
        raise RuntimeError("the agent run ended without a model request")

    def cache_key(self, ctx: PolicyContext) -> str:
        """The ``prompt_cache_key`` of the run, for a model ``Runner.run`` gives one to:
        derived from the run id, so that every worker sends the same one."""
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
        schema = output_schema(self.agent)
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
        applied to the failure (the SDK's ``default_tool_error_function`` unless the tool
        has its own), called here: its text is the installed SDK's, never a copy.

        A call an operator gave up on is no failure of the tool: it may have taken effect,
        and a failure message would have the model send it again. The model is told so,
        with the operator's note, whatever the tool's failure function."""
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


def output_schema(agent: Agent[Any]) -> AgentOutputSchemaBase | None:
    """The agent's output schema as ``Runner.run`` resolves it (None: plain text)."""
    if agent.output_type is None or agent.output_type is str:
        return None
    if isinstance(agent.output_type, AgentOutputSchemaBase):
        return agent.output_type
    return AgentOutputSchema(agent.output_type)


class _Answered(Exception):
    """The model has answered the run's one request: ``Runner.run`` stops here."""

    def __init__(self, response: ModelResponse) -> None:
        super().__init__("answered")
        self.response = response


class _OneRequest(Model):
    """The model ``Runner.run`` resolved, asked once: the response ends the run (raised as
    :class:`_Answered`) before the runner acts on it. Anything else the runner asks of the
    model (what it supports) is the model's own answer."""

    def __init__(self, model: Model, retry: ModelRetrySettings | None, cache_key: Any) -> None:
        self.model = model
        self.retry = retry
        self.key = cache_key

    @classmethod
    def factory(cls, agent: Agent[Any], key: str) -> Callable[[Model], _OneRequest]:
        """A wrapper for whichever model the run resolves, which gives the model the
        agent's own settings (the retry switch is the runner's) and this run's prompt
        cache key where the runner made one up."""
        own = agent.model_settings
        users = any(
            isinstance(extra, dict) and "prompt_cache_key" in extra
            for extra in (own.extra_args, own.extra_body)
        )
        return lambda model: cls(model, own.retry, None if users else key)

    def __getattr__(self, name: str) -> Any:
        model = self.__dict__.get("model")
        if model is None:  # not yet initialised (a copy being made)
            raise AttributeError(name)
        return getattr(model, name)

    def settings(self, settings: ModelSettings) -> ModelSettings:
        settings = dataclasses.replace(settings, retry=self.retry)
        extra = dict(settings.extra_args or {})
        if self.key is not None and "prompt_cache_key" in extra:
            extra["prompt_cache_key"] = self.key  # the runner's is one per Runner.run
            settings = dataclasses.replace(settings, extra_args=extra)
        return settings

    async def get_response(self, *args: Any, **kwargs: Any) -> ModelResponse:
        bound = _GET_RESPONSE.bind(self, *args, **kwargs)
        bound.arguments["model_settings"] = self.settings(bound.arguments["model_settings"])
        del bound.arguments["self"]
        response = await self.model.get_response(**bound.arguments)
        raise _Answered(response)

    def stream_response(self, *args: Any, **kwargs: Any) -> Any:
        raise NotImplementedError("agent_flow makes one request, not streamed")


_GET_RESPONSE = inspect.signature(Model.get_response)


class _OneRequestProvider(ModelProvider):
    """The runner's model provider, its models wrapped by :class:`_OneRequest`."""

    def __init__(self, provider: ModelProvider, wrap: Callable[[Model], _OneRequest]) -> None:
        self.provider = provider
        self.wrap = wrap

    def get_model(self, model_name: str | None) -> Model:
        return self.wrap(self.provider.get_model(model_name))


def _get(item: Any, key: str) -> Any:
    return item.get(key) if isinstance(item, dict) else getattr(item, key, None)


__all__ = ["AgentPolicy", "UnsupportedResponse"]
