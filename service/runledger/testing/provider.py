"""A gated fake provider, run as its own process: the world your tools change.

Effects are keyed by idempotency key. It can deduplicate by key (an idempotent
provider) or not (``dedupe=False`` per request, or ``idempotent=False`` for all),
answer lookups ("did key K happen?"), refuse a request whose fencing token is lower
than one already seen for the key, and inject faults: apply the effect then fail the
response (the ambiguous case), fail before applying, hold a response at a gate, and
apply a request only ``arrival`` seconds after it came in (a request still on its way:
a lookup made meanwhile finds nothing, and the effect lands later).

A gate holds a call in flight. ``client.apply(key, kind, payload, token, gate="g1")``
applies the effect and then holds its response until ``client.open_gate("g1")``;
``client.wait_for_held("g1")`` returns once a request is being held there, so a test
knows the worker is mid-call (the effect exists, the journal does not know yet).
Gates stay open once opened, so a retry of the same call passes straight through.

    python -m runledger.testing.provider --port 8765

HTTP/JSON: ``POST /effects``, ``GET /effects[?key=K]``, ``POST /config``,
``GET /gates/<name>`` (``{"open", "held"}``), ``POST /gates/<name>`` (open),
``POST /reset``, ``GET /health``.

Tools reach it through :meth:`ProviderClient.from_env` (``RUNLEDGER_PROVIDER_URL``, which
the ``runledger_workers`` fixture sets for its workers).
"""

from __future__ import annotations

import argparse
import json
import os
import threading
import time
import urllib.error
import urllib.parse
import urllib.request
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any
from urllib.parse import parse_qs, unquote, urlparse


class ProviderError(Exception):
    """The provider answered with an error status (the effect may or may not exist)."""

    def __init__(self, status: int, body: dict[str, Any]) -> None:
        super().__init__(f"provider answered {status}: {body}")
        self.status = status
        self.body = body


