"""Stripe: ready ``lookup`` tools that create PaymentIntents, Refunds and Customers.

Built on the official SDK (``pip install "stripe>=16,<17"``) and a ``stripe.StripeClient``
you configure (API key, ``stripe_account``, ``http_client`` with its timeout)::

    import stripe
    from runledger.providers import stripe as stripe_tools

    client = stripe.StripeClient("sk_...", http_client=stripe.RequestsClient(timeout=20))
    stripe_tools.payment_intents(flow, client)  # tool "create_payment_intent"
    stripe_tools.refunds(flow, client)          # tool "create_refund"
    stripe_tools.customers(flow, client)        # tool "create_customer"

Every send carries the call's key twice: as the ``Idempotency-Key`` request option and as
``metadata[runledger_key]`` on the object it creates. Stripe keeps an idempotency key "at
least 24 hours" and answers a repeat of it with the first response (docs.stripe.com/
idempotency), so within that window sending the call again with its key is safe; the
metadata is what the lookup finds, and the only answer once the window is past.

How each crash window settles (the worker's table, ``runledger.worker.recovery``):

- *before the send*: sent with the persisted key.
- *sent, no answer journaled* (the worker died, the request timed out, Stripe answered
  500): the lookup asks Stripe. Found: the call succeeds with the object as its receipt
  (``found_by`` says how), nothing is sent again. Not found within the window: ``None``,
  the call is sent again with the same key, and Stripe either executes it (the first
  request never began executing), replays the first response (it did), or answers 409
  ``idempotency_key_in_use`` (it is executing still: the tool waits and asks again).
  Either way there is one object per key. Not found past the window (24 h less
  :attr:`runledger.providers.base.Retention.margin`, counted from the key's first send):
  :class:`runledger.Unknowable`, the call waits for a person with what the lookup asked.
- *answered, not journaled*: the lookup finds the object.
- *journaled*: reused, nothing is asked.

The lookup reads Stripe's Search API, which is eventually consistent ("data is searchable
in less than a minute ... up to an hour behind during outages"), so it does not trust a
miss: for what may have been created in the last ``search_lag`` (1 hour) it also reads
the list endpoint, which is consistent, filtered by ``created``. Refunds have no Search
API: their lookup lists refunds created since the key's first send. A lookup is handed
only the context, not the call's arguments, so it cannot narrow the list to one
``payment_intent``.

What a send's answer means: 2xx, the receipt; 400/402/404 and 401/403 (validation, a
declined card, a missing object, a bad key or permission), :class:`runledger.NotApplied`
(Stripe saved nothing executed, or a declined confirmation that moved no money); 429,
the tool waits ``Retry-After`` (within the lease) and sends again, then
``NotApplied(retry=True)``; 409 ``idempotency_key_in_use``, the tool waits and sends again
(up to ``in_progress_wait``), then :class:`StripeOutcomeUnknown`, and until the object
shows, a lookup in this process raises rather than answer "not found"; 400
``idempotency_error`` (the key was used with other parameters), a 5xx, a timeout or a lost
connection: :class:`StripeOutcomeUnknown`, ambiguous, settled by the lookup. Every send
and lookup records what it asked, what it saw and Stripe's ``Request-Id`` with
``ctx.observe`` (the evidence kept if the call becomes unknown).
"""

from __future__ import annotations

import datetime as dt
import threading
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

from runledger.flows import Flow, NotApplied, Receipt, Tool, ToolContext
from runledger.providers.base import KEY_FIELD, Retention, landing_wait, retry_after, wait_landing

try:
    import stripe
except ImportError as exc:  # pragma: no cover - depends on the environment
    raise ImportError(
        'runledger.providers.stripe needs the Stripe SDK: pip install "stripe>=16,<17"'
    ) from exc

__all__ = [
    "CLOCK_SKEW",
    "RETENTION",
    "SEARCH_LAG",
    "StripeConfigError",
    "StripeOutcomeUnknown",
    "customers",
    "payment_intents",
    "refunds",
]

