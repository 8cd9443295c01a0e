"""The ``scripted`` demo flow again, as a Pydantic AI agent: ``agent_flow(Agent(FunctionModel))``,
for the process tests of the adapter under crashes (``test_adapter_crashes.py``).

- **The tools** mirror the bare ``scripted`` flow's, one of every safety class, each
  talking to the gated fake provider with ``runledger.tool_context()``'s key: ``ticket``
  (idempotent: the provider deduplicates the key), ``charge`` (lookup: it does not, but
  can be asked), ``email`` (unsafe), ``read`` (read_only: no effect).
- **The model** replays ``input["plan"]`` as the bare policy does: request *n* (*n* the
  number of model responses in the messages it is sent) calls the tools of ``plan[n]``
  (``{"tool", "args", "id"}``; ``id`` is the model's own tool-call id, random when
  absent), and once the plan is done it answers with a text naming the tool returns it
  was sent. The run id and the plan reach it in the prompt.
- **Every model request is recorded at the provider** before the model answers: an
  effect of kind ``model_request`` under the key :func:`model_key` ``(run_id, turn)``
  (never deduplicated), so a test counts the requests of each turn from its own process.
  A worker started with ``ADAPTER_MODEL_GATE=<gate>`` holds every model request at that
  provider gate, so a test knows the worker is inside the request.

The flows differ by name only: ``lane_<i>`` (flow ``pai-lane-<i>``) lets a test steer
one run to one worker (``--flows tests.process.adapter_flows:lane_3``), since a worker
claims only runs of the flows it has. ``oa_flows.py`` is the same for the OpenAI Agents
SDK adapter, with these tools and helpers.
"""

from __future__ import annotations

import functools
import json
import os
from collections.abc import Callable
from typing import Any

from pydantic_ai import Agent
from pydantic_ai.messages import (
    ModelMessage,
    ModelRequest,
    ModelResponse,
    ModelResponsePart,
    TextPart,
    ToolCallPart,
    ToolReturnPart,
    UserPromptPart,
)
from pydantic_ai.models.function import AgentInfo, FunctionModel

from runledger import tool_context
from runledger.flows import Flow, PolicyContext, ToolContext
from runledger.integrations.pydantic_ai import agent_flow
from runledger.testing.provider import ProviderClient

PREFIX = "pai"  # of the flow names, and of the run ids of the tests
GATE_ENV = "ADAPTER_MODEL_GATE"
SAFETY = {"ticket": "idempotent", "charge": "lookup", "email": "unsafe", "read": "read_only"}


def model_key(run_id: str, turn: int) -> str:
    """The provider key under which the model requests of one turn are recorded."""
    return f"model:{run_id}:{turn}"


def provider() -> ProviderClient:
    return ProviderClient.from_env()


# -- the model ---------------------------------------------------------------------------


def prompt(ctx: PolicyContext) -> str:
    return json.dumps({"run_id": ctx.run_id, "plan": ctx.input.get("plan", [])})


def script(messages: list[ModelMessage], info: AgentInfo) -> ModelResponse:
    first = messages[0]
    assert isinstance(first, ModelRequest)
    [order] = [p.content for p in first.parts if isinstance(p, UserPromptPart)]
    assert isinstance(order, str)
    asked = json.loads(order)
    turn = sum(isinstance(m, ModelResponse) for m in messages)
    provider().apply(
        model_key(asked["run_id"], turn),
        "model_request",
        {"turn": turn, "pid": os.getpid()},
        0,
        dedupe=False,
        gate=os.environ.get(GATE_ENV) or None,
    )
    plan: list[list[dict[str, Any]]] = asked["plan"]
    if turn < len(plan):
        calls: list[ModelResponsePart] = []
        for c in plan[turn]:
            part = ToolCallPart(c["tool"], c.get("args", {}))
            if c.get("id"):
                part.tool_call_id = c["id"]
            calls.append(part)
        return ModelResponse(parts=calls)
    seen = [
        {"tool": p.tool_name, "id": p.tool_call_id, "content": p.content}
        for m in messages
        if isinstance(m, ModelRequest)
        for p in m.parts
        if isinstance(p, ToolReturnPart)
    ]
    return ModelResponse(parts=[TextPart(json.dumps({"done": turn, "seen": seen}))])


