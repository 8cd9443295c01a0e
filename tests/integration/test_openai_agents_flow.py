"""An OpenAI Agents SDK agent built with ``agent_flow``, run by an in-process worker on a
real database, offline (a scripted ``Model``): one journaled decision per model request,
the response's output items in ``run_turns.record``, one effect per key, the agent's
output as the run's result; a failed call reaches the model as ``Runner.run`` shows it;
after a worker restart, or a retried call, a recorded turn is not asked again."""

from __future__ import annotations

import copy
import json
import os
import threading
import uuid
from collections import Counter
from typing import Any

import pytest
from agents import Agent, RunContextWrapper, default_tool_error_function, set_tracing_disabled
from agents.agent_output import AgentOutputSchemaBase
from agents.exceptions import ModelBehaviorError
from agents.handoffs import Handoff
from agents.items import ModelResponse, TResponseInputItem, TResponseOutputItem
from agents.model_settings import ModelSettings
from agents.models.interface import Model, ModelTracing
from agents.tool import Tool, function_tool
from agents.usage import Usage
from openai.types.responses import (
    ResponseFunctionToolCall,
    ResponseOutputMessage,
    ResponseOutputText,
)

from runledger import tool_context
from runledger.flows import Flow, ToolContext
from runledger.integrations.openai_agents import agent_flow, response_to_record
from tests.integration.conftest import Db, StartWorker, eventually

pytestmark = pytest.mark.timeout(60)

os.environ.setdefault("OPENAI_API_KEY", "sk-test-not-used")  # nothing here reaches OpenAI
set_tracing_disabled(True)


def sdk_failure(error: Exception) -> str:
    """What the installed SDK shows the model for a tool's ``error`` by default."""
    return str(default_tool_error_function(RunContextWrapper(context=None), error))


def text(value: str, id: str) -> ResponseOutputMessage:
    content = [ResponseOutputText(type="output_text", text=value, annotations=[])]
    return ResponseOutputMessage(
        id=id, type="message", role="assistant", status="completed", content=content
    )


def call(name: str, args: dict[str, Any], call_id: str) -> ResponseFunctionToolCall:
    return ResponseFunctionToolCall(
        type="function_call", name=name, arguments=json.dumps(args), call_id=call_id
    )


def script() -> list[list[TResponseOutputItem]]:
    """Every response opens with a message, so that a response's number is the count of
    assistant messages in its input, whichever worker asks."""
    return [
        [
            text("Opening a ticket and charging.", "msg_0"),
            call("create_ticket", {"subject": "refund"}, "call_1"),
            call("charge", {"amount": 30}, "call_2"),
        ],
        [
            text("Checking the order and writing.", "msg_1"),
            call("send_email", {"to": 5}, "call_3"),  # fails validation: to is a str
            call("lookup_order", {"order_id": "o-1"}, "call_4"),  # the order service is down
            call("create_ticket", {"subject": "follow-up"}, "call_5"),
        ],
        [text("Refunded; tickets open.", "msg_2")],
    ]


class Scripted(Model):
    """A scripted model: keeps every request's input and every response. ``fail_first``
    requests (counted from the first) raise, as a model that did not answer."""

    def __init__(self, fail_first: int = 0) -> None:
        self.script = script()
        self.requests: list[list[Any]] = []
        self.responses: list[ModelResponse] = []
        self.failures = fail_first
        self.lock = threading.Lock()

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
        assert system_instructions == "Help the customer."
        with self.lock:
            self.requests.append(copy.deepcopy(input))
            if self.failures:
                self.failures -= 1
                raise ConnectionError("the model did not answer")
        n = sum(1 for i in input if i.get("type") == "message" and i.get("role") == "assistant")
        usage = Usage(requests=1, input_tokens=10 * (n + 1), output_tokens=5, total_tokens=0)
        response = ModelResponse(
            output=copy.deepcopy(self.script[n]), usage=usage, response_id=f"resp_{uuid.uuid4()}"
        )
        with self.lock:
            self.responses.append(response)
        return response

    def stream_response(self, *args: Any, **kwargs: Any) -> Any:
        raise NotImplementedError("not streamed")


