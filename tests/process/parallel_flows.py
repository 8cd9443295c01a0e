"""A flow whose turn 0 runs three calls at once (``parallel_calls=True``), for the
process test of a SIGKILL while all three are in flight.

``fanout@1``: turn 0 opens a ticket (idempotent), charges (lookup) and sends an e-mail
(unsafe); each is held at the fake provider's gate ``input["gate"]`` (passed in its
arguments) after its effect is applied. Turn 1 ends the run.
"""

from __future__ import annotations

from typing import Any

from runledger.flows import Flow, HistoryTurn, PolicyContext, ToolCall, ToolContext
from runledger.testing.provider import ProviderClient

fanout = Flow("fanout", version="1", parallel_calls=True)


def _apply(ctx: ToolContext, kind: str, gate: str | None, *, dedupe: bool) -> int:
    effect = ProviderClient.from_env().apply(
        ctx.idempotency_key, kind, {}, ctx.fencing_token, dedupe=dedupe, gate=gate
    )
    return int(effect["effect_id"])


@fanout.tool(safety="idempotent")
def open_ticket(ctx: ToolContext, gate: str | None = None) -> dict[str, Any]:
    return {"ticket_id": _apply(ctx, "ticket", gate, dedupe=True)}


@fanout.tool(safety="lookup")
def charge(ctx: ToolContext, gate: str | None = None) -> dict[str, Any]:
    return {"charge_id": _apply(ctx, "charge", gate, dedupe=True)}


@charge.lookup
def find_charge(ctx: ToolContext) -> dict[str, Any] | None:
    found = ProviderClient.from_env().find(ctx.idempotency_key)
    return None if found is None else {"charge_id": found["effect_id"]}


@fanout.tool(safety="unsafe")
def send_email(ctx: ToolContext, gate: str | None = None) -> dict[str, Any]:
    return {"email_id": _apply(ctx, "email", gate, dedupe=False)}


@fanout.policy
def decide(ctx: PolicyContext, history: list[HistoryTurn]) -> list[ToolCall]:
    if history:
        return []
    gate = {"gate": ctx.input["gate"]} if ctx.input.get("gate") else {}
    return [ToolCall(tool, dict(gate)) for tool in ("open_ticket", "charge", "send_email")]


flows = [fanout]