agent: Agent[None, str] = Agent(FunctionModel(script), name="scripted")


# -- the tools, as the bare scripted flow's ---------------------------------------------


@agent.tool_plain
def ticket(title: str = "t", gate: str | None = None) -> dict[str, Any]:
    """Open a ticket (the provider deduplicates the key)."""
    rl = tool_context()
    effect = provider().apply(
        rl.idempotency_key, "ticket", {"title": title}, rl.fencing_token, gate=gate
    )
    return {"effect_id": effect["effect_id"], "duplicate": effect["duplicate"]}


@agent.tool_plain
def charge(amount: int = 1, gate: str | None = None) -> dict[str, Any]:
    """Charge (not deduplicated; the lookup finds a charge by key)."""
    rl = tool_context()
    effect = provider().apply(
        rl.idempotency_key,
        "charge",
        {"amount": amount},
        rl.fencing_token,
        dedupe=False,
        gate=gate,
    )
    return {"ok": True, "effect_id": effect["effect_id"]}


def find_charge(ctx: ToolContext) -> dict[str, Any] | None:
    effect = provider().find(ctx.idempotency_key)
    return None if effect is None else {"effect_id": effect["effect_id"], "found_by": "lookup"}


@agent.tool_plain
def email(to: str = "a@example.com", gate: str | None = None) -> dict[str, Any]:
    """Send an e-mail (every send is another e-mail)."""
    rl = tool_context()
    effect = provider().apply(
        rl.idempotency_key, "email", {"to": to}, rl.fencing_token, dedupe=False, gate=gate
    )
    return {"effect_id": effect["effect_id"]}


@agent.tool_plain
def read(what: str = "x") -> dict[str, Any]:
    """Read something (no effect)."""
    return {"what": what, "seen": len(provider().effects())}


# -- the flows ------------------------------------------------------------------------------


class Lanes:
    """Flows that differ only by name (``<prefix>-lane-<i>``), built by ``build(name)``
    on first use: a module sets ``lane = lanes.lane``, ``spec = lanes.spec`` and
    ``__getattr__ = lanes.attr``, and a worker's ``--flows MODULE:lane_<i>`` finds lane i."""

    def __init__(self, module: str, prefix: str, build: Callable[[str], Flow]) -> None:
        self.module, self.prefix, self.build = module, prefix, build

    @functools.cache  # noqa: B019 - one Lanes per module, alive as long as the module
    def lane(self, i: int) -> Flow:
        return self.build(f"{self.prefix}-lane-{i}")

    def attr(self, name: str) -> Flow:
        number = name.removeprefix("lane_")
        if number != name and number.isdigit():
            return self.lane(int(number))
        raise AttributeError(f"module {self.module!r} has no attribute {name!r}")

    def spec(self, i: int) -> str:
        """The ``--flows`` spec of lane ``i``."""
        return f"{self.module}:lane_{i}"


lanes = Lanes(
    __name__,
    PREFIX,
    lambda name: agent_flow(
        agent,
        name=name,
        version="1",
        safety=SAFETY,
        prompt=prompt,
        lookups={"charge": find_charge},
    ),
)
lane, spec, __getattr__ = lanes.lane, lanes.spec, lanes.attr


# -- what the tests read of the journal ------------------------------------------------------


def record_ids(record: dict[str, Any]) -> list[str]:
    """The model's tool-call ids in a turn's recorded ``ModelResponse``."""
    return [p["tool_call_id"] for p in record["parts"] if p["part_kind"] == "tool-call"]


def sent(result: Any) -> Any:
    """What the model is sent for a call's journaled result: a ``ToolReturnPart`` whose
    content is the journaled value."""
    return result