@dataclass
class FakeProvider:
    """The provider's state; thread-safe."""

    idempotent: bool = True
    check_tokens: bool = False
    fail_after_apply: int = 0
    fail_before_apply: int = 0
    latency: float = 0.0
    arrival: float = 0.0  # s a request waits before it is applied (still on its way)
    effects: list[dict[str, Any]] = field(default_factory=list)
    max_token: dict[str, int] = field(default_factory=dict)
    gates: dict[str, threading.Event] = field(default_factory=dict)
    held: dict[str, int] = field(default_factory=dict)  # requests waiting at each gate
    lock: threading.Lock = field(default_factory=threading.Lock)

    def configure(self, settings: dict[str, Any]) -> dict[str, Any]:
        with self.lock:
            for name in (
                "idempotent",
                "check_tokens",
                "fail_after_apply",
                "fail_before_apply",
                "latency",
                "arrival",
            ):
                if name in settings:
                    setattr(self, name, type(getattr(self, name))(settings[name]))
            return self.config()

    def config(self) -> dict[str, Any]:
        return {
            "idempotent": self.idempotent,
            "check_tokens": self.check_tokens,
            "fail_after_apply": self.fail_after_apply,
            "fail_before_apply": self.fail_before_apply,
            "latency": self.latency,
            "arrival": self.arrival,
        }

    def reset(self) -> None:
        with self.lock:
            self.effects.clear()
            self.max_token.clear()
            for gate in self.gates.values():
                gate.set()
            self.gates.clear()
            self.held.clear()
            self.idempotent, self.check_tokens = True, False
            self.fail_after_apply = self.fail_before_apply = 0
            self.latency = self.arrival = 0.0

    def gate(self, name: str) -> threading.Event:
        with self.lock:
            return self.gates.setdefault(name, threading.Event())

    def gate_status(self, name: str) -> dict[str, Any]:
        with self.lock:
            event = self.gates.get(name)
            return {
                "gate": name,
                "open": bool(event and event.is_set()),
                "held": self.held.get(name, 0),
            }

    def hold(self, name: str, timeout: float) -> None:
        """Wait at gate ``name`` (counted in ``held`` while waiting) until it opens."""
        event = self.gate(name)
        with self.lock:
            self.held[name] = self.held.get(name, 0) + 1
        try:
            event.wait(timeout=timeout)
        finally:
            with self.lock:
                self.held[name] = self.held.get(name, 1) - 1

    def apply(self, req: dict[str, Any]) -> tuple[int, dict[str, Any]]:
        key = str(req.get("key") or "")
        if not key:
            return 400, {"error": "key is required"}
        token = int(req.get("token") or 0)
        if self.arrival:
            time.sleep(self.arrival)  # on its way: not applied, not found by a lookup yet
        with self.lock:
            if self.fail_before_apply > 0:
                self.fail_before_apply -= 1
                return 503, {"error": "injected failure before apply"}
            if self.check_tokens and token < self.max_token.get(key, 0):
                return 409, {
                    "error": "stale fencing token",
                    "token": token,
                    "seen": self.max_token[key],
                }
            self.max_token[key] = max(token, self.max_token.get(key, 0))
            dedupe = self.idempotent and bool(req.get("dedupe", True))
            existing = next((e for e in self.effects if e["key"] == key), None)
            if dedupe and existing is not None:
                effect, duplicate = existing, True
            else:
                effect = {
                    "effect_id": len(self.effects) + 1,
                    "key": key,
                    "kind": req.get("kind", "effect"),
                    "payload": req.get("payload"),
                    "token": token,
                    "at": time.time(),
                }
                self.effects.append(effect)
                duplicate = False
            fail = self.fail_after_apply > 0
            if fail:
                self.fail_after_apply -= 1
        if self.latency:
            time.sleep(self.latency)  # the provider is slow: calls are in flight when workers die
        gate = req.get("gate")
        if gate:
            self.hold(str(gate), timeout=float(req.get("gate_timeout", 120)))
        if fail:
            return 500, {"error": "injected failure after apply"}
        return 200, {**effect, "duplicate": duplicate}

    def find(self, key: str | None) -> list[dict[str, Any]]:
        with self.lock:
            return [dict(e) for e in self.effects if key is None or e["key"] == key]


def make_server(host: str, port: int, provider: FakeProvider | None = None) -> ThreadingHTTPServer:
    state = provider or FakeProvider()

    class Handler(BaseHTTPRequestHandler):
        def log_message(self, format: str, *args: Any) -> None:  # quiet
            return

        def _send(self, status: int, body: Any) -> None:
            data = json.dumps(body).encode()
            self.send_response(status)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(data)))
            self.end_headers()
            self.wfile.write(data)

        def _body(self) -> dict[str, Any]:
            length = int(self.headers.get("Content-Length") or 0)
            raw = self.rfile.read(length) if length else b"{}"
            value = json.loads(raw or b"{}")
            return value if isinstance(value, dict) else {}

        def do_GET(self) -> None:
            url = urlparse(self.path)
            if url.path == "/health":
                self._send(200, {"ok": True, **state.config()})
            elif url.path == "/effects":
                key = parse_qs(url.query).get("key", [None])[0]
                self._send(200, {"effects": state.find(key)})
            elif url.path.startswith("/gates/"):
                self._send(200, state.gate_status(unquote(url.path.removeprefix("/gates/"))))
            else:
                self._send(404, {"error": "not found"})

        def do_POST(self) -> None:
            url = urlparse(self.path)
            body = self._body()
            if url.path == "/effects":
                self._send(*state.apply(body))
            elif url.path == "/config":
                self._send(200, state.configure(body))
            elif url.path == "/reset":
                state.reset()
                self._send(200, {"ok": True})
            elif url.path.startswith("/gates/"):
                state.gate(unquote(url.path.removeprefix("/gates/"))).set()
                self._send(200, {"ok": True})
            else:
                self._send(404, {"error": "not found"})

    server = ThreadingHTTPServer((host, port), Handler)
    server.daemon_threads = True
    return server


