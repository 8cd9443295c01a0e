"""A flow with the generic HTTP tool for ``test_provider_http.py``: ``create_order`` on
the test's orders API (``tests/providers/fake_http.py``) at ``ORDERS_URL``. The policy
replays ``input["plan"]`` as the scripted demo flow does: turn *n* makes the calls of
``plan[n]`` (``{"tool", "args"}``)."""

from __future__ import annotations

import datetime as dt
import os

from runledger.demo.flows import scripted_policy
from runledger.flows import Flow
from runledger.providers import http

URL = os.environ.get("ORDERS_URL", "http://127.0.0.1:9")

flow = Flow("http-providers", version="1")

http.tool(
    flow,
    name="create_order",
    url=f"{URL}/orders",
    lookup_url=f"{URL}/orders?idempotency_key={{key}}",
    retention=http.Retention(dt.timedelta(hours=24), name="the orders API"),
    landing=2.0,
    timeout=2.0,
)


flow.policy(scripted_policy)  # the scripted demo flow's: turn n makes plan[n]'s calls
