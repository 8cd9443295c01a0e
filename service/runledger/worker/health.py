"""The worker's HTTP endpoints (``runledger worker --http-port``): ``/livez``, ``/readyz``
and ``/metrics``, served by the worker's own event loop.

- ``/livez``: 200 ``ok`` when the event loop answers; no database call (a loop stuck in
  a blocking call cannot answer, and that is what it detects);
- ``/readyz``: 200 when a pool connection answers within :data:`READY_TIMEOUT`, the
  schema is at this code's head and the worker is not draining; else 503 with one line
  saying why;
- ``/metrics``: the :class:`~runledger.worker.metrics.PrometheusMetrics` registry, with
  the queue depth read from the database at scrape time (one statement).

A minimal HTTP/1.1 GET server on ``asyncio.start_server``: one request per connection,
``Connection: close``. It starts once the worker is registered and stops when the
worker stops (after the drain).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import Mapping
from typing import Protocol

from runledger.db import revisions
from runledger.db.worker_store import WorkerStore
from runledger.model import ClaimedRun
from runledger.worker.metrics import PrometheusMetrics

log = logging.getLogger(__name__)

READY_TIMEOUT = 2.0  # seconds for /readyz's database check and /metrics's queue depth
REQUEST_TIMEOUT = 5.0  # seconds to read a request line and its headers
MAX_HEADER_BYTES = 16_384


class Served(Protocol):
    """What the health server reads of the worker it serves
    (:class:`runledger.worker.process.Worker`, which starts it)."""

    @property
    def worker_id(self) -> str: ...
    @property
    def stopping(self) -> asyncio.Event: ...
    @property
    def store(self) -> WorkerStore | None: ...
    @property
    def flows(self) -> Mapping[str, object]: ...
    def claims_paused_because(self) -> str | None: ...


class HealthServer:
    def __init__(self, worker: Served, metrics: PrometheusMetrics, host: str, port: int) -> None:
        self.worker = worker
        self.metrics = metrics
        self.host = host
        self.port = port
        self.head = revisions.head()
        self._server: asyncio.Server | None = None
        metrics.read_holder = self._holder
        metrics.coalescers = lambda: () if worker.store is None else worker.store.coalescers

    async def _holder(self, run: ClaimedRun) -> str | None:
        store = self.worker.store
        if store is None:
            return None
        return await store.registry.takeover_holder(run.run_id, run.fencing_token)

    @property
    def bound_port(self) -> int:
        assert self._server is not None
        return int(self._server.sockets[0].getsockname()[1])

    async def start(self) -> None:
        self._server = await asyncio.start_server(self._serve, self.host, self.port)
        log.info(
            "health endpoints listening",
            extra={
                "worker_id": self.worker.worker_id,
                "http_host": self.host,
                "http_port": self.bound_port,
            },
        )

    async def stop(self) -> None:
        if self._server is not None:
            self._server.close()
            with contextlib.suppress(Exception):
                await asyncio.wait_for(self._server.wait_closed(), timeout=1.0)
            self._server = None

    # -- requests ------------------------------------------------------------------------

    async def _serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:
            try:
                head = await asyncio.wait_for(reader.readuntil(b"\r\n\r\n"), REQUEST_TIMEOUT)
            except (asyncio.IncompleteReadError, asyncio.LimitOverrunError, TimeoutError):
                return
            if len(head) > MAX_HEADER_BYTES:
                await self._send(writer, 431, "text/plain", b"request header too large\n")
                return
            method, _, rest = head.split(b"\r\n", 1)[0].decode("latin-1").partition(" ")
            path = rest.split(" ", 1)[0].split("?", 1)[0]
            if method not in ("GET", "HEAD"):
                await self._send(writer, 405, "text/plain", b"only GET\n")
                return
            if path == "/livez":
                status, ctype, body = 200, "text/plain; charset=utf-8", b"ok\n"
            elif path == "/readyz":
                status, ctype, body = await self._readyz()
            elif path == "/metrics":
                status, ctype, body = await self._metrics()
            else:
                status, ctype, body = 404, "text/plain; charset=utf-8", b"not found\n"
            await self._send(writer, status, ctype, b"" if method == "HEAD" else body)
        except Exception:
            log.exception("health request failed", extra={"worker_id": self.worker.worker_id})
        finally:
            writer.close()
            with contextlib.suppress(Exception):
                await writer.wait_closed()

    async def _send(
        self, writer: asyncio.StreamWriter, status: int, ctype: str, body: bytes
    ) -> None:
        reason = {200: "OK", 404: "Not Found", 405: "Method Not Allowed", 431: "Too Large"}
        writer.write(
            f"HTTP/1.1 {status} {reason.get(status, 'Service Unavailable')}\r\n"
            f"Content-Type: {ctype}\r\nContent-Length: {len(body)}\r\n"
            "Connection: close\r\n\r\n".encode("latin-1")
            + body
        )
        await writer.drain()

    async def _readyz(self) -> tuple[int, str, bytes]:
        why = await self._not_ready()
        if why is None:
            return 200, "text/plain; charset=utf-8", b"ok\n"
        return 503, "text/plain; charset=utf-8", f"not ready: {why}\n".encode()

    async def _not_ready(self) -> str | None:
        w = self.worker
        if w.stopping.is_set():
            return "draining"
        if w.store is None:
            return "not registered yet"
        paused = w.claims_paused_because()
        if paused is not None:
            return paused
        try:
            async with asyncio.timeout(READY_TIMEOUT):
                revision = await w.store.registry.schema_revision()
        except TimeoutError:
            return f"the database did not answer within {READY_TIMEOUT:g} s"
        except Exception as exc:
            said = (str(exc).strip().splitlines() or [type(exc).__name__])[0]
            return f"database: {said}"
        if revision is not None and revision != self.head:
            return f"schema revision {revision or 'none'}, this code's head is {self.head}"
        return None

    async def _metrics(self) -> tuple[int, str, bytes]:
        w = self.worker
        if w.store is not None:
            try:
                async with asyncio.timeout(READY_TIMEOUT):
                    self.metrics.set_queue_depth(
                        await w.store.registry.queue_depth(sorted(w.flows))
                    )
            except Exception as exc:  # the counters are still worth serving
                log.warning(
                    "queue depth not read: %r",
                    exc,
                    extra={"worker_id": w.worker_id},
                )
        body, ctype = self.metrics.exposition()
        return 200, ctype, body
