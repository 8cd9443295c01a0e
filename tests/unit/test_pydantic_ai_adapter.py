"""``runledger.integrations.pydantic_ai`` without a database.

The flow's policy is driven turn by turn against a history built here the way the
executor builds it (each call's tool function run with a ToolContext, its result or
NotApplied reason kept), and compared with a plain ``agent.run`` of the same agent.
"""

from __future__ import annotations

import copy
import json
import subprocess
import sys
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import pytest
from pydantic import BaseModel
from pydantic_ai import Agent, ModelRetry, RunContext, ToolFailed
from pydantic_ai.exceptions import UnexpectedModelBehavior
from pydantic_ai.messages import (
    ModelMessage,
    ModelMessagesTypeAdapter,
    ModelRequest,
    ModelResponse,
    TextPart,
    ThinkingPart,
    ToolCallPart,
    ToolReturnPart,
)
from pydantic_ai.models.function import AgentInfo, FunctionModel
from pydantic_ai.models.test import TestModel
from pydantic_ai.usage import RequestUsage

from runledger.flows import (
    Decision,
    Flow,
    HistoryCall,
    HistoryTurn,
    NotApplied,
    PolicyContext,
    ToolContext,
    invoke,
    tool_context,
)
from runledger.integrations.pydantic_ai import (
    UnsupportedResponse,
    agent_flow,
    record_to_response,
    response_to_record,
)
from runledger.model import Safety

SAFETY = {
    "lookup_order": "read_only",
    "create_ticket": "idempotent",
    "charge": "lookup",
    "send_email": "unsafe",
}


@dataclass
class Deps:
    prefix: str
    keys: list[str | None] = field(default_factory=list)


def find_charge(ctx: ToolContext) -> dict[str, Any] | None:
    return None


def build_agent(model: Any) -> Agent[Deps, str]:
    agent: Agent[Deps, str] = Agent(
        model,
        deps_type=Deps,
        system_prompt="You are the support desk.",
        instructions="Use the tools; be brief.",
    )

    @agent.system_prompt
    def customer(ctx: RunContext[Deps]) -> str:
        return f"Tickets are prefixed {ctx.deps.prefix}."

    @agent.tool_plain
    def lookup_order(order_id: str) -> dict[str, Any]:
        """Look an order up."""
        return {"order_id": order_id, "total": 30}

    @agent.tool
    def create_ticket(ctx: RunContext[Deps], subject: str) -> str:
        """Open a ticket."""
        try:
            ctx.deps.keys.append(tool_context().idempotency_key)
        except LookupError:  # a plain agent.run
            ctx.deps.keys.append(None)
        return f"{ctx.deps.prefix}-{subject}"

    @agent.tool_plain
    async def charge(amount: int) -> dict[str, Any]:
        """Charge the customer."""
        return {"charged": amount}

    @agent.tool_plain
    def send_email(to: str) -> str:
        """Send an email."""
        if "@" not in to:
            raise ModelRetry(f"{to!r} is not an email address")
        if to.endswith(".invalid"):
            raise ToolFailed("the mail server refused the domain")
        return "sent"

    return agent


class Script:
    """A FunctionModel's function: answers request ``n`` with ``responses[n]`` and keeps
    a copy of the messages of every request."""

    def __init__(self, responses: Sequence[ModelResponse]) -> None:
        self.responses = list(responses)
        self.seen: list[list[ModelMessage]] = []

    def __call__(self, messages: list[ModelMessage], info: AgentInfo) -> ModelResponse:
        self.seen.append(copy.deepcopy(messages))
        return copy.deepcopy(self.responses[len(self.seen) - 1])


