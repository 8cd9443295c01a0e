"""``runledger.integrations.openai_agents`` without a database, and without a network.

The flow's policy is driven turn by turn against a history built here the way the
executor builds it (each call's tool function run with a ToolContext, its result or
failure kept), and compared with a plain ``Runner.run`` of the same agent: a scripted
``Model`` records what each request carried.
"""

from __future__ import annotations

import copy
import inspect
import json
import os
import subprocess
import sys
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import pytest
from agents import (
    Agent,
    GuardrailFunctionOutput,
    ModelSettings,
    RunContextWrapper,
    Runner,
    WebSearchTool,
    default_tool_error_function,
    function_tool,
    input_guardrail,
    set_tracing_disabled,
)
from agents.agent_output import AgentOutputSchemaBase
from agents.exceptions import ModelBehaviorError, ModelRefusalError
from agents.handoffs import Handoff
from agents.items import ModelResponse, TResponseInputItem, TResponseOutputItem
from agents.models._retry_runtime import should_disable_provider_managed_retries
from agents.models.interface import Model, ModelTracing
from agents.tool import Tool
from agents.tool_context import ToolContext as SdkToolContext
from agents.usage import Usage
from openai.types.responses import (
    ResponseFunctionToolCall,
    ResponseOutputMessage,
    ResponseOutputRefusal,
    ResponseOutputText,
    ResponseReasoningItem,
)
from openai.types.responses.response_reasoning_item import Summary
from pydantic import BaseModel

from runledger.flows import (
    Decision,
    Flow,
    HistoryCall,
    HistoryTurn,
    InvalidDecision,
    NotApplied,
    PolicyContext,
    ToolContext,
    invoke,
    tool_context,
)
from runledger.integrations.openai import InvalidToolArguments
from runledger.integrations.openai_agents import (
    ToolCallFailed,
    UnsupportedResponse,
    agent_flow,
    record_to_response,
    response_to_record,
)
from runledger.model import Safety

os.environ.setdefault("OPENAI_API_KEY", "sk-test-not-used")  # nothing here reaches OpenAI
set_tracing_disabled(True)

SAFETY = {
    "lookup_order": "read_only",
    "create_ticket": "idempotent",
    "charge": "lookup",
    "send_email": "unsafe",
}


# -- a scripted model --------------------------------------------------------------------


@dataclass
class Request:
    """What one ``get_response`` carried."""

    instructions: str | None
    input: list[Any]
    settings: ModelSettings
    tools: list[str]
    schema: str | None
    tracing: ModelTracing
    retries_off: bool


class Scripted(Model):
    """Answers request ``n`` with ``outputs[n]`` and keeps a copy of every request."""

    def __init__(self, outputs: Sequence[list[TResponseOutputItem]] = ()) -> None:
        self.outputs = list(outputs)
        self.seen: list[Request] = []

    async def get_response(
        self,
        system_instructions: str | None,
        input: str | list[TResponseInputItem],
        model_settings: ModelSettings,
        tools: list[Tool],
        output_schema: AgentOutputSchemaBase | None,
        handoffs: list[Handoff],
        tracing: ModelTracing,
        *,
        previous_response_id: str | None,
        conversation_id: str | None,
        prompt: Any,
    ) -> ModelResponse:
        assert isinstance(input, list)
        self.seen.append(
            Request(
                instructions=system_instructions,
                input=copy.deepcopy(input),
                settings=model_settings,
                tools=[t.name for t in tools],
                schema=output_schema.name() if output_schema else None,
                tracing=tracing,
                retries_off=should_disable_provider_managed_retries(),
            )
        )
        output = self.outputs[len(self.seen) - 1]
        usage = Usage(requests=1, input_tokens=10, output_tokens=5, total_tokens=15)
        return ModelResponse(
            output=copy.deepcopy(output), usage=usage, response_id=f"resp_{len(self.seen)}"
        )

    def stream_response(self, *args: Any, **kwargs: Any) -> Any:
        raise NotImplementedError("not streamed")


def text(value: str, id: str = "msg_1") -> ResponseOutputMessage:
    content = [ResponseOutputText(type="output_text", text=value, annotations=[])]
    return ResponseOutputMessage(
        id=id, type="message", role="assistant", status="completed", content=content
    )