# "Keys are eligible to be removed from the system automatically after they're at least
# 24 hours old, and a new request is generated if a key is reused after the original has
# been pruned." (docs.stripe.com/idempotency)
RETENTION = Retention(dt.timedelta(hours=24), name="Stripe")

# "Under normal operating conditions, data is searchable in less than a minute.
# Occasionally, propagation of new or updated data can be up to an hour behind during
# outages." (docs.stripe.com/api/payment_intents/search)
SEARCH_LAG = dt.timedelta(hours=1)
# how long after a send a request the client gave up on may still reach Stripe and run:
# before then "not found" is no answer (the worker takes it for certain: after the last
# attempt the call fails, and a policy that tries again with a new call pays twice)
LANDING = 60.0

# Stripe's clock (an object's ``created``) against the database's (``ctx.first_sent_at``)
CLOCK_SKEW = dt.timedelta(minutes=5)

# the least lease time left for another send after a wait (429, 409)
_SEND_RESERVE = 2.0


class StripeConfigError(ValueError):
    """The Stripe tools cannot be built as asked (one line says why)."""


class StripeOutcomeUnknown(Exception):
    """Stripe's answer does not say whether the object was created: the call is ambiguous
    and settled by its lookup."""


@dataclass(frozen=True, slots=True)
class _Kind:
    object: str  # Stripe's "object" value
    path: str  # the collection's path
    service: str  # the attribute of client.v1
    searchable: bool
    fields: tuple[str, ...]  # what the receipt keeps besides id and object


_PAYMENT_INTENT = _Kind(
    "payment_intent",
    "/v1/payment_intents",
    "payment_intents",
    True,
    ("status", "amount", "currency", "customer", "livemode", "created"),
)
_REFUND = _Kind(
    "refund",
    "/v1/refunds",
    "refunds",
    False,
    ("status", "amount", "currency", "payment_intent", "charge", "created"),
)
_CUSTOMER = _Kind(
    "customer", "/v1/customers", "customers", True, ("email", "name", "livemode", "created")
)


# -- building the tools --------------------------------------------------------------------


@dataclass(frozen=True, slots=True, kw_only=True)
class _Settings:
    kind: _Kind
    service: Any  # the SDK's service (client.v1.<name>)
    retention: Retention
    search: bool
    search_lag: dt.timedelta
    max_waits: int
    in_progress_wait: float
    landing: float


def _settings(
    flow: Flow,
    client: Any,
    kind: _Kind,
    *,
    retention: Retention,
    search: bool,
    search_lag: dt.timedelta,
    max_waits: int,
    in_progress_wait: float,
    landing: float,
) -> _Settings:
    if not isinstance(flow, Flow):
        raise StripeConfigError(f"the Stripe tools register on a runledger.Flow, got {flow!r}")
    if not isinstance(client, stripe.StripeClient):
        raise StripeConfigError(
            "the Stripe tools need a stripe.StripeClient (stripe>=16), "
            f"got {type(client).__name__}: stripe.StripeClient('sk_...')"
        )
    if search_lag < dt.timedelta(0) or max_waits < 0 or not in_progress_wait >= 0:
        raise StripeConfigError("search_lag, max_waits and in_progress_wait must not be negative")
    if not landing >= 0:
        raise StripeConfigError(f"landing must be 0 or more seconds, got {landing!r}")
    return _Settings(
        kind=kind,
        service=getattr(client.v1, kind.service),
        retention=retention,
        search=search and kind.searchable,
        search_lag=search_lag,
        max_waits=max_waits,
        in_progress_wait=in_progress_wait,
        landing=landing,
    )


def _register(flow: Flow, fn: Callable[..., Receipt], s: _Settings, **tool: Any) -> Tool[Any]:
    registered: Tool[Any] = flow.tool(safety="lookup", **tool)(fn)

    def find(ctx: ToolContext) -> dict[str, Any] | None:
        return _lookup(ctx, s)

    find.__doc__ = f"Find the {s.kind.object} whose metadata[{KEY_FIELD}] is the call's key."
    registered.lookup(find)
    return registered


