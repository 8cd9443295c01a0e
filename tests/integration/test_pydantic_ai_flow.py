"""A Pydantic AI agent built with ``agent_flow``, run by an in-process worker on a real
database: one journaled decision per model request, the provider's response verbatim in
``run_turns.record``, one effect per key, the agent's output as the run's result, and
after a worker restart the recorded turn is not asked again and the tools' results come
from the journal."""

from __future__ import annotations

import copy
import threading
import uuid
from collections import Counter
from collections.abc import Sequence
from typing import Any

import pytest
from pydantic_ai import Agent, ModelRetry
from pydantic_ai.messages import (
    ModelMessage,
    ModelRequest,
    ModelResponse,
    TextPart,
    ToolCallPart,
    ToolReturnPart,
)
from pydantic_ai.models import Model, ModelRequestParameters
from pydantic_ai.models.function import AgentInfo, FunctionModel
from pydantic_ai.models.wrapper import WrapperModel
from pydantic_ai.settings import ModelSettings

from runledger import tool_context
from runledger.flows import Flow, ToolContext
from runledger.integrations.pydantic_ai import agent_flow, response_to_record
from tests.integration.conftest import Db, StartWorker, eventually

pytestmark = pytest.mark.timeout(60)


class Recording(WrapperModel):
    """Every request's messages and every response, as the agent's model saw them."""

    def __init__(self, wrapped: Model) -> None:
        super().__init__(wrapped)
        self.requests: list[list[ModelMessage]] = []
        self.responses: list[ModelResponse] = []
        self.lock = threading.Lock()

    async def request(
        self,
        messages: list[ModelMessage],
        model_settings: ModelSettings | None,
        model_request_parameters: ModelRequestParameters,
    ) -> ModelResponse:
        with self.lock:
            self.requests.append(copy.deepcopy(messages))
        response = await super().request(messages, model_settings, model_request_parameters)
        with self.lock:
            self.responses.append(response)
        return response


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


def responses() -> list[ModelResponse]:
    return [
        ModelResponse(
            parts=[
                TextPart("Opening a ticket and charging."),
                ToolCallPart("create_ticket", {"subject": "refund"}, tool_call_id="toolu_1"),
                ToolCallPart("charge", {"amount": 30}, tool_call_id="toolu_2"),
            ]
        ),
        ModelResponse(
            parts=[
                ToolCallPart("send_email", {"to": "bob"}, tool_call_id="toolu_3"),  # ModelRetry
                ToolCallPart("create_ticket", {"subject": "follow-up"}, tool_call_id="toolu_4"),
            ]
        ),
        ModelResponse(parts=[TextPart("Refunded; tickets open.")]),
    ]


def build(
    provider: Provider, gate: threading.Event | None = None
) -> tuple[Flow, Recording, threading.Event]:
    script = responses()

    def answer(messages: list[ModelMessage], info: AgentInfo) -> ModelResponse:
        # the n-th request is the n-th model response so far plus one
        n = sum(isinstance(m, ModelResponse) for m in messages)
        return copy.deepcopy(script[n])

    model = Recording(FunctionModel(answer))
    agent: Agent[None, str] = Agent(model, instructions="Help the customer.")
    charging = threading.Event()

    @agent.tool_plain
    def create_ticket(subject: str) -> str:
        return provider.apply(f"ticket:{subject}")

    @agent.tool_plain
    def charge(amount: int) -> str:
        charging.set()
        if gate is not None:
            assert gate.wait(10), "the test never opened the gate"
        return provider.apply(f"charge:{amount}")

    @agent.tool_plain
    def send_email(to: str) -> str:
        if "@" not in to:
            raise ModelRetry(f"{to!r} is not an email address")
        return provider.apply(f"email:{to}")

    flow = agent_flow(
        agent,
        name="support",
        version="1",
        safety={"create_ticket": "idempotent", "charge": "lookup", "send_email": "unsafe"},
        lookups={"charge": provider.find},
    )
    return flow, model, charging


def tool_returns(messages: Sequence[ModelMessage]) -> dict[str, Any]:
    """``tool_call_id -> content`` of every tool return the model was sent."""
    return {
        p.tool_call_id: p.content
        for m in messages
        if isinstance(m, ModelRequest)
        for p in m.parts
        if isinstance(p, ToolReturnPart)
    }


async def test_each_model_request_is_one_journaled_turn(db: Db, start_worker: StartWorker) -> None:
    provider = Provider()
    flow, model, _ = build(provider)
    await db.submit("support-1", flow, {"prompt": "Refund order o-1"})
    await start_worker(flow)
    run = await db.wait_status("support-1", "succeeded", "failed", "paused")

    assert (run["status"], run["result"]) == ("succeeded", "Refunded; tickets open.")
    turns = await db.turns("support-1")
    assert len(turns) == len(model.requests) == len(model.responses) == 3
    for turn, response in zip(turns, model.responses, strict=True):
        assert turn["record"] is not None
        assert turn["record"] == response_to_record(response)
    assert [t["output"] for t in turns] == [None, None, "Refunded; tickets open."]

    calls = await db.calls("support-1")
    assert [(c["turn"], c["call_id"], c["tool"], c["status"]) for c in calls] == [
        (0, "c0", "create_ticket", "succeeded"),
        (0, "c1", "charge", "succeeded"),
        (1, "c0", "send_email", "failed"),
        (1, "c1", "create_ticket", "succeeded"),
    ]
    assert [c["provider_id"] for c in calls] == ["toolu_1", "toolu_2", "toolu_3", "toolu_4"]
    keys = [c["idempotency_key"] for c in calls]
    assert keys == ["support-1:0:c0", "support-1:0:c1", "support-1:1:c0", "support-1:1:c1"]
    assert provider.effects == Counter({k: 1 for k in keys if k != "support-1:1:c0"})
    # the model was sent each result as the journal holds it, under the provider's id
    sent = tool_returns(model.requests[-1])
    for c in calls:
        if c["status"] == "succeeded":
            assert sent[c["provider_id"]] == c["result"] == provider.results[c["idempotency_key"]]
    assert sent["toolu_3"] == "'bob' is not an email address"


async def test_after_a_restart_the_recorded_turn_is_not_asked_again(
    db: Db, start_worker: StartWorker
) -> None:
    provider = Provider()
    gate = threading.Event()
    flow, first_model, charging = build(provider, gate)
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
    flow2, second_model, _ = build(provider)
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
    # and the results of turn 0's tools were read from the journal, not run again
    assert {k: v for k, v in tool_returns(second_model.requests[0]).items()} == results
    assert provider.sent["support-2:0:c0"] == provider.sent["support-2:0:c1"] == 1
    assert all(n == 1 for n in provider.effects.values())
    assert len(provider.effects) == 3  # two tickets and one charge
