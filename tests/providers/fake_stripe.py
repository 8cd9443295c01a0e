"""A local Stripe: the endpoints the Stripe tools use, as docs.stripe.com documents them.

``FakeStripe()`` serves HTTP on 127.0.0.1 in a thread (``.url``; point the official SDK
at it with ``StripeClient(key, base_addresses={"api": fake.url})``):

- ``POST /v1/payment_intents``, ``/v1/refunds``, ``/v1/customers``: form-encoded
  (``metadata[k]=v``), Stripe-shaped objects (``object``, ``id``, ``metadata``,
  ``created``). Idempotency as Stripe documents it: the first response of a key is saved
  once the endpoint began executing (a 500 too) and replayed to any repeat with
  ``Idempotent-Replayed: true``; a repeat while the first is executing gets 409
  ``idempotency_key_in_use``; a repeat with other parameters 400 ``idempotency_error``;
  validation errors and 429s save nothing. Keys are kept 24 hours by :attr:`clock`, which
  a test moves (``clock.advance``).
- ``GET /v1/payment_intents/search``, ``/v1/customers/search``: the query language's
  subset ``metadata['k']:'v'`` and ``field:'v'`` clauses joined by ``AND``. An object is
  searchable ``index_delay`` seconds (by :attr:`clock`) after it was created: eventual
  consistency, off by default.
- ``GET /v1/payment_intents``, ``/v1/customers``, ``/v1/refunds``: lists, newest first,
  ``created[gte|gt|lte|lt]``, ``limit``, ``starting_after``, and ``payment_intent`` /
  ``charge`` for refunds; always consistent.
- Every answer has a ``Request-Id``; errors are ``{"error": {type, code, message}}``.

Switches, each for the next POST to a path: :meth:`rate_limit` (429 with ``Retry-After``),
:meth:`conflict` (409 ``idempotency_key_in_use``), :meth:`server_error` (500, the effect
applied or not, saved under the key), :meth:`hold` (no answer until released: the effect
applied before, after -- a request that lands after the client gave up -- or never).
A confirmed PaymentIntent with ``payment_method=pm_card_chargeDeclined`` is declined
(402 ``card_declined``), as in Stripe's test mode. :meth:`effects` lists the objects
created under a key.
"""

from __future__ import annotations

import itertools
import json
import re
import secrets
import threading
import time
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any
from urllib.parse import parse_qsl, urlsplit

KEY_TTL = 24 * 3600.0  # "at least 24 hours old" (docs.stripe.com/idempotency)
CREATE = {"/v1/payment_intents": "pi", "/v1/refunds": "re", "/v1/customers": "cus"}
SEARCH = {
    "/v1/payment_intents/search": "/v1/payment_intents",
    "/v1/customers/search": "/v1/customers",
}
OBJECT = {
    "/v1/payment_intents": "payment_intent",
    "/v1/refunds": "refund",
    "/v1/customers": "customer",
}


class Clock:
    """Real time plus an offset a test moves forward."""

    def __init__(self) -> None:
        self.offset = 0.0

    def now(self) -> float:
        return time.time() + self.offset

    def advance(self, seconds: float) -> None:
        self.offset += seconds


class StripeFailure(Exception):
    def __init__(
        self,
        status: int,
        type_: str,
        message: str,
        code: str | None = None,
        headers: dict[str, str] | None = None,
        **more: Any,
    ) -> None:
        super().__init__(message)
        self.status = status
        self.headers = headers or {}
        self.body = {
            "error": {"type": type_, "message": message, **({"code": code} if code else {}), **more}
        }


@dataclass
class Hold:
    """A request the server holds without answering until :meth:`release`."""

    apply: str  # "before" | "after" | "never"
    arrived: threading.Event = field(default_factory=threading.Event)
    released: threading.Event = field(default_factory=threading.Event)
    done: threading.Event = field(default_factory=threading.Event)
    key: str | None = None

    def release(self) -> None:
        self.released.set()


