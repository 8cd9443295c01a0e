"""A flow for ``test_full_disk.py``: ``send_email``, an unsafe tool (the provider sends
every request it gets: a second send is a second e-mail), whose result is the message
as sent, 48 KB that do not compress. PostgreSQL stores a value that large out of line,
in pages of its own: on a full disk its completion needs new space and fails (53100),
where a small one might still fit in a page the journal has. The policy replays
``input["plan"]`` as the scripted demo flow does."""

from __future__ import annotations

import base64
import random
from typing import Any

from runledger.demo.flows import provider, scripted_policy
from runledger.flows import Flow, ToolContext

flow = Flow("full-disk-mail", version="1")


def message(key: str) -> str:
    """The message sent for call ``key``: the same every time it is asked for."""
    return base64.b64encode(random.Random(key).randbytes(36_000)).decode()


@flow.tool(safety="unsafe")
def send_email(ctx: ToolContext, to: str, gate: str | None = None) -> dict[str, Any]:
    effect = provider().apply(
        ctx.idempotency_key, "email", {"to": to}, ctx.fencing_token, dedupe=False, gate=gate
    )
    return {"effect_id": effect["effect_id"], "message": message(ctx.idempotency_key)}


flow.policy(scripted_policy)  # turn n makes plan[n]'s calls
