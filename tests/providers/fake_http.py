"""A local orders API that implements the IETF ``Idempotency-Key`` header draft
(draft-ietf-httpapi-idempotency-key-header) the way providers do, in a thread:

- ``POST /orders`` with ``Idempotency-Key``: creates an order (an *effect*, recorded per
  key) and answers ``201`` with it and a ``Location``; the same key again, with the same
  body, replays the first answer (``Idempotent-Replayed: true``), with another body
  answers ``422``; while the first request with the key is still being processed,
  ``409``; no key: ``400``. A key is kept ``retention`` seconds by the server's clock
  (``advance()`` moves it);
- ``GET /orders?idempotency_key=K``: a JSON list of the orders the key created;
  ``GET /orders/by-key/K``: the order, or ``404``.

Faults, taken one per ``POST`` from the queue ``script()`` fills: ``429`` (with
``Retry-After``), ``500_before`` (no effect), ``500_after`` (the effect, then a 500),
``slow_500`` (a pause, then a 500 and no effect), ``late`` (the server holds the request
past the client's timeout, then creates the order: a request that lands after the
client gave up), ``ok``.
"""

from __future__ import annotations

import contextlib
import json
import threading
import time
import urllib.parse
from collections import deque
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any


class OrdersApi:
    def __init__(self, *, retention: float = 86400.0, late_delay: float = 1.0) -> None:
        self.retention = retention
        self.late_delay = late_delay
        self.lock = threading.Lock()
        self.offset = 0.0  # the server clock's lead over time.time()
        self.faults: deque[str] = deque()
        self.orders: dict[str, list[dict[str, Any]]] = {}  # key -> the orders it created
        self.answers: dict[str, tuple[float, str, int, dict[str, Any]]] = {}
        self.busy: set[str] = set()
        self.requests: list[tuple[str, str, str | None]] = []  # method, path, key
        self.posted: list[tuple[str, float]] = []  # key, time.monotonic() of each POST
        self.landed = threading.Event()  # set when a "late" request created its order
        self._ids = 0
        api = self

        class Handler(BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"

            def log_message(self, format: str, *args: Any) -> None:  # quiet
                pass

            def _answer(
                self, status: int, body: Any, headers: dict[str, str] | None = None
            ) -> None:
                data = json.dumps(body).encode()
                self.send_response(status)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(data)))
                with api.lock:
                    api._ids += 1
                    rid = f"req_{api._ids}"
                self.send_header("Request-Id", rid)
                for name, value in (headers or {}).items():
                    self.send_header(name, value)
                self.end_headers()
                with contextlib.suppress(BrokenPipeError, ConnectionResetError):
                    self.wfile.write(data)  # unless the client gave up

            def do_GET(self) -> None:
                url = urllib.parse.urlsplit(self.path)
                api.requests.append(("GET", url.path, None))
                if url.path == "/orders":
                    key = urllib.parse.parse_qs(url.query).get("idempotency_key", [""])[0]
                    with api.lock:
                        found = list(api.orders.get(key, []))
                    self._answer(200, found)
                    return
                if url.path.startswith("/orders/by-key/"):
                    key = urllib.parse.unquote(url.path.removeprefix("/orders/by-key/"))
                    with api.lock:
                        found = list(api.orders.get(key, []))
                    if found:
                        self._answer(200, found[0])
                    else:
                        self._answer(404, {"error": "not found"})
                    return
                self._answer(404, {"error": "no such path"})

            def do_POST(self) -> None:
                length = int(self.headers.get("Content-Length", "0"))
                body = json.loads(self.rfile.read(length) or b"null")
                key = self.headers.get("Idempotency-Key")
                api.requests.append(("POST", self.path, key))
                api.posted.append((key or "", time.monotonic()))
                if self.path != "/orders":
                    self._answer(404, {"error": "no such path"})
                    return
                if not key:
                    self._answer(400, {"error": "Idempotency-Key is required"})
                    return
                with api.lock:
                    now = api.now()
                    kept = api.answers.get(key)
                    if kept is not None and now - kept[0] >= api.retention:
                        del api.answers[key]  # the key expired: a new request
                        kept = None
                    if kept is not None:
                        if kept[1] != json.dumps(body, sort_keys=True):
                            answer: tuple[int, Any, dict[str, str]] = (
                                422,
                                {"error": "the key was used with another body"},
                                {},
                            )
                        else:
                            answer = (kept[2], kept[3], {"Idempotent-Replayed": "true"})
                    elif key in api.busy:
                        answer = (409, {"error": "a request with this key is in progress"}, {})
                    else:
                        api.busy.add(key)
                        answer = (0, None, {})
                if answer[0]:
                    self._answer(*answer)
                    return
                fault = api.faults.popleft() if api.faults else "ok"
                try:
                    self._process(key, body, fault)
                finally:
                    with api.lock:
                        api.busy.discard(key)

            def _process(self, key: str, body: Any, fault: str) -> None:
                if fault == "429":
                    self._answer(429, {"error": "slow down"}, {"Retry-After": "0.2"})
                    return
                if fault == "500_before":
                    self._answer(500, {"error": "internal"})
                    return
                if fault == "slow_500":
                    time.sleep(api.late_delay)
                    self._answer(500, {"error": "internal"})
                    return
                if fault == "late":
                    time.sleep(api.late_delay)  # the client has given up by now
                order = api._create(key, body, late=fault == "late")
                if fault == "500_after":
                    self._answer(500, {"error": "internal"})
                    return
                self._answer(201, order, {"Location": f"/orders/{order['id']}"})

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.server.daemon_threads = True
        self.thread = threading.Thread(target=self.server.serve_forever, daemon=True)

    def _create(self, key: str, body: Any, *, late: bool = False) -> dict[str, Any]:
        with self.lock:  # a lookup that finds the order finds ``landed`` set
            if late:
                self.landed.set()
            self._ids += 1
            order = {"id": f"ord_{self._ids}", "body": body, "idempotency_key": key}
            self.orders.setdefault(key, []).append(order)
            self.answers[key] = (self.now(), json.dumps(body, sort_keys=True), 201, order)
        return order

    # -- for the tests ----------------------------------------------------------------

    @property
    def url(self) -> str:
        host, port = self.server.server_address[:2]
        return f"http://{host!s}:{port}"

    def now(self) -> float:
        return time.time() + self.offset

    def advance(self, seconds: float) -> None:
        with self.lock:
            self.offset += seconds

    def script(self, *faults: str) -> None:
        self.faults.extend(faults)

    def effects(self, key: str) -> int:
        with self.lock:
            return len(self.orders.get(key, []))

    def posts(self, key: str) -> int:
        return sum(1 for m, _, k in self.requests if m == "POST" and k == key)

    def __enter__(self) -> OrdersApi:
        self.thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.server.shutdown()
        self.server.server_close()