def payment_intents(
    flow: Flow,
    client: Any,
    *,
    name: str = "create_payment_intent",
    timeout: float | None = None,
    max_attempts: int = 3,
    retention: Retention = RETENTION,
    search: bool = True,
    search_lag: dt.timedelta = SEARCH_LAG,
    max_waits: int = 3,
    in_progress_wait: float = 60.0,
    landing: float = LANDING,
) -> Tool[Any]:
    """Register the tool ``name`` that creates a PaymentIntent (``POST /v1/payment_intents``)
    with its lookup (Search, then the list of the last ``search_lag``); returns it.

    ``search=False``: the lookup lists only (where Search is unavailable, e.g. India).
    ``max_waits``: how often one send waits ``Retry-After`` and sends again after a 429;
    ``in_progress_wait``: how long (seconds, within the lease) it keeps sending again
    while Stripe answers 409 ``idempotency_key_in_use``; ``landing``: how long after a
    send the lookup waits before it answers "not found" (that send may still run)."""
    s = _settings(
        flow,
        client,
        _PAYMENT_INTENT,
        retention=retention,
        search=search,
        search_lag=search_lag,
        max_waits=max_waits,
        in_progress_wait=in_progress_wait,
        landing=landing,
    )

    def create_payment_intent(
        ctx: ToolContext,
        amount: int,
        currency: str,
        customer: str | None = None,
        description: str | None = None,
        payment_method: str | None = None,
        confirm: bool = False,
        receipt_email: str | None = None,
        metadata: dict[str, str] | None = None,
    ) -> Receipt:
        """Create a Stripe PaymentIntent: amount in the currency's smallest unit (cents),
        a three-letter ISO currency code; confirm=true with a payment_method charges it."""
        params = {
            "amount": amount,
            "currency": currency,
            "customer": customer,
            "description": description,
            "payment_method": payment_method,
            "confirm": confirm or None,
            "receipt_email": receipt_email,
        }
        return _send(ctx, s, params, metadata)

    return _register(
        flow, create_payment_intent, s, name=name, timeout=timeout, max_attempts=max_attempts
    )


def refunds(
    flow: Flow,
    client: Any,
    *,
    name: str = "create_refund",
    timeout: float | None = None,
    max_attempts: int = 3,
    retention: Retention = RETENTION,
    max_waits: int = 3,
    in_progress_wait: float = 60.0,
    landing: float = LANDING,
) -> Tool[Any]:
    """Register the tool ``name`` that refunds a PaymentIntent or a charge
    (``POST /v1/refunds``) with its lookup (``GET /v1/refunds?created[gte]=``, from the
    key's first send); returns it."""
    s = _settings(
        flow,
        client,
        _REFUND,
        retention=retention,
        search=False,
        search_lag=SEARCH_LAG,
        max_waits=max_waits,
        in_progress_wait=in_progress_wait,
        landing=landing,
    )

    def create_refund(
        ctx: ToolContext,
        payment_intent: str | None = None,
        charge: str | None = None,
        amount: int | None = None,
        reason: str | None = None,
        metadata: dict[str, str] | None = None,
    ) -> Receipt:
        """Refund a Stripe payment, given its payment_intent (pi_...) or charge (ch_...);
        amount (smallest currency unit) refunds part of it; reason: duplicate,
        fraudulent or requested_by_customer."""
        if (payment_intent is None) == (charge is None):
            raise NotApplied("a refund needs exactly one of payment_intent and charge")
        params = {
            "payment_intent": payment_intent,
            "charge": charge,
            "amount": amount,
            "reason": reason,
        }
        return _send(ctx, s, params, metadata)

    return _register(flow, create_refund, s, name=name, timeout=timeout, max_attempts=max_attempts)