def call(name: str, args: Any, call_id: str, id: str | None = None) -> ResponseFunctionToolCall:
    arguments = args if isinstance(args, str) else json.dumps(args)
    if id is None:
        return ResponseFunctionToolCall(
            type="function_call", name=name, arguments=arguments, call_id=call_id
        )
    return ResponseFunctionToolCall(
        type="function_call", name=name, arguments=arguments, call_id=call_id, id=id
    )


def reasoning(id: str) -> ResponseReasoningItem:
    return ResponseReasoningItem(
        id=id,
        type="reasoning",
        summary=[Summary(type="summary_text", text="the order first")],
        encrypted_content="gAAAA-encrypted==",
    )


# -- the agent ---------------------------------------------------------------------------


@dataclass
class Shop:
    prefix: str
    keys: list[str | None] = field(default_factory=list)
    tool_call_ids: list[str] = field(default_factory=list)


def find_charge(ctx: ToolContext) -> dict[str, Any] | None:
    return None


def build_agent(model: Model, **kw: Any) -> Agent[Shop]:
    @function_tool
    def lookup_order(order_id: str) -> dict[str, Any]:
        """Look an order up."""
        return {"order_id": order_id, "total": 30}

    @function_tool
    def create_ticket(ctx: RunContextWrapper[Shop], subject: str) -> str:
        """Open a ticket."""
        try:
            ctx.context.keys.append(tool_context().idempotency_key)
        except LookupError:  # a plain Runner.run
            ctx.context.keys.append(None)
        assert isinstance(ctx, SdkToolContext)
        ctx.context.tool_call_ids.append(ctx.tool_call_id)
        return f"{ctx.context.prefix}-{subject}"

    @function_tool
    async def charge(amount: int) -> dict[str, Any]:
        """Charge the customer."""
        return {"charged": amount}

    @function_tool
    def send_email(to: str) -> str:
        """Send an email."""
        if to.endswith(".invalid"):
            raise NotApplied("the mail server refused the domain")
        return "sent"

    def instructions(ctx: RunContextWrapper[Shop], agent: Agent[Shop]) -> str:
        return f"Help the customer. Tickets are prefixed {ctx.context.prefix}."

    return Agent(
        name="support",
        instructions=instructions,
        model=model,
        tools=[lookup_order, create_ticket, charge, send_email],
        model_settings=ModelSettings(tool_choice="required", temperature=0.2),
        **kw,
    )


def three_turns() -> list[list[TResponseOutputItem]]:
    return [
        [
            reasoning("rs_1"),
            text("Looking."),
            call("lookup_order", {"order_id": "o-1"}, "call_a", id="fc_1"),
            call("send_email", {"to": 5}, "call_b"),  # fails validation: a str is expected
            call("create_ticket", {"subject": "refund"}, "call_c"),
        ],
        [
            call("charge", {"amount": 30}, "call_d"),
            call("send_email", {"to": "bob@example.com"}, "call_e"),
            call("send_email", {"to": "x@y.invalid"}, "call_f"),  # NotApplied
        ],
        [text("Done: T-refund.", id="msg_2")],
    ]


@dataclass
class Driven:
    decisions: list[Decision]
    history: list[HistoryTurn]
    output: Any


async def drive(
    flow: Flow,
    run_input: dict[str, Any],
    *,
    run_id: str = "run-1",
    max_turns: int = 10,
    fail: Callable[[int, str], dict[str, Any] | None] = lambda turn, call_id: None,
) -> Driven:
    """The executor's loop without a database: decide, normalise, run each call's tool
    with its ToolContext, keep the outcome as the journal would (an exception as the
    failure of a read_only tool whose attempts are spent). ``fail(turn, call_id)``
    returning an error dict records the call as failed with it, without running it."""
    assert flow.policy_fn is not None
    history: list[HistoryTurn] = []
    decisions: list[Decision] = []
    for turn in range(max_turns):
        ctx = PolicyContext(run_id=run_id, flow=flow.ref, input=run_input, turn=turn)
        decision = await invoke(flow.policy_fn, (ctx, tuple(history)), timeout=10)
        assert isinstance(decision, Decision)
        decisions.append(decision)
        payload = flow.normalize(decision).calls  # the ids the executor records
        if not payload:
            return Driven(decisions, history, decision.output)
        calls = []
        for spec, decided in zip(payload, decision.calls, strict=True):
            status, result, error = "succeeded", None, fail(turn, spec["call_id"])
            if error is not None:
                status = "failed"
            else:
                tctx = ToolContext(
                    run_id=run_id,
                    flow=flow.ref,
                    turn=turn,
                    call_id=spec["call_id"],
                    tool=spec["tool"],
                    idempotency_key=f"{run_id}:{turn}:{spec['call_id']}",
                    fencing_token=1,
                    attempt=1,
                    lease_deadline=lambda: 1e12,
                )
                tool = flow.tools[spec["tool"]]
                try:
                    result = await invoke(tool.fn, (tctx,), spec["args"], timeout=10)
                except NotApplied as na:
                    status, error = "failed", {"reason": na.reason, "not_applied": True}
                except Exception as exc:
                    status, error = "failed", {"type": type(exc).__name__, "message": str(exc)}
            calls.append(
                HistoryCall(
                    call_id=spec["call_id"],
                    tool=spec["tool"],
                    args=spec["args"],
                    status=status,
                    result=result,
                    error=error,
                    provider_id=decided.provider_id,
                )
            )
        history.append(HistoryTurn(turn=turn, calls=tuple(calls), record=decision.record))
    raise AssertionError("the flow did not end")


