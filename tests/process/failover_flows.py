"""The scripted demo flow with a lookup for every tool that has an effect, for
``test_failover.py``: ``ticket`` (idempotent) and ``charge`` (a lookup) as in
``runledger.demo.flows``, and ``email`` a ``lookup`` tool here, its provider asked
whether the key was sent (``ProviderClient.find``). After a lossy failover every call is
doubted, and each is settled by asking the provider instead of a person."""

from __future__ import annotations

from typing import Any

from runledger.demo.flows import provider, scripted
from runledger.flows import Flow, ToolContext

flow = Flow("scripted-lookups", version="1")
flow.tools = {name: t for name, t in scripted.tools.items() if name != "email"}
flow.policy(scripted.policy_fn)  # type: ignore[arg-type]


@flow.tool(safety="lookup")
def email(ctx: ToolContext, to: str = "a@example.com", gate: str | None = None) -> dict[str, Any]:
    effect = provider().apply(
        ctx.idempotency_key, "email", {"to": to}, ctx.fencing_token, dedupe=False, gate=gate
    )
    return {"effect_id": effect["effect_id"]}


@email.lookup
def find_email(ctx: ToolContext) -> dict[str, Any] | None:
    effect = provider().find(ctx.idempotency_key)
    return None if effect is None else {"effect_id": effect["effect_id"], "found_by": "lookup"}
