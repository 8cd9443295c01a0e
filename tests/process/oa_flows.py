"""The ``scripted`` demo flow again, as an OpenAI Agents SDK agent:
``agent_flow(Agent(model=PlanModel()))``, for the process tests of the adapter under
crashes (``test_adapter_crashes.py``), beside the Pydantic AI one (``adapter_flows.py``).

- **The tools** are ``adapter_flows``' four functions (``ticket`` idempotent, ``charge``
  lookup with its lookup, ``email`` unsafe, ``read`` read_only), each a ``@function_tool``
  talking to the gated fake provider with ``runledger.tool_context()``'s key. The SDK sends
  the model ``str()`` of what they return, and runledger journals that string.
- **The model** replays ``input["plan"]`` as ``adapter_flows``' ``FunctionModel`` does:
  request *n* (*n* the number of assistant messages in its input: every response opens
  with one) calls the tools of ``plan[n]`` (``{"tool", "args", "id"}``; ``id`` is the
  model's own ``call_id``, random when absent), and once the plan is done it answers
  with a text naming the ``function_call_output`` items it was sent (``{"tool", "id",
  "content"}``). The run id and the plan reach it in the prompt.
- **Every model request is recorded at the provider** before the model answers, under
  ``model_key(run_id, turn)``, and held at the provider gate named by ``GATE_ENV`` when a
  worker has it, as in ``adapter_flows``.

The flows differ by name only: ``lane_<i>`` (flow ``oa-lane-<i>``).
"""

from __future__ import annotations

import asyncio
import json
import os
import uuid
from typing import Any

from agents import Agent, function_tool, set_tracing_disabled
from agents.agent_output import AgentOutputSchemaBase
from agents.handoffs import Handoff
from agents.items import ModelResponse, TResponseInputItem, TResponseOutputItem
from agents.model_settings import ModelSettings
from agents.models.interface import Model, ModelTracing
from agents.tool import Tool
from agents.usage import Usage
from openai.types.responses import (
    ResponseFunctionToolCall,
    ResponseOutputMessage,
    ResponseOutputText,
)

from runledger.integrations.openai_agents import agent_flow
from tests.process import adapter_flows
from tests.process.adapter_flows import (
    GATE_ENV,
    SAFETY,
    Lanes,
    find_charge,
    model_key,
    prompt,
    provider,
)

PREFIX = "oa"  # of the flow names, and of the run ids of the tests
set_tracing_disabled(True)  # nothing here reaches OpenAI


def message(text: str, turn: int) -> ResponseOutputMessage:
    content = [ResponseOutputText(type="output_text", text=text, annotations=[])]
    return ResponseOutputMessage(
        id=f"msg_{turn}", type="message", role="assistant", status="completed", content=content
    )


def _get(item: Any, key: str) -> Any:
    return item.get(key) if isinstance(item, dict) else getattr(item, key, None)


def order(input: list[Any]) -> tuple[dict[str, Any], int]:
    """What the prompt asks (``{"run_id", "plan"}``), and the turn of the request."""
    [text] = [_get(i, "content") for i in input if _get(i, "role") == "user"]
    turn = sum(_get(i, "type") == "message" and _get(i, "role") == "assistant" for i in input)
    return json.loads(text), turn


def answer(input: list[Any], asked: dict[str, Any], turn: int) -> list[TResponseOutputItem]:
    """The response to request ``turn``: ``plan[turn]``'s calls, or the final text."""
    plan: list[list[dict[str, Any]]] = asked["plan"]
    if turn < len(plan):
        calls: list[TResponseOutputItem] = [message(f"turn {turn}", turn)]
        for c in plan[turn]:
            calls.append(
                ResponseFunctionToolCall(
                    type="function_call",
                    name=c["tool"],
                    arguments=json.dumps(c.get("args", {})),
                    call_id=c.get("id") or f"call_{uuid.uuid4().hex[:12]}",
                )
            )
        return calls
    names = {
        _get(i, "call_id"): _get(i, "name") for i in input if _get(i, "type") == "function_call"
    }
    seen = [
        {
            "tool": names.get(_get(i, "call_id")),
            "id": _get(i, "call_id"),
            "content": _get(i, "output"),
        }
        for i in input
        if _get(i, "type") == "function_call_output"
    ]
    return [message(json.dumps({"done": turn, "seen": seen}), turn)]


class PlanModel(Model):
    """The scripted model: records the request at the provider (held at the worker's
    gate, if it has one), then answers from the plan in the prompt."""

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
        assert isinstance(input, list), input
        asked, turn = order(input)
        # in a thread, as FunctionModel runs a plain function: the worker's loop goes on
        await asyncio.to_thread(
            provider().apply,
            model_key(asked["run_id"], turn),
            "model_request",
            {"turn": turn, "pid": os.getpid()},
            0,
            dedupe=False,
            gate=os.environ.get(GATE_ENV) or None,
        )
        return ModelResponse(
            output=answer(input, asked, turn),
            usage=Usage(requests=1),
            response_id=f"resp_{uuid.uuid4().hex}",
        )

    def stream_response(self, *args: Any, **kwargs: Any) -> Any:
        raise NotImplementedError("not streamed")


agent: Agent[None] = Agent(
    name="scripted",
    model=PlanModel(),
    tools=[
        function_tool(adapter_flows.ticket),
        function_tool(adapter_flows.charge),
        function_tool(adapter_flows.email),
        function_tool(adapter_flows.read),
    ],
)


# -- the flows ------------------------------------------------------------------------------


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
    """The model's ``call_id`` s in a turn's recorded output items."""
    return [i["call_id"] for i in record["output"] if i["type"] == "function_call"]


def sent(result: Any) -> Any:
    """The ``function_call_output`` the adapter sends for a call's journaled result: the
    tool's string as it is, a receipt (a lookup's, an operator's) as compact JSON text."""
    if isinstance(result, str):
        return result
    return json.dumps(result, ensure_ascii=False, separators=(",", ":"))