def customers(
    flow: Flow,
    client: Any,
    *,
    name: str = "create_customer",
    timeout: float | None = None,
    max_attempts: int = 3,
    retention: Retention = RETENTION,
    search: bool = True,
    search_lag: dt.timedelta = SEARCH_LAG,
    max_waits: int = 3,
    in_progress_wait: float = 60.0,
    landing: float = LANDING,
) -> Tool[Any]:
    """Register the tool ``name`` that creates a Customer (``POST /v1/customers``) with its
    lookup (Search, then the list of the last ``search_lag``); returns it."""
    s = _settings(
        flow,
        client,
        _CUSTOMER,
        retention=retention,
        search=search,
        search_lag=search_lag,
        max_waits=max_waits,
        in_progress_wait=in_progress_wait,
        landing=landing,
    )

    def create_customer(
        ctx: ToolContext,
        email: str | None = None,
        name: str | None = None,
        description: str | None = None,
        phone: str | None = None,
        metadata: dict[str, str] | None = None,
    ) -> Receipt:
        """Create a Stripe Customer with an email, a name, a description, a phone."""
        params = {"email": email, "name": name, "description": description, "phone": phone}
        return _send(ctx, s, params, metadata)

    return _register(
        flow, create_customer, s, name=name, timeout=timeout, max_attempts=max_attempts
    )


# -- sending --------------------------------------------------------------------------------


def _metadata(given: Mapping[str, Any] | None, key: str) -> dict[str, str]:
    """The caller's metadata with the key under ``runledger_key`` (which it overrides)."""
    if given is not None and not isinstance(given, Mapping):
        raise NotApplied(f"metadata must be an object of strings, got {type(given).__name__}")
    return {**{str(k): str(v) for k, v in (given or {}).items()}, KEY_FIELD: key}


def _send(
    ctx: ToolContext, s: _Settings, params: dict[str, Any], metadata: Mapping[str, Any] | None
) -> Receipt:
    """Create the object with the call's key; retry 429 and 409 within the lease."""
    body = {k: v for k, v in params.items() if v is not None}
    body["metadata"] = _metadata(metadata, ctx.idempotency_key)
    # the SDK's own retries off: this loop decides, and records each answer
    options = {"idempotency_key": ctx.idempotency_key, "max_network_retries": 0}
    asked = f"POST {s.kind.path}"
    waits = busy = 0
    give_up = time.monotonic() + s.in_progress_wait
    while True:
        try:
            created = s.service.create(params=body, options=options)
        except stripe.RateLimitError as exc:  # 429: not executed, nothing saved
            wait = retry_after(exc.headers or {}, default=1.0)
            _observe_error(ctx, asked, exc, retry_after_s=wait)
            if waits < s.max_waits and _room(ctx, wait):
                waits += 1
                time.sleep(wait)
                continue
            raise NotApplied(
                f"Stripe rate-limited {asked} ({_said(exc)}); sent again later with the same key",
                retry=True,
            ) from exc
        except stripe.IdempotencyError as exc:
            # the key's first request executed with other parameters: that request's
            # object may exist, this one's never will
            _observe_error(ctx, asked, exc)
            raise StripeOutcomeUnknown(
                f"Stripe refused {asked}: the key was used with other parameters "
                f"({_said(exc)}); the lookup finds what the first use created"
            ) from exc
        except (stripe.CardError, stripe.InvalidRequestError) as exc:  # 402, 400, 404
            _observe_error(ctx, asked, exc)
            raise NotApplied(f"Stripe refused {asked}: {_said(exc)}") from exc
        except (stripe.AuthenticationError, stripe.PermissionError) as exc:  # 401, 403
            _observe_error(ctx, asked, exc)
            raise NotApplied(
                f"Stripe refused {asked}: {_said(exc)} (check the client's API key)"
            ) from exc
        except stripe.APIError as exc:
            _observe_error(ctx, asked, exc)
            if exc.http_status == 409 and _code(exc) == "idempotency_key_in_use":
                # the key's first request is executing: its answer will be replayed
                _EXECUTING.saw(ctx.idempotency_key)
                wait = min(0.25 * 2**busy, 2.0)
                if time.monotonic() + wait < give_up and _room(ctx, wait):
                    busy += 1
                    time.sleep(wait)
                    continue
            raise StripeOutcomeUnknown(f"Stripe answered {asked} with {_said(exc)}") from exc
        except stripe.StripeError as exc:  # a lost connection, a timeout, anything else
            _observe_error(ctx, asked, exc)
            raise StripeOutcomeUnknown(f"no answer from Stripe to {asked}: {exc}") from exc
        _EXECUTING.forget(ctx.idempotency_key)
        receipt = _receipt(s.kind, _plain(created), _request_id(created))
        response = getattr(created, "last_response", None)
        ctx.observe(
            asked=asked,
            saw=receipt["id"],
            request_id=receipt.get("request_id"),
            status=getattr(response, "code", None),
            replayed=_header(response, "idempotent-replayed") == "true",
        )
        return Receipt(result=receipt, receipt=receipt)


