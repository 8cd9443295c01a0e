"""The writes of a held lease: sent once, never cut off midway, refusals recorded.

Every journal write of a run goes through :meth:`Writes.write`. Once sent, the
database decides: if the run is fenced locally meanwhile (its task cancelled), the
write keeps going in the background, and a refusal (``LeaseLost``) is still recorded
as a ``stale_write_rejected`` event in its own transaction.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Awaitable, Coroutine
from typing import Any, TypeVar

from runledger import errors
from runledger.db.store import Store
from runledger.model import Call, FinishStatus, Outcome
from runledger.worker import tracing
from runledger.worker.metrics import Metrics
from runledger.worker.runs import ActiveRun

log = logging.getLogger(__name__)

T = TypeVar("T")


class Writes:
    def __init__(self, store: Store, *, worker_id: str, metrics: Metrics | None = None) -> None:
        self.store = store
        self.worker_id = worker_id
        self.metrics = metrics or Metrics()
        self._late: set[asyncio.Task[Any]] = set()

    async def write(self, active: ActiveRun, operation: str, coro: Coroutine[Any, Any, T]) -> T:
        """Send one write of this run's lease and wait for the database's answer."""
        active.operation = operation
        task = asyncio.ensure_future(coro)
        try:
            return await asyncio.shield(task)
        except asyncio.CancelledError:
            task.add_done_callback(lambda t: self._after_fenced_write(active, t))
            self.track(active, task)
            raise

    def _after_fenced_write(self, active: ActiveRun, task: asyncio.Future[Any]) -> None:
        if task.cancelled():
            return
        exc = task.exception()
        if isinstance(exc, errors.LeaseLost):
            self.track(active, self.report_stale(active, exc))

    async def dispatch(self, active: ActiveRun, call: Call, *, attempts_seen: int) -> int:
        """``dispatch_call``; the attempt number. ``attempts_seen``: the call's attempts
        before this send (they only grow while we hold the lease)."""
        c = active.claim
        attempt = await self.write(
            active,
            "dispatch_call",
            self.store.dispatch_call(
                c.run_id,
                c.lease_id,
                c.fencing_token,
                call.idempotency_key,
                attempts_seen=attempts_seen,
            ),
        )
        if active.journal is not None:
            active.journal.dispatched(
                call.idempotency_key, attempt, c.fencing_token, self.worker_id
            )
        self.dispatched(active, call, attempt)
        return attempt

    def dispatched(self, active: ActiveRun, call: Call, attempt: int) -> None:
        """A call's dispatch committed: its clock starts, and one lifecycle line."""
        active.sent_at[call.idempotency_key] = time.monotonic()
        c = active.claim
        log.info(
            "call dispatched",
            extra={
                "run_id": c.run_id,
                "worker_id": self.worker_id,
                "fencing_token": c.fencing_token,
                "call": call.idempotency_key,
                "tool": call.tool,
                "attempt": attempt,
            },
        )

    def completed(self, active: ActiveRun, call: Call, outcome: Outcome) -> None:
        """A call's completion committed: counted, timed from its dispatch, logged."""
        sent = active.sent_at.pop(call.idempotency_key, None)
        c = active.claim
        self.metrics.call_completed(
            c, call.tool, str(outcome), None if sent is None else time.monotonic() - sent
        )
        log.info(
            "call completed",
            extra={
                "run_id": c.run_id,
                "worker_id": self.worker_id,
                "fencing_token": c.fencing_token,
                "call": call.idempotency_key,
                "tool": call.tool,
                "outcome": str(outcome),
            },
        )

    async def complete(
        self,
        active: ActiveRun,
        call: Call,
        outcome: Outcome,
        result: Any,
        receipt: dict[str, Any] | None,
        *,
        next_call: Call | None = None,
    ) -> int | None:
        """``complete_call``; with ``next_call`` (a planned call that runs next) also its
        dispatch, in the same transaction (``complete_call_v2``): then the next call's
        attempt number."""
        c = active.claim
        args = (c.run_id, c.lease_id, c.fencing_token, call.idempotency_key, outcome, result)
        attempt: int | None = None
        if next_call is None:
            await self.write(active, "complete_call", self.store.complete_call(*args, receipt))
        else:
            attempt = await self.write(
                active,
                "complete_call",
                self.store.complete_call_v2(
                    *args,
                    receipt,
                    next_key=next_call.idempotency_key,
                    next_attempts_seen=next_call.attempts,
                ),
            )
        if active.journal is not None:
            active.journal.completed(
                call.idempotency_key, outcome, result, receipt, c.fencing_token
            )
            if next_call is not None and attempt is not None:
                active.journal.dispatched(
                    next_call.idempotency_key, attempt, c.fencing_token, self.worker_id
                )
        self.completed(active, call, outcome)
        if next_call is not None and attempt is not None:
            self.dispatched(active, next_call, attempt)
        return attempt

    async def checkpoint_due(self, active: ActiveRun) -> None:
        """Write the checkpoint that waits for the next decision, on its own: the run is
        about to end for this holder (finished, handed back) without one."""
        due = active.checkpoint_due
        if due is None:
            return
        c = active.claim
        active.state_version = await self.write(
            active,
            "checkpoint",
            self.store.checkpoint(c.run_id, c.lease_id, c.fencing_token, active.state_version, due),
        )
        active.checkpoint_due = None

    async def finish(
        self, active: ActiveRun, status: FinishStatus, result: Any, reason: str | None
    ) -> None:
        c = active.claim
        await self.write(
            active,
            "finish_run",
            self.store.finish_run(c.run_id, c.lease_id, c.fencing_token, status, result, reason),
        )
        self.finished(active, status, reason)

    async def end(
        self, active: ActiveRun, status: FinishStatus, result: Any, reason: str | None
    ) -> None:
        """End the run (``finish_run``), after the checkpoint still due, if one is."""
        await self.checkpoint_due(active)
        await self.finish(active, status, result, reason)

    def finished(self, active: ActiveRun, status: FinishStatus, reason: str | None) -> None:
        """Log the end of the run (written by ``finish_run`` or with the final decision)."""
        c = active.claim
        self.metrics.finished(c, str(status))
        tracing.finished(active, status, reason)
        log.info(
            "run finished",
            extra={
                "run_id": c.run_id,
                "worker_id": self.worker_id,
                "fencing_token": c.fencing_token,
                "status": str(status),
                "reason": reason,
            },
        )

    async def release(
        self, active: ActiveRun, *, reason: str | None = None, error: dict[str, Any] | None = None
    ) -> None:
        """Hand the run back (queued); ``reason``/``error`` go into its ``lease_released``
        event. A refusal (the lease is gone already) is recorded, not raised."""
        c = active.claim
        try:
            await self.store.release_lease(
                c.run_id, c.lease_id, c.fencing_token, reason=reason, error=error
            )
            self.metrics.finished(c, "released")
            log.info(
                "run released",
                extra={
                    "run_id": c.run_id,
                    "worker_id": self.worker_id,
                    "fencing_token": c.fencing_token,
                    "reason": reason,
                },
            )
        except errors.LeaseLost as exc:
            await self.report_stale(active, exc)

    async def report_stale(self, active: ActiveRun, exc: errors.LeaseLost) -> None:
        """Record the refusal in its own transaction; shielded from the run's cancellation."""
        self.metrics.stale_write()
        try:
            await asyncio.shield(
                self.store.report_stale_write(
                    active.run_id,
                    self.worker_id,
                    active.claim.lease_id,
                    active.claim.fencing_token,
                    active.operation,
                    str(exc),
                )
            )
        except errors.RunNotFound:  # pruned meanwhile: nothing left to record it against
            log.info("refused write not recorded: the run is gone", extra={"run_id": active.run_id})
        except Exception:
            log.exception("could not record the refused write", extra={"run_id": active.run_id})

    # -- background work of a fenced run -----------------------------------------------

    def track(self, active: ActiveRun, aw: Awaitable[Any]) -> None:
        """Keep a background task of this run (a tool thread's result, a write in flight)."""
        task = asyncio.ensure_future(aw)
        task.set_name(f"late:{active.run_id}")
        self._late.add(task)
        task.add_done_callback(self._late.discard)

    def busy(self, run_id: str) -> bool:
        """Whether a tool thread or a write of this run is still in flight."""
        return any(t.get_name() == f"late:{run_id}" and not t.done() for t in self._late)

    async def settle(self, timeout: float) -> None:
        """Give background results and writes up to ``timeout`` s to reach the database."""
        if self._late:
            await asyncio.wait(set(self._late), timeout=timeout)
