"""The Stripe tools (``runledger.providers.stripe``) through the official SDK against the
local Stripe of ``fake_stripe.py``: first each tool and lookup on its own with a
hand-made context, then through a real worker on a real PostgreSQL.

What is checked is what the user would check: the objects Stripe holds per key (the
fake's effects), the tool's answer or exception, the lookup's answer, and the journal.
"""

from __future__ import annotations

import datetime as dt
import threading
import time
from collections.abc import Iterator
from typing import Any

import pytest
import stripe

from runledger.flows import Decision, Flow, NotApplied, Receipt, ToolCall, ToolContext, Unknowable
from runledger.providers import stripe as stripe_tools
from runledger.providers.base import KEY_FIELD
from runledger.providers.stripe import StripeConfigError, StripeOutcomeUnknown
from runledger.testing import wait_for
from tests.integration.conftest import Db, StartWorker, db, eventually, start_worker
from tests.providers.fake_stripe import KEY_TTL, FakeStripe

__all__ = ["db", "start_worker"]  # the integration fixtures, used here too

PI = "/v1/payment_intents"
HOUR = dt.timedelta(hours=1)


@pytest.fixture
def fake() -> Iterator[FakeStripe]:
    f = FakeStripe()
    try:
        yield f
    finally:
        f.close()


def client_of(fake: FakeStripe, timeout: float = 30.0, api_key: str | None = None) -> Any:
    """The official SDK pointed at the fake (its supported base address setting)."""
    return stripe.StripeClient(
        api_key or fake.api_key,
        base_addresses={"api": fake.url},
        http_client=stripe.RequestsClient(timeout=timeout),
    )


def ctx_of(
    key: str, *, age: dt.timedelta | None = dt.timedelta(0), lease: float = 30.0
) -> ToolContext:
    """A context as the worker makes it; ``age``: how long ago the key was first sent
    (None: never sent)."""
    deadline = time.monotonic() + lease
    sent = None if age is None else dt.datetime.now(dt.UTC) - age
    return ToolContext(
        run_id="r",
        flow="f@1",
        turn=0,
        call_id="c0",
        tool="t",
        idempotency_key=key,
        fencing_token=1,
        attempt=1,
        lease_deadline=lambda: deadline,
        first_sent_at=sent,
        sent_at=sent,
    )


def tools(
    fake: FakeStripe,
    timeout: float = 30.0,
    name: str = "stripe-tools",
    landing: float = 0.0,
    **opts: Any,
) -> Flow:
    """The three tools on the fake; ``landing`` 0 unless a test says otherwise: a lookup
    then answers at once (the fake acts on a request as it arrives, or when released)."""
    flow = Flow(name, "1")
    c = client_of(fake, timeout)
    stripe_tools.payment_intents(flow, c, landing=landing, **opts)
    stripe_tools.customers(flow, c, landing=landing)
    stripe_tools.refunds(flow, c, landing=landing)
    return flow


def send(flow: Flow, tool: str, ctx: ToolContext, **args: Any) -> dict[str, Any]:
    out = flow.tools[tool].fn(ctx, **args)
    assert isinstance(out, Receipt) and out.result == out.receipt
    assert isinstance(out.receipt, dict)
    return out.receipt


def lookup(flow: Flow, tool: str, ctx: ToolContext) -> dict[str, Any] | None:
    fn = flow.tools[tool].lookup_fn
    assert fn is not None
    found: dict[str, Any] | None = fn(ctx)
    return found


PAY = {"amount": 1200, "currency": "usd"}
PI_TOOL = "create_payment_intent"


# -- the tools and lookups on their own ----------------------------------------------------