def _room(ctx: ToolContext, wait: float) -> bool:
    return wait + _SEND_RESERVE < ctx.remaining()


def _code(exc: stripe.StripeError) -> str | None:
    err = exc.error
    code = getattr(err, "code", None) if err is not None else None
    return code if isinstance(code, str) else exc.code


def _said(exc: stripe.StripeError) -> str:
    parts = [str(exc.http_status) if exc.http_status is not None else "no status"]
    if (code := _code(exc)) is not None:
        parts.append(code)
    if exc.request_id:
        parts.append(f"request {exc.request_id}")
    message = exc.user_message
    return ", ".join(parts) + (f": {message}" if message else "")


def _observe_error(ctx: ToolContext, asked: str, exc: stripe.StripeError, **more: Any) -> None:
    headers = exc.headers or {}
    ctx.observe(
        asked=asked,
        saw=type(exc).__name__,
        status=exc.http_status,
        code=_code(exc),
        request_id=exc.request_id,
        replayed=_header_of(headers, "idempotent-replayed") == "true",
        **more,
    )


def _header_of(headers: Mapping[str, str], name: str) -> str | None:
    return next((v for k, v in headers.items() if k.lower() == name), None)


def _header(response: Any, name: str) -> str | None:
    headers = getattr(response, "headers", None)
    return None if headers is None else _header_of(headers, name)


def _request_id(obj: Any) -> str | None:
    response = getattr(obj, "last_response", None)
    rid = getattr(response, "request_id", None)
    return rid if isinstance(rid, str) else None


def _plain(obj: Any) -> dict[str, Any]:
    data = obj.to_dict(for_json=True) if hasattr(obj, "to_dict") else obj
    if not isinstance(data, dict):
        raise StripeOutcomeUnknown(f"Stripe answered with {type(obj).__name__}, not an object")
    return data


def _receipt(
    kind: _Kind, data: Mapping[str, Any], request_id: str | None, **more: Any
) -> dict[str, Any]:
    receipt: dict[str, Any] = {"id": data.get("id"), "object": data.get("object", kind.object)}
    receipt.update((f, data[f]) for f in kind.fields if f in data)
    receipt[KEY_FIELD] = (data.get("metadata") or {}).get(KEY_FIELD)
    if request_id is not None:
        receipt["request_id"] = request_id
    receipt.update(more)
    return receipt


class _Executing:
    """Keys this process saw Stripe still executing (409 ``idempotency_key_in_use``), and
    when: until the object is found or sent, a lookup does not take "nothing found" for
    "not created" (a resend would be answered 409 again, and once the tool's attempts
    are spent the call would fail while its request may still create the object)."""

    def __init__(self, ttl: float = 900.0) -> None:
        self.ttl = ttl
        self.seen: dict[str, float] = {}
        self.lock = threading.Lock()

    def saw(self, key: str) -> None:
        with self.lock:
            now = time.monotonic()
            self.seen = {k: t for k, t in self.seen.items() if now - t < self.ttl}
            self.seen[key] = now

    def forget(self, key: str) -> None:
        with self.lock:
            self.seen.pop(key, None)

    def recent(self, key: str) -> bool:
        with self.lock:
            t = self.seen.get(key)
            return t is not None and time.monotonic() - t < self.ttl


