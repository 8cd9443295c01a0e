"""The demo (``runledger demo``): its Pydantic AI agent, the test flows and the fake provider.

What the agent (:mod:`runledger.demo.agent`, which imports Pydantic AI) and the demo's
driver (:mod:`runledger.demo.run`, which does not) share is here.
"""

from __future__ import annotations

import re

HOLD_ENV = "RUNLEDGER_DEMO_HOLD"  # "run_id=tool,...": the calls the provider holds in flight
SAFETY = {"create_ticket": "idempotent", "charge": "lookup", "send_email": "unsafe"}
TURN = {"create_ticket": 0, "charge": 1, "send_email": 2}  # the scripted model's order
PROMPT = (
    "Customer {customer} wants order {order} expedited: "
    "open a ticket, charge the {amount} EUR fee and email them."
)

PROMPT_RE = re.compile(  # how the scripted model reads PROMPT
    r"Customer (?P<customer>\S+) wants order (?P<order>\S+) expedited: .* the (?P<amount>\d+) EUR"
)


def prompt_for(customer: str, order: str, amount: int) -> str:
    return PROMPT.format(customer=customer, order=order, amount=amount)