def test_a_send_carries_the_key_twice_and_the_lookup_finds_it_by_search(
    fake: FakeStripe,
) -> None:
    flow = tools(fake)
    ctx = ctx_of("k-send", age=None)
    receipt = send(flow, "create_payment_intent", ctx, **PAY, metadata={"order": "42"})
    [pi] = fake.effects("k-send")
    assert receipt["id"] == pi["id"] and receipt["object"] == "payment_intent"
    assert pi["metadata"] == {"order": "42", KEY_FIELD: "k-send"}
    assert (receipt["amount"], receipt["status"], receipt[KEY_FIELD]) == (
        1200,
        "requires_payment_method",
        "k-send",
    )
    [request] = fake.requests("k-send")
    assert receipt["request_id"] == request["request_id"]
    assert ctx.observed == [
        {
            "asked": "POST /v1/payment_intents",
            "saw": pi["id"],
            "request_id": request["request_id"],
            "status": 200,
            "replayed": False,
        }
    ]

    later = ctx_of("k-send", age=dt.timedelta(minutes=3))
    found = lookup(flow, "create_payment_intent", later)
    assert found is not None
    assert (found["id"], found["found_by"]) == (pi["id"], "search")
    assert later.observed[0]["asked"] == (f"GET {PI}/search query=metadata['{KEY_FIELD}']:'k-send'")
    # a second send with the key is Stripe's replay: no second object
    again = send(flow, "create_payment_intent", ctx_of("k-send"), **PAY, metadata={"order": "42"})
    assert again["id"] == pi["id"] and len(fake.effects("k-send")) == 1


def test_search_lags_the_list_does_not(fake: FakeStripe) -> None:
    """Eventual consistency: created 20 minutes ago and not searchable yet (an outage
    of the index); the lookup reads the list of the last hour and finds it."""
    fake.index_delay = 1800.0
    fake.clock.advance(-1200)  # Stripe creates it 20 minutes ago
    flow = tools(fake)
    receipt = send(flow, "create_payment_intent", ctx_of("k-lag", age=None), **PAY)
    fake.clock.advance(1200)
    age = dt.timedelta(minutes=20)
    ctx = ctx_of("k-lag", age=age)
    found = lookup(flow, "create_payment_intent", ctx)
    assert found is not None and (found["id"], found["found_by"]) == (receipt["id"], "list")
    assert ctx.observed[0]["saw"] == []  # search saw nothing
    assert ctx.observed[1]["asked"].startswith(f"GET {PI}?created[gte]=")
    # with search only trusted, the miss would have been a wrong "not found": the same
    # object, seen once the index caught up
    fake.clock.advance(601)
    later = lookup(flow, "create_payment_intent", ctx_of("k-lag", age=age))
    assert later is not None and (later["id"], later["found_by"]) == (receipt["id"], "search")


def test_not_found_within_the_window_is_none_and_the_resend_creates_one(
    fake: FakeStripe,
) -> None:
    flow = tools(fake)
    ctx = ctx_of("k-none", age=dt.timedelta(hours=23))
    assert lookup(flow, "create_payment_intent", ctx) is None
    assert [o["asked"].split(" ")[0:2] for o in ctx.observed] == [
        ["GET", f"{PI}/search"],
        ["GET", f"{PI}?created[gte]={ctx.observed[1]['asked'].rsplit('=', 1)[1]}"],
    ]
    send(flow, "create_payment_intent", ctx_of("k-none"), **PAY)
    assert len(fake.effects("k-none")) == 1


def test_not_found_past_the_window_is_unknowable(fake: FakeStripe) -> None:
    flow = tools(fake)
    ctx = ctx_of("k-old", age=dt.timedelta(hours=25))
    with pytest.raises(Unknowable) as caught:
        lookup(flow, "create_payment_intent", ctx)
    assert "Stripe keeps what the lookup reads for 24 hours" in caught.value.reason
    assert caught.value.facts["window_hours"] == 24
    assert caught.value.facts["saw"] == "nothing"
    assert [a.split("?")[0].split(" ")[1] for a in caught.value.facts["asked"]] == [
        f"{PI}/search",
        PI,
    ]
    # the margin: 23 h 55 min is past 24 h less 10 minutes
    with pytest.raises(Unknowable):
        lookup(flow, "create_payment_intent", ctx_of("k-old", age=dt.timedelta(minutes=1435)))
    # never sent (no first send known): conservative
    with pytest.raises(Unknowable):
        lookup(flow, "create_payment_intent", ctx_of("k-old", age=None))