def make_flow(agent: Agent[Shop], shop: Shop, **kw: Any) -> Flow:
    return agent_flow(
        agent,
        name="support",
        version="1",
        safety=kw.pop("safety", SAFETY),
        lookups=kw.pop("lookups", {"charge": find_charge}),
        context=lambda ctx: shop,
        **kw,
    )


def same_request(ours: Request, theirs: Request) -> None:
    assert ours.input == theirs.input
    assert ours.instructions == theirs.instructions
    assert ours.settings == theirs.settings
    assert (ours.tools, ours.schema) == (theirs.tools, theirs.schema)


# -- building the flow -------------------------------------------------------------------


def test_each_function_tool_becomes_a_runledger_tool_with_its_class() -> None:
    flow = make_flow(build_agent(Scripted()), Shop("T"))
    assert flow.ref == "support@1"
    assert {n: t.safety for n, t in flow.tools.items()} == {n: Safety(s) for n, s in SAFETY.items()}
    assert flow.tools["charge"].lookup_fn is find_charge
    assert flow.tools["create_ticket"].lookup_fn is None
    # a plain def stays a plain def (runledger waits for its thread); async stays async
    assert not inspect.iscoroutinefunction(flow.tools["lookup_order"].fn)
    assert inspect.iscoroutinefunction(flow.tools["charge"].fn)
    assert flow.tools["lookup_order"].__doc__ == "Look an order up."
    flow.validate()


def test_the_calls_of_one_response_run_in_parallel_as_under_runner_run() -> None:
    flow = make_flow(build_agent(Scripted()), Shop("T"))
    assert flow.parallel_calls is True
    assert all(flow.runs_in_parallel(name) for name in flow.tools)
    serial = make_flow(build_agent(Scripted()), Shop("T"), parallel_calls=False)
    assert not any(serial.runs_in_parallel(name) for name in serial.tools)


def test_a_tool_without_a_safety_class_is_refused_by_name() -> None:
    safety = {k: v for k, v in SAFETY.items() if k != "send_email"}
    with pytest.raises(ValueError, match="without a safety class: send_email"):
        make_flow(build_agent(Scripted()), Shop("T"), safety=safety)


def test_safety_and_lookups_must_name_agent_tools() -> None:
    agent = build_agent(Scripted())
    with pytest.raises(ValueError, match="does not have: refund"):
        make_flow(agent, Shop("T"), safety={**SAFETY, "refund": "unsafe"})
    with pytest.raises(ValueError, match="unknown safety class 'maybe'"):
        make_flow(agent, Shop("T"), safety={**SAFETY, "send_email": "maybe"})
    with pytest.raises(ValueError, match="'lookup' but has no @lookup"):
        make_flow(agent, Shop("T"), lookups={})
    with pytest.raises(TypeError, match="only lookup tools take a lookup"):
        make_flow(agent, Shop("T"), lookups={"charge": find_charge, "send_email": find_charge})
    with pytest.raises(ValueError, match="lookups names a tool the agent does not have: x"):
        make_flow(agent, Shop("T"), lookups={"charge": find_charge, "x": find_charge})


@input_guardrail
def no_guard(ctx: Any, agent: Any, input: Any) -> GuardrailFunctionOutput:
    return GuardrailFunctionOutput(output_info=None, tripwire_triggered=False)


