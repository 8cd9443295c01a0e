"""A flow whose policy answers with :class:`~runledger.Decision` s, as a model adapter does,
for the process tests of the decision crash points (``after_decide``,
``after_record_turn``).

``decider@1``: turn 0 opens a ticket (idempotent) and sends an e-mail (unsafe), turn 1
ends the run with an output. Every policy invocation appends ``<turn>`` to the file
``input["asks"]`` before it returns, so a test counts how often the model was asked;
each answer's record carries the number of the ask, so a test tells which answer was
journaled. The tools read their key from ``runledger.tool_context()``, as a framework's
tool function would.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import runledger
from runledger.flows import Decision, Flow, HistoryTurn, PolicyContext, ToolCall, ToolContext
from runledger.testing.provider import ProviderClient

decider = Flow("decider", version="1")


@decider.tool(safety="idempotent")
def open_ticket(ctx: ToolContext, title: str) -> dict[str, Any]:
    now = runledger.tool_context()
    effect = ProviderClient.from_env().apply(
        now.idempotency_key, "ticket", {"title": title}, now.fencing_token
    )
    return {"ticket_id": effect["effect_id"]}


@decider.tool(safety="unsafe")
def notify(ctx: ToolContext, to: str) -> dict[str, Any]:
    now = runledger.tool_context()
    ProviderClient.from_env().apply(
        now.idempotency_key, "email", {"to": to}, now.fencing_token, dedupe=False
    )
    return {"sent": True}


def _ask(ctx: PolicyContext) -> int:
    """Count this ask in the side file; the number of asks of this turn so far."""
    asks = Path(ctx.input["asks"])
    with asks.open("a", encoding="utf-8") as f:
        f.write(f"{ctx.turn}\n")
    return asks.read_text(encoding="utf-8").split().count(str(ctx.turn))


@decider.policy
def decide(ctx: PolicyContext, history: list[HistoryTurn]) -> Decision:
    n = _ask(ctx)
    if ctx.turn == 0:
        return Decision(
            calls=[
                ToolCall("open_ticket", {"title": "printer"}, provider_id="toolu_same"),
                ToolCall("notify", {"to": "ana@example.com"}, provider_id="toolu_mail"),
            ],
            record={"role": "assistant", "ask": n, "content": [{"type": "text", "text": "¡voy!"}]},
        )
    [first] = history
    ticket = first.calls[0].result["ticket_id"]
    return Decision(
        record={"role": "assistant", "ask": n, "content": [{"type": "text", "text": "hecho"}]},
        output={"ticket_id": ticket, "ask": n, "seen_record": first.record},
    )


flows = [decider]
