"""The generic HTTP adapter (``runledger.providers.http``) against a local API that
implements the IETF Idempotency-Key draft (``tests/providers/fake_http.py``), through a
real worker and a real PostgreSQL: every fault ends with exactly one order per key, and
settles without a person while the key is within the API's retention."""

from __future__ import annotations

import datetime as dt
from collections.abc import Iterator
from typing import Any

import pytest

from runledger.flows import Flow, ToolCall
from runledger.providers import http
from tests.integration.conftest import Db, StartWorker
from tests.providers.fake_http import OrdersApi

FINAL = ("succeeded", "paused", "failed")
DAY = dt.timedelta(hours=24)


@pytest.fixture
def api() -> Iterator[OrdersApi]:
    with OrdersApi(late_delay=1.0) as a:
        yield a


def _flow(
    api: OrdersApi,
    *,
    landing: float = 2.0,
    retention: http.Retention | None = None,
    timeout: float = 5.0,
    lookup: str = "/orders?idempotency_key={key}",
) -> Flow:
    flow = Flow("orders", "1")
    http.tool(
        flow,
        name="create_order",
        url=f"{api.url}/orders",
        lookup_url=f"{api.url}{lookup}",
        retention=retention or http.Retention(DAY, name="the orders API"),
        landing=landing,
        timeout=timeout,
        max_attempts=4,
    )

    @flow.policy
    def decide(ctx: Any, history: list[Any]) -> list[ToolCall]:
        if history:
            return []
        return [ToolCall("create_order", {"body": {"sku": "A-1", "qty": 2}})]

    return flow


async def _run(db: Db, start_worker: StartWorker, flow: Flow, run_id: str) -> dict[str, Any]:
    await db.submit(run_id, flow)
    await start_worker(flow)
    await db.wait_status(run_id, *FINAL)
    [call] = await db.calls(run_id)
    return call


async def test_a_send_creates_one_order_and_keeps_its_receipt(
    db: Db, start_worker: StartWorker, api: OrdersApi
) -> None:
    call = await _run(db, start_worker, _flow(api), "h-ok")
    key = "h-ok:0:c0"
    assert call["status"] == "succeeded"
    assert api.effects(key) == 1 and api.posts(key) == 1
    assert call["result"]["idempotency_key"] == key
    assert call["receipt"]["status"] == 201
    assert call["receipt"]["location"] == f"/orders/{call['result']['id']}"
    assert call["receipt"]["request_id"].startswith("req_")


@pytest.mark.parametrize(
    ("fault", "posts"),
    [
        ("500_after", 1),  # the order exists: the lookup finds it, nothing is sent again
        ("500_before", 2),  # no order: the lookup finds none, sent again with the key
    ],
)
async def test_a_5xx_is_looked_up_and_settles_with_one_order(
    db: Db, start_worker: StartWorker, api: OrdersApi, fault: str, posts: int
) -> None:
    api.script(fault)
    run_id = f"h-{fault}"
    call = await _run(db, start_worker, _flow(api), run_id)
    key = f"{run_id}:0:c0"
    assert call["status"] == "succeeded", call
    assert api.effects(key) == 1
    assert api.posts(key) == posts
    assert call["result"]["idempotency_key"] == key  # the order, sent or found


async def test_429_is_waited_out_within_the_call(
    db: Db, start_worker: StartWorker, api: OrdersApi
) -> None:
    api.script("429", "429")
    call = await _run(db, start_worker, _flow(api), "h-429")
    assert call["status"] == "succeeded" and call["attempts"] == 1
    assert api.effects("h-429:0:c0") == 1 and api.posts("h-429:0:c0") == 3


async def test_a_request_that_lands_after_the_client_gave_up_is_never_doubled(
    db: Db, start_worker: StartWorker, api: OrdersApi
) -> None:
    """The API holds the request past the client's timeout, then creates the order. A
    second send with the key finds it in progress (409, waited for), and no lookup says
    "not found" before the landing bound: one order, and the call succeeds (it would
    fail as never applied if a lookup had been believed too early)."""
    api.script("late")
    call = await _run(db, start_worker, _flow(api, timeout=0.3, landing=3.0), "h-late")
    key = "h-late:0:c0"
    assert api.landed.is_set()
    assert call["status"] == "succeeded", call
    assert api.effects(key) == 1
    assert call["result"]["idempotency_key"] == key