@function_tool(needs_approval=True)
def approve_me() -> str:
    """Needs a human."""
    return "ok"


@pytest.mark.parametrize(
    ("kw", "message"),
    [
        ({"handoffs": [Agent(name="billing")]}, "agent support has handoffs: not supported"),
        ({"input_guardrails": [no_guard]}, "has input guardrails: not supported"),
        ({"tools": [WebSearchTool()]}, "is a WebSearchTool: only function tools"),
        ({"tools": [approve_me]}, "tool approve_me: needs approval: not supported"),
        ({"tools": [Agent(name="sub").as_tool("sub", "a sub-agent")]}, "an agent as a tool"),
        ({"tool_use_behavior": "stop_on_first_tool"}, "tool_use_behavior='stop_on_first_tool'"),
    ],
)
def test_what_a_journaled_turn_cannot_hold_is_refused_when_the_flow_is_built(
    kw: dict[str, Any], message: str
) -> None:
    agent: Agent[Any] = Agent(name="support", model=Scripted(), **kw)
    with pytest.raises(ValueError, match=message):
        agent_flow(agent, name="support", safety={"sub": "unsafe", "approve_me": "unsafe"})


def test_an_mcp_server_that_is_not_one_is_refused() -> None:
    # MCP servers are supported (tests/integration/test_mcp_tools.py, with a real server)
    agent: Agent[Any] = Agent(name="support", model=Scripted())
    agent.mcp_servers = [object()]  # type: ignore[list-item]  # never contacted
    with pytest.raises(TypeError, match=r"mcp_servers\[0\] is a object, not an agents.mcp"):
        agent_flow(agent, name="support", safety={})


# -- records -----------------------------------------------------------------------------


def test_a_model_response_survives_the_record_round_trip() -> None:
    response = ModelResponse(
        output=[reasoning("rs_1"), text("Looking."), call("charge", {"amount": 3}, "call_1")],
        usage=Usage(requests=1, input_tokens=12, output_tokens=7, total_tokens=19),
        response_id="resp_1",
        request_id="req_1",
    )
    record = response_to_record(response)
    stored = json.loads(json.dumps(record))  # what a jsonb column gives back
    assert stored == record
    back = record_to_response(stored)
    assert back.output == response.output
    assert (back.usage, back.response_id, back.request_id) == (response.usage, "resp_1", "req_1")
    assert back.to_input_items() == response.to_input_items()
    with pytest.raises(ValueError, match="no record"):
        record_to_response(None)
    with pytest.raises(ValueError, match="not an Agents SDK model response"):
        record_to_response({"role": "assistant", "content": []})


# -- what the model sees -----------------------------------------------------------------


async def test_the_model_sees_what_a_plain_runner_run_sends() -> None:
    plain = Scripted(three_turns())
    plain_shop = Shop("T")
    result = await Runner.run(build_agent(plain), "Refund order o-1", context=plain_shop)
    assert result.final_output == "Done: T-refund."

    journaled = Scripted(three_turns())
    shop = Shop("T")
    flow = make_flow(build_agent(journaled), shop)
    driven = await drive(flow, {"prompt": "Refund order o-1"})

    assert len(plain.seen) == len(journaled.seen) == 3  # one request per turn, none twice
    for ours, theirs in zip(journaled.seen, plain.seen, strict=True):
        same_request(ours, theirs)
    assert driven.output == result.final_output
    # tool_choice is reset after the first tool use, as Runner.run does
    assert [r.settings.tool_choice for r in journaled.seen] == ["required", None, None]
    # the tool got the runledger key, and the key as its SDK tool_call_id
    assert shop.keys == ["run-1:0:c2"] and shop.tool_call_ids == ["run-1:0:c2"]
    assert plain_shop.keys == [None] and plain_shop.tool_call_ids == ["call_c"]
    # each result and each failure is what Runner.run sent: the installed SDK's own
    # default failure message for the two failed calls, whatever its wording
    outputs = {i["call_id"]: i["output"] for i in journaled.seen[2].input if "output" in i}
    assert outputs == {i["call_id"]: i["output"] for i in plain.seen[2].input if "output" in i}
    failed = default_tool_error_function(RunContextWrapper(context=None), RuntimeError("x"))
    assert outputs == {
        "call_a": "{'order_id': 'o-1', 'total': 30}",  # str() of the return value, as the SDK
        "call_b": failed,
        "call_c": "T-refund",
        "call_d": "{'charged': 30}",
        "call_e": "sent",
        "call_f": failed,
    }
    assert all(r.retries_off and r.tracing is ModelTracing.DISABLED for r in journaled.seen)