def three_turns() -> list[ModelResponse]:
    return [
        ModelResponse(
            parts=[
                ThinkingPart("the order first", signature="sig-1", provider_name="anthropic"),
                TextPart("Looking."),
                ToolCallPart("lookup_order", {"order_id": "o-1"}, tool_call_id="toolu_a"),
                ToolCallPart("send_email", {"to": "bob"}, tool_call_id="toolu_b"),  # ModelRetry
                ToolCallPart("create_ticket", {"subject": 5}, tool_call_id="toolu_c"),  # invalid
            ]
        ),
        ModelResponse(
            parts=[
                ToolCallPart("send_email", '{"to": "bob@example.com"}', tool_call_id="toolu_d"),
                ToolCallPart("create_ticket", {"subject": "refund"}, tool_call_id="toolu_e"),
                ToolCallPart("charge", {"amount": 30}, tool_call_id="toolu_f"),
                ToolCallPart("send_email", {"to": "x@y.invalid"}, tool_call_id="toolu_g"),
            ]
        ),
        ModelResponse(parts=[TextPart("Done: T-refund.")]),
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
    with its ToolContext, keep the outcome as the journal would. ``fail(turn, call_id)``
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


# timestamps, durations and the ids pydantic-ai mints for each run differ between two runs
# (a response's duration and request_timestamp: pydantic-ai-slim 2.78)
VOLATILE = {"timestamp", "request_timestamp", "duration", "run_id", "conversation_id"}


def comparable(messages: Sequence[ModelMessage]) -> Any:
    def strip(value: Any) -> Any:
        if isinstance(value, dict):
            return {k: strip(v) for k, v in value.items() if k not in VOLATILE}
        if isinstance(value, list):
            return [strip(v) for v in value]
        return value

    return strip(ModelMessagesTypeAdapter.dump_python(list(messages), mode="json"))


def make_flow(agent: Agent[Deps, Any], deps: Deps, **kw: Any) -> Flow:
    return agent_flow(
        agent,
        name="support",
        version="1",
        safety=kw.pop("safety", SAFETY),
        lookups=kw.pop("lookups", {"charge": find_charge}),
        deps=lambda ctx: deps,
        **kw,
    )


# -- building the flow -------------------------------------------------------------------


def test_each_agent_tool_becomes_a_runledger_tool_with_its_class() -> None:
    flow = make_flow(build_agent(TestModel()), Deps("T"))
    assert flow.ref == "support@1"
    assert {n: t.safety for n, t in flow.tools.items()} == {n: Safety(s) for n, s in SAFETY.items()}
    assert flow.tools["charge"].lookup_fn is find_charge
    assert flow.tools["create_ticket"].lookup_fn is None
    assert flow.policy_fn is not None
    flow.validate()


def test_a_tool_without_a_safety_class_is_refused_by_name() -> None:
    safety = {k: v for k, v in SAFETY.items() if k != "send_email"}
    with pytest.raises(ValueError, match="without a safety class: send_email"):
        make_flow(build_agent(TestModel()), Deps("T"), safety=safety)


def test_safety_and_lookups_must_name_agent_tools() -> None:
    agent = build_agent(TestModel())
    with pytest.raises(ValueError, match="does not have: refund"):
        make_flow(agent, Deps("T"), safety={**SAFETY, "refund": "unsafe"})
    with pytest.raises(ValueError, match="unknown safety class 'maybe'"):
        make_flow(agent, Deps("T"), safety={**SAFETY, "send_email": "maybe"})
    with pytest.raises(ValueError, match="'lookup' but has no @lookup"):
        make_flow(agent, Deps("T"), lookups={})
    with pytest.raises(TypeError, match="only lookup tools take a lookup"):
        make_flow(agent, Deps("T"), lookups={"charge": find_charge, "send_email": find_charge})
    with pytest.raises(ValueError, match="lookups names a tool the agent does not have: x"):
        make_flow(agent, Deps("T"), lookups={"charge": find_charge, "x": find_charge})


# -- records ---------------------------------------------------------------------------


def test_a_model_response_survives_the_record_round_trip() -> None:
    response = ModelResponse(
        parts=[
            ThinkingPart("hmm", signature="sig==", id="rs_1", provider_name="openai"),
            TextPart("Looking."),
            ToolCallPart("lookup_order", {"order_id": "o-1"}, tool_call_id="toolu_1"),
            ToolCallPart("charge", '{"amount": 3}', tool_call_id="toolu_2"),
        ],
        usage=RequestUsage(input_tokens=12, output_tokens=7),
        model_name="claude-x",
        provider_name="anthropic",
        provider_response_id="msg_1",
        finish_reason="tool_call",
    )
    record = response_to_record(response)
    stored = json.loads(json.dumps(record))  # what a jsonb column gives back
    assert stored == record
    assert record_to_response(stored) == response
    with pytest.raises(ValueError, match="no record"):
        record_to_response(None)


# -- what the model sees ---------------------------------------------------------------


async def test_the_model_sees_what_a_plain_agent_run_sends() -> None:
    plain = Script(three_turns())
    plain_deps = Deps("T")
    result = await build_agent(FunctionModel(plain)).run("Refund order o-1", deps=plain_deps)
    assert result.output == "Done: T-refund."

    journaled = Script(three_turns())
    deps = Deps("T")
    flow = make_flow(build_agent(FunctionModel(journaled)), deps)
    driven = await drive(flow, {"prompt": "Refund order o-1"})

    assert len(plain.seen) == len(journaled.seen) == 3  # one request per turn, none twice
    for request, (ours, theirs) in enumerate(zip(journaled.seen, plain.seen, strict=True)):
        assert comparable(ours) == comparable(theirs), f"request {request}"
    assert driven.output == result.output
    # the tool got the runledger key; a plain run has none
    assert deps.keys == ["run-1:1:c1"]
    assert plain_deps.keys == [None]
    # the failures are what agent.run shows
    second = journaled.seen[1][-1]
    assert isinstance(second, ModelRequest)
    retried = [p for p in second.parts if isinstance(p, ToolReturnPart) and p.outcome == "retried"]
    assert [(p.tool_name, p.retry and p.retry.cause) for p in retried] == [
        ("send_email", "model_retry"),
        ("create_ticket", "validation_error"),
    ]
    third = journaled.seen[2][-1]
    assert isinstance(third, ModelRequest)
    assert [p.outcome for p in third.parts if isinstance(p, ToolReturnPart)] == [
        "success",
        "success",
        "success",
        "failed",
    ]


async def test_validation_errors_are_shown_as_the_installed_pydantic_ai_renders_them(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """What the model is shown for arguments that fail validation is made by Pydantic AI
    itself, never by a copy of its rules: here Pydantic AI is made to render the details
    its own way, and the journaled run shows them as the plain run does."""
    from pydantic_ai import messages

    rendered = messages._dump_error_details

    def marked(errors: Any) -> list[dict[str, Any]]:
        return [{**detail, "rendered_by": "pydantic_ai"} for detail in rendered(errors)]

    monkeypatch.setattr(messages, "_dump_error_details", marked)
    plain = Script(three_turns())
    await build_agent(FunctionModel(plain)).run("Refund order o-1", deps=Deps("T"))
    journaled = Script(three_turns())
    await drive(make_flow(build_agent(FunctionModel(journaled)), Deps("T")), {"prompt": "x"})

    def invalid(request: ModelMessage) -> ToolReturnPart:
        assert isinstance(request, ModelRequest)
        [part] = [p for p in request.parts if getattr(p, "tool_name", None) == "create_ticket"]
        assert isinstance(part, ToolReturnPart) and part.outcome == "retried"
        return part

    ours, theirs = invalid(journaled.seen[1][-1]), invalid(plain.seen[1][-1])
    assert ours.content == theirs.content
    assert [detail["rendered_by"] for detail in ours.content] == ["pydantic_ai"]


async def test_a_decision_carries_calls_provider_ids_record_and_output() -> None:
    flow = make_flow(build_agent(FunctionModel(Script(three_turns()))), Deps("T"))
    driven = await drive(flow, {"prompt": "Refund order o-1"})
    first, second, last = driven.decisions
    assert [(c.tool, c.args, c.call_id, c.provider_id) for c in first.calls] == [
        ("lookup_order", {"order_id": "o-1"}, None, "toolu_a"),
        ("send_email", {"to": "bob"}, None, "toolu_b"),
        ("create_ticket", {"subject": 5}, None, "toolu_c"),
    ]
    assert second.calls[0].args == {"to": "bob@example.com"}  # JSON-string args as a dict
    assert [c.call_id for c in driven.history[1].calls] == ["c0", "c1", "c2", "c3"]
    for decision, response in zip(driven.decisions, three_turns(), strict=True):
        assert decision.record is not None
        got = record_to_response(decision.record)
        assert got.parts == response.parts
    assert first.output is None and second.output is None
    assert last.calls == () and last.output == "Done: T-refund."
    statuses = [[c.status for c in t.calls] for t in driven.history]
    assert statuses == [
        ["succeeded", "failed", "failed"],
        ["succeeded", "succeeded", "succeeded", "failed"],
    ]


async def test_test_model_ids_repeat_but_call_ids_are_runledger_positions() -> None:
    deps = Deps("T")
    model = TestModel(call_tools=["lookup_order", "create_ticket", "charge"])
    flow = make_flow(build_agent(model), deps)
    first = await drive(flow, {"prompt": "go"}, run_id="a")
    again = await drive(flow, {"prompt": "go"}, run_id="b")
    provider = [c.provider_id for c in first.decisions[0].calls]
    assert provider == [
        "pyd_ai_tool_call_id__lookup_order",
        "pyd_ai_tool_call_id__create_ticket",
        "pyd_ai_tool_call_id__charge",
    ]
    assert provider == [c.provider_id for c in again.decisions[0].calls]  # TestModel repeats
    assert [c.call_id for c in first.history[0].calls] == ["c0", "c1", "c2"]
    assert deps.keys == ["a:0:c1", "b:0:c1"]  # keys from the run and position, never the ids
    assert first.output == again.output
    assert isinstance(first.output, str) and "lookup_order" in first.output


async def test_exhausting_a_tools_retries_fails_like_agent_run() -> None:
    def twice_bad() -> list[ModelResponse]:
        return [
            ModelResponse(parts=[ToolCallPart("send_email", {"to": "a"}, tool_call_id="t1")]),
            ModelResponse(parts=[ToolCallPart("send_email", {"to": "b"}, tool_call_id="t2")]),
            ModelResponse(parts=[TextPart("never")]),
        ]

    with pytest.raises(UnexpectedModelBehavior, match="exceeded max retries count of 1"):
        await build_agent(FunctionModel(Script(twice_bad()))).run("x", deps=Deps("T"))
    journaled = Script(twice_bad())
    flow = make_flow(build_agent(FunctionModel(journaled)), Deps("T"))
    with pytest.raises(UnexpectedModelBehavior, match="exceeded max retries count of 1"):
        await drive(flow, {"prompt": "x"})
    assert len(journaled.seen) == 2  # refused before a third request


async def test_a_success_resets_a_tools_retry_count_like_agent_run() -> None:
    def responses() -> list[ModelResponse]:
        return [
            ModelResponse(parts=[ToolCallPart("send_email", {"to": "a"}, tool_call_id="t1")]),
            ModelResponse(parts=[ToolCallPart("send_email", {"to": "a@b"}, tool_call_id="t2")]),
            ModelResponse(parts=[ToolCallPart("send_email", {"to": "c"}, tool_call_id="t3")]),
            ModelResponse(parts=[TextPart("ok")]),
        ]

    plain = Script(responses())
    assert (await build_agent(FunctionModel(plain)).run("x", deps=Deps("T"))).output == "ok"
    journaled = Script(responses())
    flow = make_flow(build_agent(FunctionModel(journaled)), Deps("T"))
    assert (await drive(flow, {"prompt": "x"})).output == "ok"
    assert comparable(journaled.seen[-1]) == comparable(plain.seen[-1])


async def shown_for_failure(error: dict[str, Any]) -> ToolReturnPart:
    """The part the model is sent for a send_email call recorded as failed with ``error``."""
    script = Script(
        [
            ModelResponse(parts=[ToolCallPart("send_email", {"to": "a@b"}, tool_call_id="t1")]),
            ModelResponse(parts=[TextPart("ok")]),
        ]
    )
    flow = make_flow(build_agent(FunctionModel(script)), Deps("T"))
    driven = await drive(flow, {"prompt": "x"}, fail=lambda turn, call_id: error)
    assert driven.history[0].calls[0].status == "failed"
    [part] = script.seen[1][-1].parts
    assert isinstance(part, ToolReturnPart)
    assert (part.outcome, part.tool_call_id) == ("failed", "t1")
    return part


async def test_a_call_failed_by_runledger_is_shown_as_a_failed_return() -> None:
    part = await shown_for_failure({"reason": "lookup found nothing", "attempts": 3})
    assert part.content.startswith("The tool call failed and did not take effect: ")
    assert "lookup found nothing" in part.content


async def test_an_abandoned_call_is_shown_as_given_up_with_the_operators_note() -> None:
    """``runledger resolve KEY abandoned``: the email may have gone out. The model must not
    be told it did not take effect (it would send it again)."""
    part = await shown_for_failure({"reason": "abandoned", "note": "called the customer"})
    assert part.content == (
        "This tool call was given up by an operator: it may or may not have taken effect, "
        "so do not repeat it. The operator's note: called the customer"
    )
    part = await shown_for_failure({"reason": "abandoned"})  # resolved without --note
    assert part.content == (
        "This tool call was given up by an operator: it may or may not have taken effect, "
        "so do not repeat it."
    )


class Refund(BaseModel):
    order_id: str
    amount: int


async def test_structured_output_is_the_runs_result() -> None:
    def model(messages: list[ModelMessage], info: AgentInfo) -> ModelResponse:
        [output_tool] = info.output_tools
        args = {"order_id": "o-1", "amount": 30}
        return ModelResponse(parts=[ToolCallPart(output_tool.name, args, tool_call_id="o")])

    agent: Agent[None, Refund] = Agent(FunctionModel(model), output_type=Refund)
    flow = agent_flow(agent, name="refund", safety={})
    driven = await drive(flow, {"prompt": "x"})
    assert driven.output == {"order_id": "o-1", "amount": 30}
    assert driven.decisions[0].calls == ()


async def test_a_response_pydantic_ai_would_retry_is_refused_after_one_request() -> None:
    script = Script([ModelResponse(parts=[ToolCallPart("no_such_tool", {}, tool_call_id="t")])])
    flow = make_flow(build_agent(FunctionModel(script)), Deps("T"))
    with pytest.raises(UnsupportedResponse, match="no_such_tool"):
        await drive(flow, {"prompt": "x"})
    assert len(script.seen) == 1


async def test_an_unknown_tool_beside_a_known_one_is_an_invalid_decision() -> None:
    from runledger.flows import InvalidDecision

    response = ModelResponse(
        parts=[
            ToolCallPart("lookup_order", {"order_id": "o"}, tool_call_id="t1"),
            ToolCallPart("no_such_tool", {}, tool_call_id="t2"),
        ]
    )
    flow = make_flow(build_agent(FunctionModel(Script([response]))), Deps("T"))
    with pytest.raises(InvalidDecision, match="no_such_tool"):
        await drive(flow, {"prompt": "x"})


def test_runledger_imports_without_pydantic_ai() -> None:
    code = (
        "import sys\n"
        "class Block:\n"
        "    def find_spec(self, name, path=None, target=None):\n"
        "        if name.split('.')[0] in ('pydantic_ai', 'pydantic_graph'):\n"
        "            raise ImportError('blocked ' + name)\n"
        "sys.meta_path.insert(0, Block())\n"
        "import runledger, runledger.integrations, runledger.flows, runledger.worker\n"
        "try:\n"
        "    import runledger.integrations.pydantic_ai\n"
        "except ImportError as exc:\n"
        "    print('refused', exc)\n"
    )
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stderr
    assert done.stdout.startswith("refused blocked pydantic_ai")


async def test_agent_override_of_the_model_is_used() -> None:
    def unreachable(messages: list[ModelMessage], info: AgentInfo) -> ModelResponse:
        raise AssertionError("the overridden model was asked")

    agent = build_agent(FunctionModel(unreachable))
    flow = make_flow(agent, Deps("T"))
    with agent.override(model=TestModel(call_tools=["lookup_order"])):
        driven = await drive(flow, {"prompt": "go"})
    assert [c.tool for c in driven.decisions[0].calls] == ["lookup_order"]
    assert driven.output == '{"lookup_order":{"order_id":"a","total":30}}'