async def test_no_lookup_says_not_found_before_the_landing_bound(
    db: Db, start_worker: StartWorker, api: OrdersApi
) -> None:
    """A 500 with no order: the lookup waits out the landing bound after the send before
    it says "not found", then the call is sent again: one order, two POSTs."""
    api.script("500_before")
    call = await _run(db, start_worker, _flow(api, landing=1.5), "h-wait")
    assert call["status"] == "succeeded"
    assert api.posts("h-wait:0:c0") == 2 and api.effects("h-wait:0:c0") == 1
    first, second = (t for k, t in api.posted if k == "h-wait:0:c0")
    assert second - first >= 1.5


async def test_past_the_retention_nothing_found_is_unknown_with_its_evidence(
    db: Db, start_worker: StartWorker, api: OrdersApi
) -> None:
    """The send fails with no order after a pause longer than the (tiny) retention:
    the lookup finds nothing, but the key may have been forgotten: unknown, not resent."""
    api.script("slow_500")
    retention = http.Retention(dt.timedelta(seconds=0.5), margin=dt.timedelta(0), name="the API")
    call = await _run(db, start_worker, _flow(api, retention=retention), "h-old")
    key = "h-old:0:c0"
    assert call["status"] == "unknown"
    assert api.posts(key) == 1 and api.effects(key) == 0
    error = call["error"]
    assert error["reason"].startswith(f"the provider cannot tell: nothing found for key {key}")
    send, lookup = error["evidence"]
    assert send["error"]["type"] == "AmbiguousAnswer"
    assert send["observed"][0]["status"] == 500
    assert lookup["saw"] == "unknowable"
    asked = f"GET {api.url}/orders?idempotency_key={key.replace(':', '%3A')}"
    assert lookup["observed"][0]["asked"] == asked
    assert lookup["observed"][-1]["window_hours"] == round(0.5 / 3600, 3)


async def test_a_lookup_of_the_resource_itself(
    db: Db, start_worker: StartWorker, api: OrdersApi
) -> None:
    """``GET /orders/by-key/{key}``: 404 is not found, 200 is the receipt."""
    api.script("500_after")
    call = await _run(db, start_worker, _flow(api, lookup="/orders/by-key/{key}"), "h-res")
    assert call["status"] == "succeeded"
    assert call["result"]["idempotency_key"] == "h-res:0:c0"
    assert api.effects("h-res:0:c0") == 1 and api.posts("h-res:0:c0") == 1


def test_bad_configuration_is_one_clear_error() -> None:
    flow = Flow("bad", "1")
    keep = http.Retention(DAY)
    with pytest.raises(ValueError, match="must name the key as"):
        http.tool(flow, name="a", url="http://x/a", lookup_url="http://x/a", retention=keep)
    with pytest.raises(ValueError, match="must be an http or https URL"):
        http.tool(flow, name="a", url="ftp://x/a", lookup_url="http://x/{key}", retention=keep)
    with pytest.raises(ValueError, match="method must be"):
        http.tool(
            flow,
            name="a",
            url="http://x/a",
            lookup_url="http://x/{key}",
            retention=keep,
            method="GET",
        )
    with pytest.raises(ValueError, match="retention window must be positive"):
        http.Retention(dt.timedelta(0))
    assert flow.tools == {}


async def test_a_key_used_with_another_body_is_looked_up_not_sent_again(
    db: Db, start_worker: StartWorker, api: OrdersApi
) -> None:
    """The API already has an order under the key with another body (422 for the send):
    the key took effect, so the lookup's order is the call's outcome, and nothing else is
    created."""
    key = "h-422:0:c0"
    api._create(key, {"sku": "B-2", "qty": 9})
    call = await _run(db, start_worker, _flow(api), "h-422")
    assert call["status"] == "succeeded"
    assert call["result"]["body"] == {"sku": "B-2", "qty": 9}
    assert api.effects(key) == 1 and api.posts(key) == 1
