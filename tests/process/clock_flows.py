"""A flow for ``test_clock_skew.py``: ``charge``, a ``lookup`` tool on the test's payments
API (``PAYMENTS_URL``), with its lookup written as docs/providers.md says: wait until the
last send can no longer land (``await_landing(ctx, LANDING)``), then read. (An ``async``
lookup: under libfaketime with the monotonic clock left alone, as the test runs it, a
thread's ``time.sleep`` fails with EINVAL; the event loop's timers are unaffected.) The lookup
tells the API how long it waited (``waited``), so the test can hold it to the bound.
The policy replays ``input["plan"]`` as the scripted demo flow does."""

from __future__ import annotations

import asyncio
import json
import os
import urllib.parse
import urllib.request
from typing import Any

from runledger.demo.flows import scripted_policy
from runledger.flows import Flow, ToolContext
from runledger.providers.base import await_landing

URL = os.environ.get("PAYMENTS_URL", "http://127.0.0.1:9")
# the payments API acts on a request within this many seconds of receiving it, or never
LANDING = float(os.environ.get("PAYMENTS_LANDING", "6"))

flow = Flow("clock", version="1")


def _call(method: str, path: str, body: dict[str, Any] | None = None) -> Any:
    data = None if body is None else json.dumps(body).encode()
    request = urllib.request.Request(f"{URL}{path}", data=data, method=method)
    request.add_header("Content-Type", "application/json")
    with urllib.request.urlopen(request, timeout=30) as answer:
        return json.loads(answer.read())


@flow.tool(safety="lookup", max_attempts=3)
def charge(ctx: ToolContext, amount: int) -> dict[str, Any]:
    return _call("POST", "/charges", {"key": ctx.idempotency_key, "amount": amount})  # type: ignore[no-any-return]


@charge.lookup
async def find_charge(ctx: ToolContext) -> dict[str, Any] | None:
    await await_landing(ctx, LANDING)
    waited = sum(f.get("waited_for_landing_s", 0.0) for f in ctx.observed)
    query = urllib.parse.urlencode({"key": ctx.idempotency_key, "waited": waited})
    found = await asyncio.to_thread(_call, "GET", f"/charges?{query}")
    return found or None  # type: ignore[no-any-return]


flow.policy(scripted_policy)