def test_found_past_the_window_is_still_the_receipt(fake: FakeStripe) -> None:
    """And why the window matters: once Stripe pruned the key, a resend is a new
    payment (so a lookup that finds nothing there must not answer None)."""
    flow = tools(fake)
    first = send(flow, "create_payment_intent", ctx_of("k-pruned", age=None), **PAY)
    fake.clock.advance(KEY_TTL + 1)
    found = lookup(flow, "create_payment_intent", ctx_of("k-pruned", age=dt.timedelta(hours=25)))
    assert found is not None and found["id"] == first["id"]
    send(flow, "create_payment_intent", ctx_of("k-pruned"), **PAY)
    assert len(fake.effects("k-pruned")) == 2  # Stripe no longer deduplicated the key
    found = lookup(flow, "create_payment_intent", ctx_of("k-pruned", age=dt.timedelta(hours=25)))
    assert found is not None and found["id"] == first["id"]
    assert found["others"] == [fake.effects("k-pruned")[1]["id"]]


def test_429_waits_retry_after_then_sends_again(fake: FakeStripe) -> None:
    flow = tools(fake)
    fake.rate_limit(PI, times=2, retry_after="0")
    ctx = ctx_of("k-429")
    receipt = send(flow, "create_payment_intent", ctx, **PAY)
    assert [r["status"] for r in fake.requests("k-429")] == [429, 429, 200]
    assert [e["id"] for e in fake.effects("k-429")] == [receipt["id"]]
    assert [o.get("retry_after_s") for o in ctx.observed] == [0.0, 0.0, None]
    assert ctx.observed[0]["status"] == 429 and ctx.observed[0]["code"] == "rate_limit"


def test_429_past_the_waits_is_not_applied_retry(fake: FakeStripe) -> None:
    flow = tools(fake, max_waits=1)
    fake.rate_limit(PI, times=2, retry_after="0")
    with pytest.raises(NotApplied) as caught:
        send(flow, "create_payment_intent", ctx_of("k-429b"), **PAY)
    assert caught.value.retry is True and "429" in caught.value.reason
    assert fake.effects("k-429b") == []
    # a Retry-After longer than the lease allows: no wait at all
    fake.rate_limit(PI, times=1, retry_after="60")
    with pytest.raises(NotApplied):
        send(flow, "create_payment_intent", ctx_of("k-429c", lease=10), **PAY)
    assert len(fake.requests("k-429c")) == 1


def test_409_in_progress_waits_and_gets_the_replay(fake: FakeStripe) -> None:
    flow = tools(fake)
    fake.conflict(PI, times=2)
    receipt = send(flow, "create_payment_intent", ctx_of("k-409"), **PAY)
    assert [r["status"] for r in fake.requests("k-409")] == [409, 409, 200]
    assert [e["id"] for e in fake.effects("k-409")] == [receipt["id"]]


def test_409_that_lasts_is_ambiguous_and_the_lookup_does_not_say_not_found(
    fake: FakeStripe,
) -> None:
    flow = tools(fake, in_progress_wait=0.3)
    fake.conflict(PI, times=1000)
    with pytest.raises(StripeOutcomeUnknown, match="409"):
        send(flow, "create_payment_intent", ctx_of("k-409b"), **PAY)
    with pytest.raises(StripeOutcomeUnknown, match="still executing"):
        lookup(flow, "create_payment_intent", ctx_of("k-409b"))
    fake.faults.clear()
    send(flow, "create_payment_intent", ctx_of("k-409b"), **PAY)
    assert lookup(flow, "create_payment_intent", ctx_of("k-409b")) is not None


def test_500_is_ambiguous_and_replayed_for_the_key(fake: FakeStripe) -> None:
    flow = tools(fake)
    fake.server_error(PI, applied=True)
    ctx = ctx_of("k-500a")
    with pytest.raises(StripeOutcomeUnknown, match="500"):
        send(flow, "create_payment_intent", ctx, **PAY)
    assert ctx.observed[0]["status"] == 500 and ctx.observed[0]["request_id"].startswith("req_")
    [pi] = fake.effects("k-500a")
    found = lookup(flow, "create_payment_intent", ctx_of("k-500a"))
    assert found is not None and found["id"] == pi["id"]

    fake.server_error(PI, applied=False)
    with pytest.raises(StripeOutcomeUnknown):
        send(flow, "create_payment_intent", ctx_of("k-500b"), **PAY)
    assert lookup(flow, "create_payment_intent", ctx_of("k-500b")) is None
    # Stripe saved the 500: the resend is its replay, still no object
    again = ctx_of("k-500b")
    with pytest.raises(StripeOutcomeUnknown):
        send(flow, "create_payment_intent", again, **PAY)
    assert again.observed[0]["replayed"] is True and fake.effects("k-500b") == []