class ProviderClient:
    """What tools (and tests) use to talk to the provider."""

    def __init__(self, url: str, timeout: float = 130.0) -> None:
        self.url = url.rstrip("/")
        self.timeout = timeout

    @classmethod
    def from_env(cls, timeout: float = 130.0) -> ProviderClient:
        """The provider at ``RUNLEDGER_PROVIDER_URL`` (what a tool in a test worker uses)."""
        url = os.environ.get("RUNLEDGER_PROVIDER_URL")
        if not url:
            raise RuntimeError(
                "RUNLEDGER_PROVIDER_URL is not set (the runledger_workers fixture sets it "
                "when the test also uses runledger_provider)"
            )
        return cls(url, timeout=timeout)

    def _request(self, method: str, path: str, body: dict[str, Any] | None = None) -> Any:
        data = json.dumps(body).encode() if body is not None else None
        req = urllib.request.Request(
            self.url + path, data=data, method=method, headers={"Content-Type": "application/json"}
        )
        try:
            with urllib.request.urlopen(req, timeout=self.timeout) as resp:
                return json.loads(resp.read())
        except urllib.error.HTTPError as exc:
            try:
                payload = json.loads(exc.read())
            except ValueError:
                payload = {}
            raise ProviderError(exc.code, payload) from None

    def apply(
        self,
        key: str,
        kind: str,
        payload: Any,
        token: int,
        *,
        dedupe: bool = True,
        gate: str | None = None,
    ) -> dict[str, Any]:
        body = {"key": key, "kind": kind, "payload": payload, "token": token, "dedupe": dedupe}
        if gate:
            body["gate"] = gate
        result: dict[str, Any] = self._request("POST", "/effects", body)
        return result

    def find(self, key: str) -> dict[str, Any] | None:
        found = self._request("GET", f"/effects?key={urllib.parse.quote(key)}")["effects"]
        return found[0] if found else None

    def effects(self, key: str | None = None) -> list[dict[str, Any]]:
        path = "/effects" if key is None else f"/effects?key={urllib.parse.quote(key)}"
        result: list[dict[str, Any]] = self._request("GET", path)["effects"]
        return result

    def configure(self, **settings: Any) -> dict[str, Any]:
        result: dict[str, Any] = self._request("POST", "/config", settings)
        return result

    def open_gate(self, name: str) -> None:
        """Release every request held at gate ``name``; later ones pass straight through."""
        self._request("POST", f"/gates/{_quote(name)}", {})

    def gate(self, name: str) -> dict[str, Any]:
        """``{"gate": name, "open": bool, "held": n}``."""
        result: dict[str, Any] = self._request("GET", f"/gates/{_quote(name)}")
        return result

    def held(self, gate: str) -> int:
        """How many requests are being held at ``gate`` right now."""
        return int(self.gate(gate)["held"])

    def wait_for_held(self, gate: str, count: int = 1, timeout: float = 30.0) -> int:
        """Wait until at least ``count`` requests are held at ``gate``; fail after ``timeout`` s."""
        deadline = time.monotonic() + timeout
        while True:
            held = self.held(gate)
            if held >= count:
                return held
            if time.monotonic() >= deadline:
                raise AssertionError(
                    f"timed out after {timeout} s waiting for {count} request(s) held at "
                    f"gate {gate!r} ({held} held)"
                )
            time.sleep(0.02)

    def reset(self) -> None:
        self._request("POST", "/reset", {})

    def health(self) -> dict[str, Any]:
        result: dict[str, Any] = self._request("GET", "/health")
        return result


def _quote(name: str) -> str:
    return urllib.parse.quote(name, safe="")


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description="runledger's gated fake provider")
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, default=8765)
    args = parser.parse_args(argv)
    server = make_server(args.host, args.port)
    print(f"provider listening on http://{args.host}:{server.server_address[1]}", flush=True)
    server.serve_forever()


if __name__ == "__main__":
    main()
