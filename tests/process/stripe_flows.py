"""Flows for ``test_provider_stripe.py``: the Stripe tools of ``runledger.providers.stripe``
against the local Stripe (``tests/providers/fake_stripe.py``) the test runs, whose URL the
workers get in ``STRIPE_FAKE_URL``.

The policy replays ``input["plan"]``: turn *n* calls the tools of ``plan[n]``
(``{"tool", "args"}``); past the plan the run ends with the calls' statuses. The flows
differ by name only, ``stripe-lane-<i>`` (``--flows tests.process.stripe_flows:lane_<i>``),
so that a test can steer one run to one worker: a worker claims only runs of its flows.
"""

from __future__ import annotations

import functools
import os
from typing import Any

import stripe

from runledger.flows import Decision, Flow, PolicyContext, ToolCall
from runledger.providers import stripe as stripe_tools

URL_ENV = "STRIPE_FAKE_URL"
API_KEY = "sk_test_fake"
LANDING = 2.0


def client() -> Any:
    return stripe.StripeClient(
        API_KEY,
        base_addresses={"api": os.environ[URL_ENV]},
        http_client=stripe.RequestsClient(timeout=10),
    )


def build(name: str) -> Flow:
    flow = Flow(name, "1")
    c = client()
    # the fake acts on a request as it arrives: a small landing bound
    stripe_tools.payment_intents(flow, c, landing=LANDING)
    stripe_tools.customers(flow, c, landing=LANDING)
    stripe_tools.refunds(flow, c, landing=LANDING)

    @flow.policy
    def decide(ctx: PolicyContext, history: list[Any]) -> Decision | list[ToolCall]:
        plan = ctx.input["plan"]
        if ctx.turn < len(plan):
            return [ToolCall(c["tool"], c.get("args", {})) for c in plan[ctx.turn]]
        return Decision(output={"calls": [c.status for t in history for c in t.calls]})

    return flow


@functools.cache
def lane(i: int) -> Flow:
    return build(f"stripe-lane-{i}")


def spec(i: int) -> str:
    return f"{__name__}:lane_{i}"


def __getattr__(name: str) -> Flow:
    number = name.removeprefix("lane_")
    if number != name and number.isdigit():
        return lane(int(number))
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