def test_a_timeout_after_the_effect_is_found_by_the_lookup(fake: FakeStripe) -> None:
    flow = tools(fake, timeout=1.0)
    held = fake.hold(PI, apply="before")
    with pytest.raises(StripeOutcomeUnknown, match="no answer"):
        send(flow, "create_payment_intent", ctx_of("k-held"), **PAY)
    held.release()
    [pi] = fake.effects("k-held")
    found = lookup(flow, "create_payment_intent", ctx_of("k-held"))
    assert found is not None and found["id"] == pi["id"]


def test_a_timeout_that_never_executed_is_sent_again(fake: FakeStripe) -> None:
    flow = tools(fake, timeout=1.0)
    held = fake.hold(PI, apply="never")
    with pytest.raises(StripeOutcomeUnknown):
        send(flow, "create_payment_intent", ctx_of("k-drop"), **PAY)
    held.release()
    assert held.done.wait(10)
    assert lookup(flow, "create_payment_intent", ctx_of("k-drop")) is None
    send(flow, "create_payment_intent", ctx_of("k-drop"), **PAY)
    assert len(fake.effects("k-drop")) == 1


def test_a_request_that_lands_after_the_client_gave_up_makes_one_payment(
    fake: FakeStripe,
) -> None:
    """The first request times out at the client and is still executing at Stripe: the
    lookup sees nothing, the resend with the key is answered 409 until the first one
    lands, then with its replay."""
    flow = tools(fake, timeout=1.0)
    held = fake.hold(PI, apply="after")
    with pytest.raises(StripeOutcomeUnknown):
        send(flow, "create_payment_intent", ctx_of("k-late"), **PAY)
    assert held.arrived.is_set() and fake.effects("k-late") == []
    assert lookup(flow, "create_payment_intent", ctx_of("k-late")) is None
    answers: list[Any] = []
    resend = threading.Thread(
        target=lambda: answers.append(send(flow, "create_payment_intent", ctx_of("k-late"), **PAY))
    )
    resend.start()
    wait_for(lambda: fake.requests("k-late", status=409), timeout=20, what="a 409 for k-late")
    held.release()
    resend.join(30)
    [receipt] = answers
    [pi] = fake.effects("k-late")
    assert receipt["id"] == pi["id"]
    assert fake.requests("k-late")[-1]["status"] == 200


def test_no_lookup_says_not_found_while_a_send_may_still_land(fake: FakeStripe) -> None:
    """The same late request, looked up with a landing bound: the lookup waits until the
    send can no longer land, and finds the payment the held request made meanwhile,
    where one without the wait said "not found" (above)."""
    flow = tools(fake, timeout=1.0, landing=4.0)
    held = fake.hold(PI, apply="after")
    with pytest.raises(StripeOutcomeUnknown):
        send(flow, "create_payment_intent", ctx_of("k-land"), **PAY)
    ctx = ctx_of("k-land", age=dt.timedelta(seconds=1))
    found: list[Any] = []
    asking = threading.Thread(target=lambda: found.append(lookup(flow, PI_TOOL, ctx)))
    asking.start()
    # both reads found nothing (Search, then the list): the lookup waits out the landing
    # bound now; the request lands during that wait, not between the two reads
    wait_for(
        lambda: len([r for r in fake.requests(None, status=200) if r["method"] == "GET"]) >= 2,
        timeout=20,
        what="the lookup's two reads",
    )
    held.release()  # the request lands while the lookup waits
    asking.join(30)
    [receipt] = found
    [pi] = fake.effects("k-land")
    assert receipt is not None and receipt["id"] == pi["id"]
    assert any("waited_for_landing_s" in fact for fact in ctx.observed)