async def test_a_decision_carries_calls_provider_ids_record_and_output() -> None:
    flow = make_flow(build_agent(Scripted(three_turns())), Shop("T"))
    driven = await drive(flow, {"prompt": "Refund order o-1"})
    first, second, last = driven.decisions
    assert [(c.tool, c.args, c.call_id, c.provider_id) for c in first.calls] == [
        ("lookup_order", {"order_id": "o-1"}, None, "call_a"),
        ("send_email", {"to": 5}, None, "call_b"),
        ("create_ticket", {"subject": "refund"}, None, "call_c"),
    ]
    assert [c.call_id for c in driven.history[1].calls] == ["c0", "c1", "c2"]
    for decision, output in zip(driven.decisions, three_turns(), strict=True):
        assert decision.record is not None
        assert record_to_response(decision.record).output == output
        assert decision.record["usage"]["input_tokens"] == 10
    assert [d.record and d.record["response_id"] for d in driven.decisions] == [
        "resp_1",
        "resp_2",
        "resp_3",
    ]
    assert first.output is None and second.output is None
    assert last.calls == () and last.output == "Done: T-refund."
    statuses = [[c.status for c in t.calls] for t in driven.history]
    assert statuses == [["succeeded", "failed", "succeeded"], ["succeeded"] * 2 + ["failed"]]
    # the journal keeps what the model was shown, and why the call failed
    bad = driven.history[0].calls[1]
    assert "Invalid JSON input for tool send_email" in json.loads(bad.error["reason"])["reason"]


async def test_repeated_model_ids_never_become_keys() -> None:
    def outputs() -> list[list[TResponseOutputItem]]:
        return [
            [call("create_ticket", {"subject": "a"}, "call_1")],
            [call("create_ticket", {"subject": "b"}, "call_1")],  # the model repeats its id
            [text("ok")],
        ]

    shop = Shop("T")
    first = await drive(make_flow(build_agent(Scripted(outputs())), shop), {"prompt": "go"})
    again = await drive(
        make_flow(build_agent(Scripted(outputs())), shop), {"prompt": "go"}, run_id="b"
    )
    assert [c.provider_id for d in first.decisions for c in d.calls] == ["call_1", "call_1"]
    assert shop.keys == ["run-1:0:c0", "run-1:1:c0", "b:0:c0", "b:1:c0"]
    assert first.output == again.output == "ok"


async def test_a_failure_reaches_the_model_through_the_tools_failure_function() -> None:
    def shown(ctx: RunContextWrapper[Any], error: Exception) -> str:
        return f"lookup failed: {error}"

    @function_tool(failure_error_function=shown)
    def lookup_order(order_id: str) -> str:
        """Look an order up."""
        raise RuntimeError(f"order service down for {order_id}")

    def outputs() -> list[list[TResponseOutputItem]]:
        return [[call("lookup_order", {"order_id": "o-1"}, "call_1")], [text("sorry")]]

    plain = Scripted(outputs())
    await Runner.run(Agent(name="a", model=plain, tools=[lookup_order]), "x")
    journaled = Scripted(outputs())
    agent: Agent[Any] = Agent(name="a", model=journaled, tools=[lookup_order])
    flow = agent_flow(agent, name="a", safety={"lookup_order": "read_only"})
    driven = await drive(flow, {"prompt": "x"})  # the exception: a spent read_only call
    same_request(journaled.seen[1], plain.seen[1])
    assert journaled.seen[1].input[-1]["output"] == "lookup failed: order service down for o-1"
    assert driven.history[0].calls[0].error == {
        "type": "RuntimeError",
        "message": "order service down for o-1",
    }


