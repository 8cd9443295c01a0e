"""``Client``: submit and inspect runs from ordinary (synchronous) code.

It drives the async :class:`~runledger.db.store.Store` (the worker's and the operator's), on a
private event loop in a background thread, so there is one implementation of every
database call.
"""

from __future__ import annotations

import asyncio
import datetime as dt
import getpass
import threading
import time
import uuid
from collections.abc import Coroutine
from typing import Any, TypeVar

from runledger import errors
from runledger.config import connection_settings
from runledger.db.results import PrunedRecords
from runledger.db.store import Store
from runledger.flows import Flow
from runledger.model import (
    Call,
    Event,
    Resolution,
    Run,
    RunStatus,
    SubmitResult,
    parse_flow_ref,
)
from runledger.tracecontext import current_traceparent

T = TypeVar("T")

SETTLED = (RunStatus.SUCCEEDED, RunStatus.FAILED, RunStatus.CANCELLED, RunStatus.PAUSED)


class Client:
    """``Client(database_url)``; use as a context manager or call :meth:`close`.

    Connecting fails fast, within ``connect_timeout`` seconds (else ``RUNLEDGER_CONNECT_TIMEOUT``,
    else the URL's ``connect_timeout``, else 5 s), with one of
    :class:`~runledger.errors.DatabaseUnavailable` (down, wrong host, port, role or
    database), :class:`~runledger.errors.SchemaMissing` (run ``runledger migrate``) or
    :class:`~runledger.errors.ConfigurationError` (no URL, or not a URL).

    ``pooler``: what the URL reaches, ``"transaction"`` or ``"session"`` for PgBouncer in
    that mode (else ``RUNLEDGER_POOLER``, else ``"auto"``: found out when connecting).
    Through a transaction pooler nothing is prepared (docs/operating.md, "PgBouncer").
    """

    def __init__(
        self,
        database_url: str | None = None,
        *,
        actor: str | None = None,
        connect_timeout: float | None = None,
        pooler: str | None = None,
    ) -> None:
        settings = connection_settings(database_url, connect_timeout, pooler)
        self.database_url = settings.require_database_url()
        # given (or from the environment): it wins; else the URL's own, else the default
        self.connect_timeout = (
            settings.connect_timeout if "connect_timeout" in settings.model_fields_set else None
        )
        self.actor = actor or f"client:{getpass.getuser()}"
        self._loop = asyncio.new_event_loop()
        self._thread = threading.Thread(
            target=self._loop.run_forever, name="runledger-client", daemon=True
        )
        self._thread.start()
        try:
            self._store: Store = self._run(
                Store.connect(
                    self.database_url,
                    max_size=2,
                    connect_timeout=self.connect_timeout,
                    pooler=settings.pooler,
                )
            )
        except BaseException:
            self._stop_loop()
            raise

    def _run(self, coro: Coroutine[Any, Any, T]) -> T:
        return asyncio.run_coroutine_threadsafe(coro, self._loop).result()

    def _stop_loop(self) -> None:
        self._loop.call_soon_threadsafe(self._loop.stop)
        self._thread.join(timeout=10)
        self._loop.close()

    def close(self) -> None:
        if self._loop.is_closed():
            return
        self._run(self._store.close())
        self._stop_loop()

    def __enter__(self) -> Client:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    @property
    def store(self) -> Store:
        return self._store

    # -- runs ------------------------------------------------------------------------

    def resolve_flow(self, flow: Flow | str, version: str | None = None) -> tuple[str, str]:
        """``Flow``, ``"name@version"``, or ``"name"`` + ``version`` -> (name, version)."""
        if isinstance(flow, Flow):
            return flow.name, version or flow.version
        if "@" in flow:
            try:
                return parse_flow_ref(flow)
            except ValueError as exc:
                raise errors.InvalidInput(str(exc)) from exc
        if version is not None:
            return flow, version
        known = sorted(
            v
            for n, v in map(parse_flow_ref, self._run(self._store.operator.known_flows()))
            if n == flow
        )
        if len(known) != 1:
            raise errors.InvalidInput(
                f"flow {flow!r}: give a version (name@version); "
                f"workers registered {known or 'none'}"
            )
        return flow, known[0]

    def submit(
        self,
        flow: Flow | str,
        input: dict[str, Any],
        run_id: str | None = None,
        version: str | None = None,
        priority: int = 0,
        traceparent: str | None = None,
    ) -> SubmitResult:
        """Submit a run; ``run_id=None`` generates one (an empty string is refused).

        The run's spans continue the caller's trace: ``traceparent`` (a W3C trace
        context), else the OpenTelemetry span active here, if any (docs/operating.md,
        Tracing).

        Bad arguments (an empty or malformed run id, a priority outside int32, input that
        is not a JSON object or nests deeper than ``MAX_JSON_DEPTH``, a malformed
        traceparent) raise :class:`~runledger.errors.InvalidInput` before anything is
        sent."""
        name, ver = self.resolve_flow(flow, version)
        rid = f"run-{uuid.uuid4().hex}" if run_id is None else run_id
        if traceparent is None:
            traceparent = current_traceparent()  # read here: the call runs on another thread
        return self._run(
            self._store.worker.submit_run(rid, name, ver, input, priority, traceparent=traceparent)
        )

    def known_flows(self) -> set[str]:
        return self._run(self._store.operator.known_flows())

    def get(self, run_id: str) -> Run:
        return self._run(self._store.operator.get_run(run_id))

    def calls(self, run_id: str) -> list[Call]:
        return self._run(self._store.operator.list_calls(run_id))

    def events(self, run_id: str) -> list[Event]:
        return self._run(self._store.operator.list_events(run_id))

    def wait(self, run_id: str, timeout: float = 60.0) -> Run:
        """Block until the run succeeded, failed, was cancelled or paused."""
        deadline = time.monotonic() + timeout
        delay = 0.02
        while True:
            run = self.get(run_id)
            if run.status in SETTLED:
                return run
            if time.monotonic() >= deadline:
                raise TimeoutError(f"run {run_id} still {run.status} after {timeout} s")
            time.sleep(min(delay, max(0.0, deadline - time.monotonic())))
            delay = min(delay * 1.5, 0.5)

    def resolve(
        self,
        key: str,
        resolution: Resolution | str,
        receipt: dict[str, Any] | None = None,
        note: str | None = None,
    ) -> None:
        self._run(self._store.operator.resolve_call(key, resolution, receipt, self.actor, note))

    def approve(self, key: str, note: str | None = None, *, actor: str | None = None) -> None:
        """Approve a call awaiting approval (``approve_call``): the next holder sends it. A
        paused run with nothing else awaiting a person is queued again. Raises
        :class:`~runledger.errors.RunNotFound` (no such call),
        :class:`~runledger.errors.InvalidTransition` (the call does not await approval, or
        its run is running: wait until it pauses) or
        :class:`~runledger.errors.InvalidInput`. ``actor`` defaults to the client's."""
        self._run(self._store.operator.approve_call(key, actor=actor or self.actor, note=note))

    def deny(self, key: str, reason: str, *, actor: str | None = None) -> None:
        """Deny a call awaiting approval (``deny_call``): it fails, never sent, and the
        policy sees a failed call with error ``{"reason": "denied", "note": reason,
        "actor": actor}``. Errors as :meth:`approve`; ``reason`` is required."""
        self._run(self._store.operator.deny_call(key, reason=reason, actor=actor or self.actor))

    def cancel(self, run_id: str, reason: str | None = None) -> None:
        self._run(self._store.operator.cancel_run(run_id, self.actor, reason))

    def retry(self, run_id: str) -> None:
        self._run(self._store.operator.retry_run(run_id, self.actor))

    def prune_cutoff(self, older_than: dt.timedelta) -> dt.datetime:
        """The database clock minus ``older_than``."""
        return self._run(self._store.operator.prune_cutoff(older_than))

    def prunable(self, before: dt.datetime) -> int:
        """How many finished runs finished before ``before``."""
        return self._run(self._store.operator.prunable(before))

    def prune_batch(self, before: dt.datetime, *, keep_events: bool, limit: int) -> int:
        """Delete at most ``limit`` of them, oldest first (``prune_runs_v2``)."""
        return self._run(self._store.operator.prune_batch(before, keep_events, limit))

    def prune_records(self, before: dt.datetime, *, keep_events: bool, limit: int) -> PrunedRecords:
        """Delete a batch of the records older than ``before`` that runs leave behind:
        checkpoints of the event chains and their heads, the chains of runs already gone
        (unless ``keep_events``), records of pruned checkpoints and chains, workers, commit
        guarantees (``prune_records``). Call it again while ``.more``."""
        return self._run(self._store.operator.prune_records(before, keep_events, limit))