@dataclass
class _Fault:
    kind: str  # rate_limit | conflict | server_error | hold
    retry_after: str | None = None
    applied: bool = False
    hold: Hold | None = None


@dataclass
class _KeyRecord:
    path: str
    params: dict[str, Any]
    at: float
    state: str = "executing"  # executing | done
    status: int = 0
    body: dict[str, Any] | None = None
    request_id: str = ""


def decode_form(pairs: list[tuple[str, str]]) -> dict[str, Any]:
    """``a[b][c]=v`` pairs into nested dicts (Stripe's form encoding)."""
    out: dict[str, Any] = {}
    for name, value in pairs:
        parts = re.findall(r"[^\[\]]+", name)
        node = out
        for p in parts[:-1]:
            node = node.setdefault(p, {})
        node[parts[-1]] = value
    return out


_CLAUSE = re.compile(
    r"\s*(?:metadata\[(?P<mk>'(?:[^'\\]|\\.)*')\]|(?P<f>[a-z_]+))\s*:\s*(?P<v>'(?:[^'\\]|\\.)*')\s*"
)


def _unquote(s: str) -> str:
    return re.sub(r"\\(.)", r"\1", s[1:-1])


def parse_query(query: str) -> list[tuple[str, str]]:
    """Stripe search clauses ``(field, value)``; ``metadata.k`` for metadata. Raises
    ``ValueError`` on what the fake does not speak."""
    clauses = []
    for part in re.split(r"\s+AND\s+", query.strip()):
        m = _CLAUSE.fullmatch(part)
        if m is None:
            raise ValueError(part)
        name = f"metadata.{_unquote(m['mk'])}" if m["mk"] else m["f"]
        clauses.append((name, _unquote(m["v"])))
    return clauses