async def test_a_call_failed_by_runledger_is_shown_as_the_sdk_shows_a_failure() -> None:
    """A call runledger failed (a lookup that found nothing) reaches the model as a plain
    ``Runner.run`` shows a failure of the same tool: what the installed SDK sends."""
    plain = Scripted([[call("send_email", {"to": "a@b.invalid"}, "call_1")], [text("ok")]])
    await Runner.run(build_agent(plain), "x", context=Shop("T"))  # the tool raises
    script = Scripted([[call("send_email", {"to": "a@b"}, "call_1")], [text("ok")]])
    flow = make_flow(build_agent(script), Shop("T"))
    nothing = {"reason": "lookup found nothing", "attempts": 3}
    driven = await drive(flow, {"prompt": "x"}, fail=lambda turn, call_id: nothing)
    assert driven.history[0].calls[0].status == "failed"
    failed = default_tool_error_function(RunContextWrapper(context=None), RuntimeError())
    shown = {"call_id": "call_1", "output": failed, "type": "function_call_output"}
    assert plain.seen[1].input[-1] == shown  # what the plain run sent for its failed call
    assert script.seen[1].input[-1] == shown


GIVEN_UP = (
    "This tool call was given up by an operator: it may or may not have taken effect, "
    "so do not repeat it."
)


async def test_an_abandoned_call_is_shown_as_given_up_not_as_an_error_to_retry() -> None:
    """``runledger resolve KEY abandoned``: the email may have gone out. The SDK's failure
    message ("An error occurred while running the tool.") would have the model send it
    again, without the operator's note."""
    script = Scripted([[call("send_email", {"to": "a@b"}, "call_1")], [text("ok")]])
    flow = make_flow(build_agent(script), Shop("T"))
    abandoned = {"reason": "abandoned", "note": "called the customer"}
    driven = await drive(flow, {"prompt": "x"}, fail=lambda turn, call_id: abandoned)
    assert driven.history[0].calls[0].status == "failed"
    assert script.seen[1].input[-1] == {
        "call_id": "call_1",
        "output": f"{GIVEN_UP} The operator's note: called the customer",
        "type": "function_call_output",
    }


@pytest.mark.parametrize("failure_function", ["custom", None], ids=["custom", "none"])
async def test_an_abandoned_call_is_shown_as_given_up_whatever_the_failure_function(
    failure_function: str | None,
) -> None:
    def shown(ctx: RunContextWrapper[Any], error: Exception) -> str:
        return f"send failed: {error}"

    @function_tool(failure_error_function=shown if failure_function else None)
    def send_email(to: str) -> str:
        """Send an email."""
        return "sent"

    script = Scripted([[call("send_email", {"to": "a@b"}, "call_1")], [text("ok")]])
    agent: Agent[Any] = Agent(name="a", model=script, tools=[send_email])
    flow = agent_flow(agent, name="a", safety={"send_email": "unsafe"})
    driven = await drive(flow, {"prompt": "x"}, fail=lambda turn, call_id: {"reason": "abandoned"})
    assert driven.output == "ok"
    assert script.seen[1].input[-1]["output"] == GIVEN_UP


async def test_a_tool_without_a_failure_function_fails_the_run_as_runner_run_raises() -> None:
    @function_tool(failure_error_function=None)
    def lookup_order(order_id: str) -> str:
        """Look an order up."""
        raise RuntimeError("down")

    script = Scripted([[call("lookup_order", {"order_id": "o"}, "call_1")], [text("never")]])
    agent: Agent[Any] = Agent(name="a", model=script, tools=[lookup_order])
    flow = agent_flow(agent, name="a", safety={"lookup_order": "read_only"})
    with pytest.raises(ToolCallFailed, match="down") as raised:
        await drive(flow, {"prompt": "x"})
    assert raised.value.tool == "lookup_order"
    assert len(script.seen) == 1  # refused before a second request


class Refund(BaseModel):
    order_id: str
    amount: int


async def test_structured_output_is_the_runs_result() -> None:
    answer = [text('{"order_id": "o-1", "amount": 30}')]
    script = Scripted([answer])
    agent: Agent[Any] = Agent(name="refund", model=script, output_type=Refund)
    driven = await drive(agent_flow(agent, name="refund", safety={}), {"prompt": "x"})
    assert driven.output == {"order_id": "o-1", "amount": 30}
    assert driven.decisions[0].calls == ()
    assert script.seen[0].schema == "Refund"

    bad = Agent(name="refund", model=Scripted([[text("not json")]]), output_type=Refund)
    with pytest.raises(ModelBehaviorError, match="Invalid JSON"):
        await drive(agent_flow(bad, name="refund", safety={}), {"prompt": "x"})
    empty = Agent(name="refund", model=Scripted([[reasoning("rs")]]), output_type=Refund)
    with pytest.raises(UnsupportedResponse, match="no final output"):
        await drive(agent_flow(empty, name="refund", safety={}), {"prompt": "x"})