def test_refusals_are_not_applied(fake: FakeStripe) -> None:
    flow = tools(fake)
    with pytest.raises(NotApplied, match="amount_too_small") as caught:
        send(flow, "create_payment_intent", ctx_of("k-small"), amount=10, currency="usd")
    assert caught.value.retry is False and fake.effects("k-small") == []
    with pytest.raises(NotApplied, match="card_declined"):
        send(
            flow,
            "create_payment_intent",
            ctx_of("k-declined"),
            **PAY,
            confirm=True,
            payment_method="pm_card_chargeDeclined",
        )
    [declined] = fake.effects("k-declined")  # Stripe keeps the unpaid PaymentIntent
    assert declined["status"] == "requires_payment_method"
    with pytest.raises(NotApplied, match="resource_missing"):
        send(flow, "create_refund", ctx_of("k-norefund"), payment_intent="pi_nope")
    with pytest.raises(NotApplied, match="exactly one"):
        send(flow, "create_refund", ctx_of("k-norefund"))
    assert fake.requests("k-norefund")[1:] == []
    bad = Flow("bad-key", "1")
    stripe_tools.customers(bad, client_of(fake, api_key="sk_test_wrong"))
    with pytest.raises(NotApplied, match=r"401.*API key"):
        send(bad, "create_customer", ctx_of("k-401"), email="a@example.com")


def test_the_key_with_other_parameters_is_ambiguous_and_found(fake: FakeStripe) -> None:
    flow = tools(fake)
    first = send(flow, "create_payment_intent", ctx_of("k-params"), **PAY)
    with pytest.raises(StripeOutcomeUnknown, match="other parameters"):
        send(flow, "create_payment_intent", ctx_of("k-params"), amount=999, currency="usd")
    found = lookup(flow, "create_payment_intent", ctx_of("k-params"))
    assert found is not None and found["id"] == first["id"]


def test_refunds_are_found_by_listing_and_customers_by_search(fake: FakeStripe) -> None:
    flow = tools(fake)
    pi = send(
        flow, "create_payment_intent", ctx_of("k-pi"), **PAY, confirm=True, payment_method="pm_x"
    )
    assert pi["status"] == "succeeded"
    refund = send(flow, "create_refund", ctx_of("k-re"), payment_intent=pi["id"], amount=200)
    assert (refund["object"], refund["amount"], refund["payment_intent"]) == (
        "refund",
        200,
        pi["id"],
    )
    ctx = ctx_of("k-re", age=dt.timedelta(minutes=2))
    found = lookup(flow, "create_refund", ctx)
    assert found is not None and (found["id"], found["found_by"]) == (refund["id"], "list")
    assert [o["asked"].split("?")[0] for o in ctx.observed] == ["GET /v1/refunds"]
    assert lookup(flow, "create_refund", ctx_of("k-re2", age=dt.timedelta(minutes=2))) is None
    with pytest.raises(Unknowable):
        lookup(flow, "create_refund", ctx_of("k-re2", age=dt.timedelta(hours=30)))

    customer = send(flow, "create_customer", ctx_of("k-cus"), email="a@example.com", name="A")
    found = lookup(flow, "create_customer", ctx_of("k-cus"))
    assert found is not None
    assert (found["id"], found["email"], found["found_by"]) == (
        customer["id"],
        "a@example.com",
        "search",
    )
    assert len(fake.effects("k-cus")) == 1


def test_the_list_is_read_page_by_page(fake: FakeStripe) -> None:
    """Without Search (``search=False``), the lookup lists everything since the key's
    first send, newest first, a hundred a page: the key's object is on the second page."""
    flow = Flow("no-search", "1")
    stripe_tools.customers(flow, client_of(fake), search=False)
    first = send(flow, "create_customer", ctx_of("k-page"), email="first@example.com")
    for i in range(120):
        fake._execute("/v1/customers", {"email": f"{i}@example.com"}, f"other-{i}")
    ctx = ctx_of("k-page", age=dt.timedelta(minutes=1))
    found = lookup(flow, "create_customer", ctx)
    assert found is not None and (found["id"], found["found_by"]) == (first["id"], "list")
    assert ctx.observed[0]["scanned"] == 121
    assert len(fake.requests()) == 1 + 2  # the send, then two pages: no search


def test_metadata_of_the_wrong_shape_is_refused_unsent(fake: FakeStripe) -> None:
    flow = tools(fake)
    with pytest.raises(NotApplied, match="metadata must be an object"):
        send(flow, "create_customer", ctx_of("k-meta"), metadata="x")  # type: ignore[arg-type]
    assert fake.requests() == []


def test_a_key_with_quotes_is_searched_exactly(fake: FakeStripe) -> None:
    flow = tools(fake)
    key = "run 'x'\\y:0:c0"
    receipt = send(flow, "create_customer", ctx_of(key), email="q@example.com")
    send(flow, "create_customer", ctx_of("run 'x'\\y:0:c1"), email="q@example.com")
    found = lookup(flow, "create_customer", ctx_of(key))
    assert found is not None and (found["id"], found["found_by"]) == (receipt["id"], "search")