class FakeStripe:
    def __init__(self, api_key: str = "sk_test_fake") -> None:
        self.api_key = api_key
        self.clock = Clock()
        self.index_delay = 0.0  # seconds after creation before search shows an object
        self.lock = threading.RLock()
        self.keys: dict[str, _KeyRecord] = {}
        self.objects: dict[str, list[dict[str, Any]]] = {p: [] for p in CREATE}
        self.indexed_at: dict[str, float] = {}
        self._effects: dict[str, list[dict[str, Any]]] = {}
        self.faults: dict[str, list[_Fault]] = {}
        self.log: list[dict[str, Any]] = []  # every request: method, path, key, status
        self.holds: list[Hold] = []
        self._ids = itertools.count(1)
        self.server = ThreadingHTTPServer(("127.0.0.1", 0), self._handler())
        self.server.daemon_threads = True
        self.thread = threading.Thread(target=self.server.serve_forever, daemon=True)
        self.thread.start()
        host, port = self.server.server_address[:2]
        self.url = f"http://{host!s}:{port}"

    def close(self) -> None:
        for h in self.holds:
            h.release()
        self.server.shutdown()
        self.server.server_close()

    # -- what a test reads and switches ---------------------------------------------------

    def effects(self, key: str) -> list[dict[str, Any]]:
        """The objects created under Idempotency-Key ``key`` (replays are not effects)."""
        with self.lock:
            return list(self._effects.get(key, []))

    def all_effects(self) -> dict[str, list[dict[str, Any]]]:
        """Every key's objects."""
        with self.lock:
            return {k: list(v) for k, v in self._effects.items()}

    def requests(self, key: str | None = None, status: int | None = None) -> list[dict[str, Any]]:
        with self.lock:
            return [
                r
                for r in self.log
                if (key is None or r["key"] == key) and (status is None or r["status"] == status)
            ]

    def rate_limit(self, path: str, times: int = 1, retry_after: str = "1") -> None:
        self._add(path, [_Fault("rate_limit", retry_after=retry_after) for _ in range(times)])

    def conflict(self, path: str, times: int = 1) -> None:
        self._add(path, [_Fault("conflict") for _ in range(times)])

    def server_error(self, path: str, applied: bool, times: int = 1) -> None:
        self._add(path, [_Fault("server_error", applied=applied) for _ in range(times)])

    def hold(self, path: str, apply: str = "after") -> Hold:
        assert apply in ("before", "after", "never")
        h = Hold(apply)
        self.holds.append(h)
        self._add(path, [_Fault("hold", hold=h)])
        return h

    def _add(self, path: str, faults: list[_Fault]) -> None:
        with self.lock:
            self.faults.setdefault(path, []).extend(faults)

    # -- the API --------------------------------------------------------------------------

    def _handler(self) -> type[BaseHTTPRequestHandler]:
        fake = self

        class Handler(BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"

            def log_message(self, format: str, *args: Any) -> None:
                pass

            def do_GET(self) -> None:
                self._serve("GET")

            def do_POST(self) -> None:
                self._serve("POST")

            def _serve(self, method: str) -> None:
                rid = "req_" + secrets.token_hex(7)
                url = urlsplit(self.path)
                length = int(self.headers.get("Content-Length") or 0)
                raw = self.rfile.read(length).decode() if length else ""
                key = self.headers.get("Idempotency-Key")
                extra: dict[str, str] = {}
                try:
                    if self.headers.get("Authorization") != f"Bearer {fake.api_key}":
                        raise StripeFailure(
                            401, "invalid_request_error", "Invalid API Key provided"
                        )
                    if method == "POST" and url.path in CREATE:
                        status, body, extra = fake._create(url.path, raw, key, rid)
                    elif method == "GET" and url.path in SEARCH:
                        status, body = 200, fake._search(url.path, url.query)
                    elif method == "GET" and url.path in CREATE:
                        status, body = 200, fake._list(url.path, url.query)
                    else:
                        raise StripeFailure(
                            404,
                            "invalid_request_error",
                            f"Unrecognized request URL ({method}: {url.path})",
                        )
                except StripeFailure as f:
                    status, body = f.status, f.body
                    extra = f.headers
                with fake.lock:
                    fake.log.append(
                        {
                            "method": method,
                            "path": url.path,
                            "key": key,
                            "status": status,
                            "request_id": rid,
                        }
                    )
                if status is None:  # held, and the client is gone
                    return
                data = json.dumps(body).encode()
                try:
                    self.send_response(status)
                    self.send_header("Content-Type", "application/json")
                    self.send_header("Content-Length", str(len(data)))
                    self.send_header("Request-Id", rid)
                    if key:
                        self.send_header("Idempotency-Key", key)
                    for k, v in extra.items():
                        self.send_header(k, v)
                    self.end_headers()
                    self.wfile.write(data)
                except OSError:
                    pass  # the client gave up

        return Handler

    def _next_fault(self, path: str) -> _Fault | None:
        with self.lock:
            queue = self.faults.get(path) or []
            return queue.pop(0) if queue else None

    def _create(
        self, path: str, raw: str, key: str | None, rid: str
    ) -> tuple[Any, dict[str, Any], dict[str, str]]:
        params = decode_form(parse_qsl(raw, keep_blank_values=True))
        now = self.clock.now()
        with self.lock:
            if key is not None:
                rec = self.keys.get(key)
                if rec is not None and now - rec.at >= KEY_TTL:
                    del self.keys[key]  # pruned: a repeat is a new request
                    rec = None
                if rec is not None:
                    if rec.path != path or rec.params != params:
                        raise StripeFailure(
                            400,
                            "idempotency_error",
                            "Keys for idempotent requests can only be used with the same "
                            f"parameters they were first used with. Try using a key other than "
                            f"'{key}' if you meant to execute a different request.",
                        )
                    if rec.state == "executing":
                        raise StripeFailure(
                            409,
                            "idempotency_error",
                            "There is currently another in-progress request using this "
                            "Idempotent Key (that probably means you submitted twice, and the "
                            "other request is still going through): "
                            f"{key}. Please try again later.",
                            code="idempotency_key_in_use",
                        )
                    assert rec.body is not None
                    return (
                        rec.status,
                        rec.body,
                        {
                            "Idempotent-Replayed": "true",
                            "Original-Request": rec.request_id,
                        },
                    )
            fault = self._next_fault(path)
            if fault is not None and fault.kind == "rate_limit":
                raise StripeFailure(
                    429,
                    "invalid_request_error",
                    "Too many requests hit the API too quickly.",
                    code="rate_limit",
                    headers={"Retry-After": fault.retry_after or "1"},
                )
            if fault is not None and fault.kind == "conflict":
                raise StripeFailure(
                    409,
                    "idempotency_error",
                    "There is currently another in-progress request using this Idempotent Key: "
                    f"{key}.",
                    code="idempotency_key_in_use",
                )
            self._validate(path, params)  # a validation error saves nothing
            if key is not None:
                self.keys[key] = _KeyRecord(path, params, now, request_id=rid)
        hold = fault.hold if fault is not None and fault.kind == "hold" else None
        if hold is not None:
            hold.key = key
            if hold.apply == "before":
                status, body = self._execute(path, params, key)
                self._save(key, status, body)
            hold.arrived.set()
            hold.released.wait(120)
            if hold.apply == "after":
                status, body = self._execute(path, params, key)
                self._save(key, status, body)
            elif hold.apply == "never":
                with self.lock:
                    if key is not None:
                        self.keys.pop(key, None)  # never began executing: nothing saved
            hold.done.set()
            return None, {}, {}
        if fault is not None and fault.kind == "server_error":
            if fault.applied:
                self._execute(path, params, key)
            body = {"error": {"type": "api_error", "message": "An unknown error occurred"}}
            self._save(key, 500, body)
            return 500, body, {}
        status, body = self._execute(path, params, key)
        self._save(key, status, body)
        return status, body, {}

    def _save(self, key: str | None, status: int, body: dict[str, Any]) -> None:
        with self.lock:
            rec = self.keys.get(key) if key is not None else None
            if rec is not None:
                rec.state, rec.status, rec.body = "done", status, body

    def _validate(self, path: str, p: dict[str, Any]) -> None:
        def missing(name: str) -> StripeFailure:
            return StripeFailure(
                400,
                "invalid_request_error",
                f"Missing required param: {name}.",
                code="parameter_missing",
                param=name,
            )

        if path == "/v1/payment_intents":
            for name in ("amount", "currency"):
                if name not in p:
                    raise missing(name)
            if not p["amount"].isdigit() or int(p["amount"]) < 50:
                raise StripeFailure(
                    400,
                    "invalid_request_error",
                    "Amount must be at least $0.50 usd",
                    code="amount_too_small",
                    param="amount",
                )
        if path == "/v1/refunds":
            if "payment_intent" not in p and "charge" not in p:
                raise missing("payment_intent")
            pi = p.get("payment_intent")
            if pi is not None and self._find("/v1/payment_intents", pi) is None:
                raise StripeFailure(
                    400,
                    "invalid_request_error",
                    f"No such payment_intent: '{pi}'",
                    code="resource_missing",
                    param="payment_intent",
                )

    def _find(self, path: str, oid: str) -> dict[str, Any] | None:
        return next((o for o in self.objects[path] if o["id"] == oid), None)

    def _execute(self, path: str, p: dict[str, Any], key: str | None) -> tuple[int, dict[str, Any]]:
        """The endpoint runs: the object is created (an effect under the key)."""
        with self.lock:
            now = self.clock.now()
            oid = f"{CREATE[path]}_{next(self._ids):06d}{secrets.token_hex(4)}"
            obj: dict[str, Any] = {
                "id": oid,
                "object": OBJECT[path],
                "created": int(now),
                "livemode": False,
                "metadata": p.get("metadata", {}),
            }
            declined = False
            if path == "/v1/payment_intents":
                confirm = p.get("confirm") == "true"
                declined = confirm and p.get("payment_method") == "pm_card_chargeDeclined"
                paid = confirm and p.get("payment_method") is not None and not declined
                obj.update(
                    amount=int(p["amount"]),
                    currency=p["currency"].lower(),
                    customer=p.get("customer"),
                    description=p.get("description"),
                    payment_method=p.get("payment_method"),
                    status="succeeded" if paid else "requires_payment_method",
                    amount_received=int(p["amount"]) if paid else 0,
                    latest_charge=f"ch_{oid[3:]}" if paid else None,
                    last_payment_error={"code": "card_declined"} if declined else None,
                )
            elif path == "/v1/refunds":
                pi = (
                    self._find("/v1/payment_intents", p["payment_intent"])
                    if "payment_intent" in p
                    else None
                )
                obj.update(
                    amount=int(p["amount"]) if "amount" in p else (pi or {}).get("amount", 0),
                    currency=(pi or {}).get("currency", "usd"),
                    payment_intent=p.get("payment_intent"),
                    charge=p.get("charge") or (pi or {}).get("latest_charge"),
                    reason=p.get("reason"),
                    status="succeeded",
                )
            else:
                obj.update(
                    email=p.get("email"),
                    name=p.get("name"),
                    description=p.get("description"),
                    phone=p.get("phone"),
                )
            self.objects[path].append(obj)
            self.indexed_at[oid] = now + self.index_delay
            if key is not None:
                self._effects.setdefault(key, []).append(obj)
            if declined:
                return 402, {
                    "error": {
                        "type": "card_error",
                        "code": "card_declined",
                        "decline_code": "generic_decline",
                        "message": "Your card was declined.",
                        "payment_intent": obj,
                    }
                }
            return 200, obj

    def _search(self, path: str, query: str) -> dict[str, Any]:
        q = dict(parse_qsl(query, keep_blank_values=True))
        base = SEARCH[path]
        try:
            clauses = parse_query(q.get("query", ""))
        except ValueError as exc:
            raise StripeFailure(
                400, "invalid_request_error", f"Invalid query: could not parse {exc}", param="query"
            ) from None
        limit = int(q.get("limit", "10"))
        now = self.clock.now()
        with self.lock:
            found = [
                o
                for o in reversed(self.objects[base])
                if self.indexed_at[o["id"]] <= now and all(_matches(o, n, v) for n, v in clauses)
            ]
        return {
            "object": "search_result",
            "url": path,
            "has_more": len(found) > limit,
            "data": found[:limit],
            "next_page": None,
        }

    def _list(self, path: str, query: str) -> dict[str, Any]:
        q = decode_form(parse_qsl(query, keep_blank_values=True))
        limit = min(int(q.get("limit", "10")), 100)
        created = q.get("created", {})
        tests = {"gte": int.__ge__, "gt": int.__gt__, "lte": int.__le__, "lt": int.__lt__}
        with self.lock:
            found = [
                o
                for o in sorted(
                    self.objects[path], key=lambda o: (o["created"], o["id"]), reverse=True
                )
                if all(tests[op](o["created"], int(v)) for op, v in created.items())
                and all(
                    o.get(f) == q[f]
                    for f in ("payment_intent", "charge", "customer", "email")
                    if f in q
                )
            ]
        if "starting_after" in q:
            ids = [o["id"] for o in found]
            found = (
                found[ids.index(q["starting_after"]) + 1 :] if q["starting_after"] in ids else []
            )
        return {
            "object": "list",
            "url": path,
            "has_more": len(found) > limit,
            "data": found[:limit],
        }


def _matches(obj: dict[str, Any], name: str, value: str) -> bool:
    if name.startswith("metadata."):
        return (obj.get("metadata") or {}).get(name.removeprefix("metadata.")) == value
    return str(obj.get(name)) == value