class Provider:
    """The outside world: one effect per idempotency key, however often it is sent."""

    def __init__(self) -> None:
        self.effects: Counter[str] = Counter()
        self.sent: Counter[str] = Counter()
        self.results: dict[str, str] = {}
        self.lock = threading.Lock()

    def apply(self, what: str) -> str:
        key = tool_context().idempotency_key
        with self.lock:
            self.sent[key] += 1
            if key not in self.results:  # deduplicates by key
                self.effects[key] += 1
                self.results[key] = f"{what}-{uuid.uuid4().hex[:8]}"  # unique per effect
            return self.results[key]

    def find(self, ctx: ToolContext) -> dict[str, Any] | None:
        with self.lock:
            found = self.results.get(ctx.idempotency_key)
        return None if found is None else {"id": found}


def build(
    provider: Provider,
    *,
    gate: threading.Event | None = None,
    drop_first_ticket_reply: bool = False,
    fail_first: int = 0,
) -> tuple[Flow, Scripted, threading.Event, Counter[str]]:
    model = Scripted(fail_first)
    charging = threading.Event()
    order_lookups: Counter[str] = Counter()
    dropped: list[str] = []

    @function_tool
    def create_ticket(subject: str) -> str:
        """Open a ticket."""
        result = provider.apply(f"ticket:{subject}")
        if drop_first_ticket_reply and not dropped:
            dropped.append(result)
            raise ConnectionError("the helpdesk's reply was lost")  # after the effect
        return result

    @function_tool
    def charge(amount: int) -> str:
        """Charge the customer."""
        charging.set()
        if gate is not None:
            assert gate.wait(10), "the test never opened the gate"
        return provider.apply(f"charge:{amount}")

    @function_tool
    def send_email(to: str) -> str:
        """Send an email."""
        return provider.apply(f"email:{to}")

    @function_tool
    async def lookup_order(order_id: str) -> str:
        """Look an order up."""
        order_lookups[tool_context().idempotency_key] += 1
        raise ConnectionError("the order service is down")

    agent: Agent[None] = Agent(
        name="support",
        instructions="Help the customer.",
        model=model,
        tools=[create_ticket, charge, send_email, lookup_order],
    )
    flow = agent_flow(
        agent,
        name="support",
        version="1",
        safety={
            "create_ticket": "idempotent",
            "charge": "lookup",
            "send_email": "unsafe",
            "lookup_order": "read_only",
        },
        lookups={"charge": provider.find},
    )
    return flow, model, charging, order_lookups


def outputs(items: list[Any]) -> dict[str, Any]:
    """``call_id -> output`` of every ``function_call_output`` the model was sent."""
    return {i["call_id"]: i["output"] for i in items if i.get("type") == "function_call_output"}


async def test_each_model_request_is_one_journaled_turn(db: Db, start_worker: StartWorker) -> None:
    provider = Provider()
    flow, model, _, lookups = build(provider)
    await db.submit("support-1", flow, {"prompt": "Refund order o-1"})
    await start_worker(flow)
    run = await db.wait_status("support-1", "succeeded", "failed", "paused")

    assert (run["status"], run["result"]) == ("succeeded", "Refunded; tickets open.")
    turns = await db.turns("support-1")
    assert len(turns) == len(model.requests) == len(model.responses) == 3
    for turn, response in zip(turns, model.responses, strict=True):
        assert turn["record"] == response_to_record(response)
    assert [t["output"] for t in turns] == [None, None, "Refunded; tickets open."]

    calls = await db.calls("support-1")
    assert [(c["turn"], c["call_id"], c["tool"], c["status"]) for c in calls] == [
        (0, "c0", "create_ticket", "succeeded"),
        (0, "c1", "charge", "succeeded"),
        (1, "c0", "send_email", "failed"),
        (1, "c1", "lookup_order", "failed"),
        (1, "c2", "create_ticket", "succeeded"),
    ]
    assert [c["provider_id"] for c in calls] == [f"call_{n}" for n in range(1, 6)]
    keys = [c["idempotency_key"] for c in calls]
    assert keys == [f"support-1:{c['turn']}:{c['call_id']}" for c in calls]
    ok = [c["idempotency_key"] for c in calls if c["status"] == "succeeded"]
    assert provider.effects == Counter(dict.fromkeys(ok, 1))  # the email was never sent
    # the read_only lookup was tried max_attempts times before it failed
    assert lookups == Counter({"support-1:1:c1": 3})
    assert calls[3]["attempts"] == 3
    assert calls[3]["error"] == {"type": "ConnectionError", "message": "the order service is down"}
    # the model was sent each result as the journal holds it, under its own call ids, and
    # each failure as Runner.run shows it
    sent = outputs(model.requests[-1])
    for c in calls:
        if c["status"] == "succeeded":
            assert sent[c["provider_id"]] == c["result"] == provider.results[c["idempotency_key"]]
    assert sent["call_3"] == sdk_failure(ModelBehaviorError("the arguments did not validate"))
    assert sent["call_4"] == sdk_failure(ConnectionError("the order service is down"))