def test_bad_configuration_says_so_in_one_line(fake: FakeStripe) -> None:
    with pytest.raises(StripeConfigError, match=r"need a stripe.StripeClient .* got str"):
        stripe_tools.payment_intents(Flow("x", "1"), "sk_test_123")
    with pytest.raises(StripeConfigError, match=r"runledger\.Flow"):
        stripe_tools.refunds(object(), client_of(fake))  # type: ignore[arg-type]
    flow = Flow("x", "1")
    tool = stripe_tools.payment_intents(flow, client_of(fake), name="pay")
    assert flow.tools["pay"] is tool and tool.safety == "lookup" and tool.lookup_fn is not None


# -- through a real worker on a real PostgreSQL --------------------------------------------


def _flow(name: str, fake: FakeStripe, timeout: float = 30.0, **opts: Any) -> Flow:
    flow = tools(fake, timeout, name, **opts)

    @flow.policy
    def decide(ctx: Any, history: list[Any]) -> Decision | list[ToolCall]:
        if history:
            return Decision(output={"calls": [c.status for t in history for c in t.calls]})
        return [ToolCall(ctx.input["tool"], ctx.input["args"])]

    return flow


async def _run(
    db: Db, start_worker: StartWorker, flow: Flow, run_id: str, args: dict[str, Any]
) -> tuple[dict[str, Any], dict[str, Any]]:
    await db.submit(run_id, flow, {"tool": "create_payment_intent", "args": args})
    await start_worker(flow)
    run = await db.wait_status(run_id, "succeeded", "paused", "failed", timeout=60)
    [call] = await db.calls(run_id)
    return run, call


async def test_worker_sends_once_and_journals_the_receipt(
    db: Db, start_worker: StartWorker, fake: FakeStripe
) -> None:
    flow = _flow("stripe-ok", fake)
    run, call = await _run(db, start_worker, flow, "st-ok", PAY)
    assert run["status"] == "succeeded", call
    [pi] = fake.effects("st-ok:0:c0")
    assert call["receipt"]["id"] == pi["id"] and call["attempts"] == 1


async def test_worker_settles_a_500_by_the_lookup(
    db: Db, start_worker: StartWorker, fake: FakeStripe
) -> None:
    fake.server_error(PI, applied=True)
    flow = _flow("stripe-500", fake)
    run, call = await _run(db, start_worker, flow, "st-500", PAY)
    assert run["status"] == "succeeded", call
    [pi] = fake.effects("st-500:0:c0")
    assert (call["receipt"]["id"], call["receipt"]["found_by"]) == (pi["id"], "search")
    assert call["attempts"] == 1  # found: never sent again


async def test_worker_retries_a_rate_limited_call_with_the_same_key(
    db: Db, start_worker: StartWorker, fake: FakeStripe
) -> None:
    fake.rate_limit(PI, times=1, retry_after="0")
    flow = _flow("stripe-429", fake, max_waits=0)
    run, call = await _run(db, start_worker, flow, "st-429", PAY)
    assert run["status"] == "succeeded", call
    assert [r["status"] for r in fake.requests("st-429:0:c0")] == [429, 200]
    assert len(fake.effects("st-429:0:c0")) == 1 and call["attempts"] == 2


async def test_worker_late_landing_ends_with_one_payment(
    db: Db, start_worker: StartWorker, fake: FakeStripe
) -> None:
    held = fake.hold(PI, apply="after")
    flow = _flow("stripe-late", fake, timeout=1.0)
    key = "st-late:0:c0"
    await db.submit("st-late", flow, {"tool": "create_payment_intent", "args": PAY})
    await start_worker(flow)
    # the resend after the lookup found nothing is answered 409: the first one lands
    await eventually(lambda: fake.requests(key, status=409), timeout=60, what="a 409")
    held.release()
    run = await db.wait_status("st-late", "succeeded", "paused", "failed", timeout=60)
    [call] = await db.calls("st-late")
    assert run["status"] == "succeeded", call
    [pi] = fake.effects(key)
    assert call["receipt"]["id"] == pi["id"]


# Past the window through workers: tests/process/test_provider_stripe.py (the key's
# first send must be another holder's, kept by the database's clock).
