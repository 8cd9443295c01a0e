"""A flow with both e-mail tools for ``test_provider_email.py``: ``smtp_email`` (SMTP,
filed in the sent folder over IMAP) and ``resend_email`` (the Resend API), pointed at
the test's fake servers by ``EMAIL_SMTP_PORT``, ``EMAIL_IMAP_PORT`` and
``EMAIL_RESEND_URL``. The policy replays ``input["plan"]`` as the scripted demo flow
does: turn *n* makes the calls of ``plan[n]`` (``{"tool", "args"}``)."""

from __future__ import annotations

import os

from runledger.demo.flows import scripted_policy
from runledger.flows import Flow
from runledger.providers.email import ImapMailbox, SmtpServer, resend_emails, smtp_emails

TIMEOUT = 2.0

flow = Flow("email-providers", version="1")

smtp_emails(
    flow,
    name="smtp_email",
    smtp=SmtpServer("127.0.0.1", int(os.environ.get("EMAIL_SMTP_PORT", "25")), security="none"),
    sender="Agent <agent@example.com>",
    imap=ImapMailbox(
        "127.0.0.1",
        "agent",
        "secret",
        port=int(os.environ.get("EMAIL_IMAP_PORT", "143")),
        security="none",
    ),
    timeout=TIMEOUT,
)

resend_emails(
    flow,
    name="resend_email",
    sender="Agent <agent@example.com>",
    api_key="re_test_key",
    api_url=os.environ.get("EMAIL_RESEND_URL", "http://127.0.0.1:9"),
    timeout=TIMEOUT,
)


flow.policy(scripted_policy)  # the scripted demo flow's: turn n makes plan[n]'s calls