async def test_after_a_restart_the_recorded_turn_is_not_asked_again(
    db: Db, start_worker: StartWorker
) -> None:
    provider = Provider()
    gate = threading.Event()
    flow, first_model, charging, _ = build(provider, gate=gate)
    await db.submit("support-2", flow, {"prompt": "Refund order o-1"})
    w1 = await start_worker(flow, worker_id="first", grace_seconds=10.0)
    try:
        await eventually(charging.is_set, what="turn 0's last tool running")
        w1.request_stop()  # drain: the call finishes, the lease is released
    finally:
        gate.set()
    await w1.stop()
    assert (await db.run("support-2"))["status"] == "queued"
    assert len(first_model.requests) == 1  # turn 0 only
    done = [c for c in await db.calls("support-2") if c["status"] == "succeeded"]
    assert len(done) == 2
    results = {c["provider_id"]: c["result"] for c in done}

    # a new worker process: new flow, new agent, new model object
    flow2, second_model, _, _ = build(provider)
    await start_worker(flow2, worker_id="second")
    run = await db.wait_status("support-2", "succeeded", "failed", "paused")
    assert (run["status"], run["result"]) == ("succeeded", "Refunded; tickets open.")

    # the second worker asked for turns 1 and 2 only: turn 0's decision came from the journal
    assert len(second_model.requests) == 2
    turns = await db.turns("support-2")
    assert turns[0]["record"] == response_to_record(first_model.responses[0])
    assert [t["record"] for t in turns[1:]] == [
        response_to_record(r) for r in second_model.responses
    ]
    # turn 0 is replayed from its record, and its tools' results come from the journal
    replayed = second_model.requests[0]
    assert [i.get("call_id") for i in replayed if i.get("type") == "function_call"] == [
        "call_1",
        "call_2",
    ]
    assert outputs(replayed) == results
    assert provider.sent["support-2:0:c0"] == provider.sent["support-2:0:c1"] == 1
    assert all(n == 1 for n in provider.effects.values())
    assert len(provider.effects) == 3  # two tickets and one charge


async def test_retries_are_runledgers_and_never_ask_a_recorded_turn_again(
    db: Db, start_worker: StartWorker
) -> None:
    """The first request fails (runledger asks again: the SDK makes one attempt), and the
    first ticket's reply is lost after its effect (runledger sends it again with the same
    key): one decision row per turn, one effect per key, no extra model request."""
    provider = Provider()
    flow, model, _, _ = build(provider, drop_first_ticket_reply=True, fail_first=1)
    await db.submit("support-3", flow, {"prompt": "Refund order o-1"})
    await start_worker(flow)
    run = await db.wait_status("support-3", "succeeded", "failed", "paused")
    assert (run["status"], run["result"]) == ("succeeded", "Refunded; tickets open.")

    assert len(model.requests) == 4  # the failed first request, then one per turn
    assert model.requests[0] == model.requests[1]  # asked again with the same input
    turns = await db.turns("support-3")
    assert [t["record"] for t in turns] == [response_to_record(r) for r in model.responses]
    [ticket] = [c for c in await db.calls("support-3") if c["idempotency_key"] == "support-3:0:c0"]
    assert (ticket["status"], ticket["attempts"]) == ("succeeded", 2)
    assert provider.sent["support-3:0:c0"] == 2
    assert provider.effects["support-3:0:c0"] == 1
    assert ticket["result"] == provider.results["support-3:0:c0"]
    assert outputs(model.requests[2])["call_1"] == ticket["result"]
