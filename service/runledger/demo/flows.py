"""Demo and test flows; every tool talks to the fake provider (``RUNLEDGER_PROVIDER_URL``).

- ``ticket-triage@1``: the agent of docs/guide.md: open a ticket, then e-mail its id.
- ``scripted@1``: the policy replays ``input["plan"]`` (a list of turns, each a list of
  ``{"tool", "args"}``), so a test chooses exactly which tools run in which turn. It
  has one tool of every safety class.
"""

from __future__ import annotations

from typing import Any

from runledger.flows import (
    Flow,
    HistoryTurn,
    NotApplied,
    PolicyContext,
    Receipt,
    ToolCall,
    ToolContext,
)
from runledger.testing.provider import ProviderClient


def provider() -> ProviderClient:
    return ProviderClient.from_env()


# -- the agent of docs/guide.md ----------------------------------------------------

triage = Flow("ticket-triage", version="1")


@triage.tool(safety="idempotent")
def create_ticket(ctx: ToolContext, title: str) -> dict[str, Any]:
    effect = provider().apply(ctx.idempotency_key, "ticket", {"title": title}, ctx.fencing_token)
    return {"ticket_id": effect["effect_id"]}


@triage.tool(safety="unsafe")
def send_email(ctx: ToolContext, to: str, subject: str) -> dict[str, Any]:
    provider().apply(
        ctx.idempotency_key,
        "email",
        {"to": to, "subject": subject},
        ctx.fencing_token,
        dedupe=False,
    )
    return {"sent": True}


@triage.policy
def triage_policy(ctx: PolicyContext, history: list[HistoryTurn]) -> list[ToolCall]:
    if not history:
        return [ToolCall("create_ticket", {"title": ctx.input["title"]})]
    if len(history) == 1 and ctx.input.get("notify"):
        ticket = history[0].calls[0].result or {}
        return [
            ToolCall(
                "send_email",
                {"to": ctx.input["notify"], "subject": f"ticket {ticket.get('ticket_id')} opened"},
            )
        ]
    return []


# -- the scripted flow for tests -----------------------------------------------------

scripted = Flow("scripted", version="1")


@scripted.tool(safety="idempotent")
def ticket(ctx: ToolContext, title: str = "t", gate: str | None = None) -> dict[str, Any]:
    effect = provider().apply(
        ctx.idempotency_key, "ticket", {"title": title}, ctx.fencing_token, gate=gate
    )
    return {"effect_id": effect["effect_id"], "duplicate": effect["duplicate"]}


@scripted.tool(safety="lookup")
def charge(ctx: ToolContext, amount: int = 1, gate: str | None = None) -> Receipt:
    # A payment provider that can be asked about a reference but does not deduplicate:
    # only the lookup keeps a retry from charging twice.
    effect = provider().apply(
        ctx.idempotency_key,
        "charge",
        {"amount": amount},
        ctx.fencing_token,
        dedupe=False,
        gate=gate,
    )
    return Receipt(result={"ok": True}, receipt={"effect_id": effect["effect_id"]})


@charge.lookup
def find_charge(ctx: ToolContext) -> dict[str, Any] | None:
    effect = provider().find(ctx.idempotency_key)
    return None if effect is None else {"effect_id": effect["effect_id"], "found_by": "lookup"}


@scripted.tool(safety="unsafe")
def email(ctx: ToolContext, to: str = "a@example.com", gate: str | None = None) -> dict[str, Any]:
    effect = provider().apply(
        ctx.idempotency_key, "email", {"to": to}, ctx.fencing_token, dedupe=False, gate=gate
    )
    return {"effect_id": effect["effect_id"]}


@scripted.tool(safety="read_only")
def read(ctx: ToolContext, what: str = "x") -> dict[str, Any]:
    return {"what": what, "seen": len(provider().effects())}


@scripted.tool(safety="idempotent")
def refuse(ctx: ToolContext, retry: bool = False) -> dict[str, Any]:
    raise NotApplied("refused by the provider", retry=retry)


@scripted.policy
def scripted_policy(ctx: PolicyContext, history: list[HistoryTurn]) -> list[ToolCall]:
    plan = ctx.input.get("plan", [])
    if ctx.turn >= len(plan):
        return []
    return [ToolCall(c["tool"], c.get("args", {}), c.get("call_id")) for c in plan[ctx.turn]]


flows = [triage, scripted]
