"""The demo's three tools on provider adapters, for ``test_demo_providers.py``: the
``support`` agent's ``create_ticket`` (a GitHub issue), ``charge`` (a Stripe
PaymentIntent) and ``send_email`` (SMTP, filed in the sent folder over IMAP), against
the fakes the test runs (``DEMO_GITHUB_URL``, ``DEMO_STRIPE_URL``, ``DEMO_SMTP_PORT``,
``DEMO_IMAP_PORT``). As in the demo, a run opens a ticket, charges the card, then emails
the customer: turn *n* makes the calls of ``input["plan"][n]``. One flow per lane
(``lane_<i>``), so that each crashing worker takes exactly its own run."""

from __future__ import annotations

import os

import stripe
from githubkit import GitHub

from runledger.demo.flows import scripted_policy
from runledger.flows import Flow
from runledger.providers import github as github_tools
from runledger.providers import stripe as stripe_tools
from runledger.providers.email import ImapMailbox, SmtpServer, smtp_emails

LANES = 12
OWNER, REPO = "acme", "support"
TIMEOUT = 2.0  # each client gives up after 2 s; the fakes act at once
UNSET = "http://127.0.0.1:9"


def _lane(i: int) -> Flow:
    flow = Flow(f"demo_providers_{i}", "1")
    gh = GitHub("ghp_test", base_url=os.environ.get("DEMO_GITHUB_URL", UNSET), auto_retry=False)
    github_tools.create_issue(
        flow,
        gh,
        owner=OWNER,
        repo=REPO,
        name="create_ticket",
        request_timeout=TIMEOUT,
        landing_bound=3.0,
    )
    client = stripe.StripeClient(
        "sk_test_fake",
        base_addresses={"api": os.environ.get("DEMO_STRIPE_URL", UNSET)},
        http_client=stripe.RequestsClient(timeout=TIMEOUT),
    )
    stripe_tools.payment_intents(flow, client, name="charge", landing=3.0)
    smtp_emails(
        flow,
        name="send_email",
        smtp=SmtpServer("127.0.0.1", int(os.environ.get("DEMO_SMTP_PORT", "25")), security="none"),
        imap=ImapMailbox(
            "127.0.0.1",
            "agent",
            "secret",
            port=int(os.environ.get("DEMO_IMAP_PORT", "143")),
            security="none",
        ),
        sender="Support <support@example.com>",
        timeout=TIMEOUT,
    )

    flow.policy(scripted_policy)  # the scripted demo flow's: turn n makes plan[n]'s calls

    return flow


_lanes = {f"lane_{i}": _lane(i) for i in range(LANES)}
globals().update(_lanes)


def spec(i: int) -> str:
    return f"{__name__}:lane_{i}"
