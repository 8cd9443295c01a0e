"""The demo's agent: a Pydantic AI ``Agent`` run through :func:`agent_flow` (``support@1``).

The model is a scripted ``FunctionModel`` (no network, no API key): it reads the
conversation so far and answers turn by turn, as a real model would, from the prompt and
the tools' results:

- turn 0: ``create_ticket`` (idempotent: the provider deduplicates by key);
- turn 1: ``charge`` (lookup: the provider does not deduplicate charges, but can say
  whether a key was charged);
- turn 2: ``send_email`` (unsafe: sent twice is sent twice, so a crash mid-send pauses
  the run for a person);
- turn 3: the answer, which becomes the run's result.

Every tool calls the fake provider (``RUNLEDGER_PROVIDER_URL``) over HTTP with runledger's
idempotency key and fencing token. ``RUNLEDGER_DEMO_HOLD`` (``run_id=tool,...``, set by
``runledger demo``) names the calls the provider holds in flight (at a gate, after the
effect, before the reply) so that the demo can SIGKILL the worker exactly then.
"""

from __future__ import annotations

import os
from typing import Any

from pydantic_ai import Agent
from pydantic_ai.messages import (
    ModelMessage,
    ModelRequest,
    ModelResponse,
    TextPart,
    ToolCallPart,
    ToolReturnPart,
    UserPromptPart,
)
from pydantic_ai.models.function import AgentInfo, FunctionModel

from runledger import ToolContext, tool_context
from runledger.demo import HOLD_ENV, PROMPT_RE, SAFETY
from runledger.integrations.pydantic_ai import agent_flow
from runledger.testing.provider import ProviderClient

# -- the scripted model ---------------------------------------------------------------


def script(messages: list[ModelMessage], info: AgentInfo) -> ModelResponse:
    """One model response: the next step for the conversation in ``messages``."""
    turn = sum(isinstance(m, ModelResponse) for m in messages)
    found = PROMPT_RE.search(_prompt(messages))
    if found is None:
        return ModelResponse(parts=[TextPart("I can only expedite orders.")])
    customer, order, amount = found["customer"], found["order"], int(found["amount"])
    results = _results(messages)
    ticket = results.get("create_ticket", {}).get("ticket_id", "?")
    charge = results.get("charge", {}).get("charge_id", "?")
    if turn == 0:
        return _call("create_ticket", subject=f"Expedite order {order}", customer=customer)
    if turn == 1:
        return _call("charge", customer=customer, amount_eur=amount, reference=ticket)
    if turn == 2:
        body = f"Order {order} is expedited (ticket {ticket}); we charged {amount} EUR ({charge})."
        return _call("send_email", to=customer, subject=f"Order {order} expedited", body=body)
    if "send_email" in results:
        emailed = "emailed"
    elif _given_up(messages, "send_email"):  # abandoned by an operator: it may have gone out
        emailed = "may or may not have emailed"
    else:
        emailed = "did not email"
    return ModelResponse(
        parts=[
            TextPart(
                f"{order}: ticket {ticket}, charged {amount} EUR ({charge}), {emailed} {customer}."
            )
        ]
    )


def _prompt(messages: list[ModelMessage]) -> str:
    for message in messages:
        if isinstance(message, ModelRequest):
            for part in message.parts:
                if isinstance(part, UserPromptPart) and isinstance(part.content, str):
                    return part.content
    return ""


def _results(messages: list[ModelMessage]) -> dict[str, dict[str, Any]]:
    """The last successful result of each tool, by tool name (``{}`` when it is not an
    object: ``runledger resolve KEY applied`` without a receipt leaves ``{}``)."""
    out: dict[str, dict[str, Any]] = {}
    for message in messages:
        if isinstance(message, ModelRequest):
            for part in message.parts:
                if isinstance(part, ToolReturnPart) and part.outcome == "success":
                    content = part.content
                    out[part.tool_name] = dict(content) if isinstance(content, dict) else {}
    return out


def _given_up(messages: list[ModelMessage], tool: str) -> bool:
    """Whether the adapter told the model an operator gave up on a call of ``tool``."""
    return any(
        isinstance(part, ToolReturnPart)
        and part.tool_name == tool
        and part.outcome == "failed"
        and "given up by an operator" in str(part.content)
        for message in messages
        if isinstance(message, ModelRequest)
        for part in message.parts
    )


def _call(tool: str, **args: Any) -> ModelResponse:
    return ModelResponse(parts=[ToolCallPart(tool, args)])


# -- the agent and its tools ---------------------------------------------------------------

agent: Agent[None, str] = Agent(
    FunctionModel(script, model_name="scripted-support"),
    instructions="You are a support agent. Use the tools; never email twice.",
)


def _provider() -> ProviderClient:
    return ProviderClient.from_env()


def _gate() -> str | None:
    """The provider gate this call waits at, if the demo holds it (``RUNLEDGER_DEMO_HOLD``)."""
    rl = tool_context()
    held = (entry.partition("=") for entry in os.environ.get(HOLD_ENV, "").split(","))
    if any(run == rl.run_id and tool == rl.tool for run, _, tool in held):
        return f"hold:{rl.idempotency_key}"
    return None


def _apply(kind: str, payload: dict[str, Any], *, dedupe: bool) -> dict[str, Any]:
    """The effect at the provider, under runledger's key and fencing token."""
    rl = tool_context()
    return _provider().apply(
        rl.idempotency_key, kind, payload, rl.fencing_token, dedupe=dedupe, gate=_gate()
    )


@agent.tool_plain
def create_ticket(subject: str, customer: str) -> dict[str, Any]:
    """Open a support ticket."""
    effect = _apply("ticket", {"subject": subject, "customer": customer}, dedupe=True)
    return {"ticket_id": f"T-{effect['effect_id']}"}


@agent.tool_plain
def charge(customer: str, amount_eur: int, reference: str) -> dict[str, Any]:
    """Charge the customer's card on file."""
    payload = {"customer": customer, "amount_eur": amount_eur, "reference": reference}
    effect = _apply("charge", payload, dedupe=False)  # only the lookup saves a retry
    return {"charge_id": f"ch-{effect['effect_id']}"}


@agent.tool_plain
def send_email(to: str, subject: str, body: str) -> dict[str, Any]:
    """Send an email to the customer."""
    effect = _apply("email", {"to": to, "subject": subject, "body": body}, dedupe=False)
    return {"email_id": f"m-{effect['effect_id']}"}


def find_charge(ctx: ToolContext) -> dict[str, Any] | None:
    """The lookup: was this key charged? Its answer is the call's result and receipt."""
    effect = _provider().find(ctx.idempotency_key)
    return None if effect is None else {"charge_id": f"ch-{effect['effect_id']}"}


flow = agent_flow(
    agent,
    name="support",
    version="1",
    safety=SAFETY,
    lookups={"charge": find_charge},
)