async def test_a_refusal_raises_as_runner_run_does() -> None:
    refusal = ResponseOutputMessage(
        id="msg_1",
        type="message",
        role="assistant",
        status="completed",
        content=[ResponseOutputRefusal(type="refusal", refusal="I cannot help with that.")],
    )
    agent: Agent[Any] = Agent(name="a", model=Scripted([[refusal]]))
    with pytest.raises(ModelRefusalError, match="cannot help"):
        await drive(agent_flow(agent, name="a", safety={}), {"prompt": "x"})


async def test_unknown_tools_and_unusable_arguments_are_invalid_decisions() -> None:
    unknown = Scripted([[call("lookup_order", {"order_id": "o"}, "c1"), call("nope", {}, "c2")]])
    with pytest.raises(InvalidDecision, match="unknown tool 'nope'"):
        await drive(make_flow(build_agent(unknown), Shop("T")), {"prompt": "x"})
    garbled = Scripted([[call("lookup_order", '{"order_id": ', "call_9")]])
    with pytest.raises(InvalidToolArguments, match="call_9") as raised:
        await drive(make_flow(build_agent(garbled), Shop("T")), {"prompt": "x"})
    assert raised.value.arguments == '{"order_id": '


async def test_a_prompt_of_input_items_is_passed_as_runner_run_takes_it() -> None:
    items = [{"role": "user", "content": "Refund o-1"}, {"role": "user", "content": "Quickly."}]
    script = Scripted([[text("ok")]])
    agent: Agent[Any] = Agent(name="a", model=script, instructions="Be brief.")
    flow = agent_flow(agent, name="a", safety={}, prompt=lambda ctx: ctx.input["items"])
    assert (await drive(flow, {"items": items})).output == "ok"
    assert script.seen[0].input == items
    assert script.seen[0].instructions == "Be brief."
    with pytest.raises(ValueError, match="no 'prompt'"):
        await drive(agent_flow(agent, name="a", safety={}), {})


def test_runledger_imports_without_the_agents_sdk() -> None:
    code = (
        "import sys\n"
        "class Block:\n"
        "    def find_spec(self, name, path=None, target=None):\n"
        "        if name.split('.')[0] == 'agents':\n"
        "            raise ImportError('blocked ' + name)\n"
        "sys.meta_path.insert(0, Block())\n"
        "import runledger, runledger.integrations, runledger.flows, runledger.worker\n"
        "try:\n"
        "    import runledger.integrations.openai_agents\n"
        "except ImportError as exc:\n"
        "    print('refused', exc)\n"
    )
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stderr
    assert done.stdout.startswith("refused blocked agents")


async def test_a_disabled_tool_is_not_offered_and_a_call_of_it_is_refused() -> None:
    @function_tool(is_enabled=lambda ctx, agent: ctx.context.prefix != "T")
    def lookup_order(order_id: str) -> str:
        """Look an order up."""
        return "never"

    script = Scripted([[call("lookup_order", {"order_id": "o"}, "call_1")]])
    agent: Agent[Shop] = Agent(name="a", model=script, tools=[lookup_order])
    flow = agent_flow(
        agent, name="a", safety={"lookup_order": "read_only"}, context=lambda ctx: Shop("T")
    )
    with pytest.raises(InvalidDecision, match="'lookup_order' is not enabled"):
        await drive(flow, {"prompt": "x"})
    assert script.seen[0].tools == []


class CachingModel(Scripted):
    def _supports_default_prompt_cache_key(self) -> bool:  # as the SDK's OpenAI models
        return True


async def test_the_prompt_cache_key_is_one_per_run_whichever_worker_asks() -> None:
    keys = []
    for run_id in ("run-1", "run-1", "run-2"):
        script = CachingModel([[text("ok")]])
        agent: Agent[Any] = Agent(name="a", model=script)
        await drive(agent_flow(agent, name="a", safety={}), {"prompt": "x"}, run_id=run_id)
        extra = script.seen[0].settings.extra_args or {}
        keys.append(extra["prompt_cache_key"])
    assert keys[0] == keys[1] != keys[2]
    assert keys[0].startswith("agents-sdk:run:")