_EXECUTING = _Executing()


# -- the lookup -----------------------------------------------------------------------------


def _quote(value: str) -> str:
    """A string value of Stripe's search query language: quoted, ``\\`` and ``'``
    escaped."""
    return "'" + value.replace("\\", "\\\\").replace("'", "\\'") + "'"


def _keyed(data: Mapping[str, Any], key: str) -> bool:
    return (data.get("metadata") or {}).get(KEY_FIELD) == key


def _lookup(ctx: ToolContext, s: _Settings) -> dict[str, Any] | None:
    """The object created with ``ctx.idempotency_key``, else ``None`` within the window,
    else :class:`runledger.Unknowable`. Stripe errors propagate: the lookup failed."""
    key = ctx.idempotency_key
    now = ctx.now()  # the database's clock, as first_sent_at is
    first = ctx.first_sent_at or ctx.sent_at or now - s.retention.window
    asked: list[str] = []
    since = first
    if s.search:
        query = f"metadata[{_quote(KEY_FIELD)}]:{_quote(key)}"
        what = f"GET {s.kind.path}/search query={query}"
        asked.append(what)
        result = _read(ctx, what, lambda: s.service.search(params={"query": query, "limit": 10}))
        hits = [d for d in (_plain(o) for o in result.data) if _keyed(d, key)]
        ctx.observe(
            asked=what, saw=[d.get("id") for d in hits], request_id=_request_id(result), status=200
        )
        if hits:
            _EXECUTING.forget(key)
            return _found(s.kind, hits, _request_id(result), "search")
        # Search may not show yet what was created in the last search_lag: list that part
        since = max(first, now - s.search_lag)
    gte = int((since - CLOCK_SKEW).timestamp())
    what = f"GET {s.kind.path}?created[gte]={gte}"
    asked.append(what)
    page = _read(ctx, what, lambda: s.service.list(params={"created": {"gte": gte}, "limit": 100}))
    hits, scanned = [], 0
    for obj in page.auto_paging_iter():
        scanned += 1
        data = _plain(obj)
        if _keyed(data, key):
            hits.append(data)
    ctx.observe(
        asked=what,
        saw=[d.get("id") for d in hits],
        scanned=scanned,
        request_id=_request_id(page),
        status=200,
    )
    if hits:
        _EXECUTING.forget(key)
        return _found(s.kind, hits, _request_id(page), "list")
    if _EXECUTING.recent(key):
        # this process saw Stripe executing the key's first request (409): it may yet
        # create the object, so "not found" is not an answer; asked again later
        raise StripeOutcomeUnknown(
            f"nothing found for key {key} yet, but Stripe was still executing a request "
            "with it (409 idempotency_key_in_use): asking again later"
        )
    if landing_wait(ctx, s.landing) > 0:
        # the last send may still reach Stripe and run: asked again once it cannot
        wait_landing(ctx, s.landing)
        return _lookup(ctx, s)
    s.retention.not_found(ctx, asked=asked, saw="nothing")  # Unknowable past the window
    return None


def _read(ctx: ToolContext, what: str, read: Callable[[], Any]) -> Any:
    try:
        return read()
    except stripe.StripeError as exc:
        _observe_error(ctx, what, exc)
        raise


def _found(
    kind: _Kind, hits: list[dict[str, Any]], request_id: str | None, how: str
) -> dict[str, Any]:
    """The receipt of the oldest object with the key; any other is named (a duplicate
    made past Stripe's window, or by a client that reused the key)."""
    hits = sorted(hits, key=lambda d: (d.get("created") or 0, str(d.get("id"))))
    receipt = _receipt(kind, hits[0], request_id, found_by=how)
    if len(hits) > 1:
        receipt["others"] = [d.get("id") for d in hits[1:]]
    return receipt
