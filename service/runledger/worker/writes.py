"""The writes of a held lease: sent once, never cut off midway, refusals recorded.

Every journal write of a run goes through :meth:`Writes.write`. Once sent, the
database decides: if the run is fenced locally meanwhile (its task cancelled), the
write keeps going in the background, and a refusal (``LeaseLost``) is still recorded
as a ``stale_write_rejected`` event in its own transaction.

Group commit (revision 0018): a call's result without a next call to dispatch is
queued for its run, and one writer per run commits what is queued when it runs: the
results of a parallel group that are ready together go in one ``complete_calls``, and
a result that arrives while a commit of the run is in flight goes in the next one. No
one waits for a result that is not there yet; each caller returns once its own result
is committed, before its next step.

A result this worker holds is not dropped because the database failed to take it (a
full disk: :class:`~runledger.errors.ServerError` that is ``transient``): the completion
is sent again, with backoff, as long as the lease's local deadline holds; after that the
result is handed to the run's next holder (:meth:`Writes.release_send`, ``release_call``
with the result), which is sent again until it lands. A later lease of this worker that
finds the call in flight waits for that release first (:meth:`Writes.releasing`).
"""

from __future__ import annotations

import asyncio
import logging
import random
import time
from collections.abc import Awaitable, Coroutine, Sequence
from dataclasses import dataclass, field
from typing import Any, TypeVar

from runledger import errors
from runledger.db.sqlstate import describe
from runledger.db.worker_store import WorkerStore
from runledger.model import Call, FinishStatus, Outcome
from runledger.worker import tracing
from runledger.worker.metrics import Metrics
from runledger.worker.runs import ActiveRun, LocalLeaseExpired, detached

log = logging.getLogger(__name__)

T = TypeVar("T")

BATCH_MAX = 100  # complete_calls takes 1 to 100 calls
NOT_SENT: dict[str, Any] = {"ended": "not_sent"}  # a release: dispatched, the tool never started
# a write the database failed (transient: a full disk) is sent again after AGAIN_FIRST s,
# doubled at each failure: a completion up to AGAIN_MAX, a release (the lease is gone,
# and the run's next holder may be about to look) up to RELEASE_AGAIN_MAX
AGAIN_FIRST = 0.1
AGAIN_MAX = 2.0
RELEASE_AGAIN_MAX = 0.5


class _Again:
    """The waits between the sends of one write the database failed: doubling, jittered."""

    def __init__(self, cap: float) -> None:
        self.delay = AGAIN_FIRST
        self.cap = cap
        self.failures = 0

    def next(self) -> float:
        self.failures += 1
        delay, self.delay = self.delay, min(self.delay * 2, self.cap)
        return delay * random.uniform(0.75, 1.25)

    @property
    def level(self) -> int:
        """A warning at the 1st, 2nd, 4th, 8th, ... failure; the others at debug level:
        a disk full for minutes says so a few times per write, not every second."""
        return logging.WARNING if self.failures & (self.failures - 1) == 0 else logging.DEBUG

    async def pause(
        self, failed: str, exc: BaseException, kept: str, fields: dict[str, Any], cap: float
    ) -> None:
        """One line for the write that failed (its cause first; the traceback at debug
        level), then the wait before it is sent again: the next delay, at most ``cap``."""
        delay = min(self.next(), cap)
        fields = {**fields, "failures": self.failures, "retry_in": round(delay, 3)}
        log.log(
            self.level,
            "%s failed: %s; %s is kept and sent again in %.1f s",
            failed,
            describe(exc),
            kept,
            delay,
            extra=fields,
        )
        log.debug("the failed write's traceback", exc_info=exc, extra=fields)
        await asyncio.sleep(delay)


def _retried(exc: BaseException) -> bool:
    """Whether a failed write is sent again: the server failed it for a passing reason
    (a full disk, memory, a statement timeout), not a refusal."""
    return isinstance(exc, errors.ServerError) and exc.transient


@dataclass(slots=True)
class _Queued:
    """One call's checked result, waiting for its run's writer."""

    checked: tuple[Any, Outcome, Any, Any]  # key, outcome, result and receipt as JSON
    done: asyncio.Future[None] = field(
        default_factory=lambda: asyncio.get_running_loop().create_future()
    )
    abandoned: bool = False  # its caller was cancelled (the run fenced locally)


class Writes:
    def __init__(
        self, store: WorkerStore, *, worker_id: str, metrics: Metrics | None = None
    ) -> None:
        self.store = store
        self.worker_id = worker_id
        self.metrics = metrics or Metrics()
        self._late: set[asyncio.Task[Any]] = set()
        # per lease (run id, fencing token): the results queued for its writer, the writer
        self._queued: dict[tuple[str, int], list[_Queued]] = {}
        self._writers: dict[tuple[str, int], asyncio.Task[None]] = {}
        # per call (run id, key): the task releasing the end of this worker's send of it
        self._releasing: dict[tuple[str, str], asyncio.Task[Any]] = {}

    async def write(
        self,
        active: ActiveRun,
        operation: str,
        coro: Coroutine[Any, Any, T],
        *,
        dispatches: Sequence[str] = (),
    ) -> T:
        """Send one write of this run's lease and wait for the database's answer.
        ``dispatches``: the keys of the calls the write dispatches; if the run is fenced
        while it is on its way and it lands, nothing will send them: they are released as
        ``not_sent`` (the next holder sends them without waiting for this lease)."""
        active.operation = operation
        task, answer = detached(coro)  # once sent, the database decides: not cut off
        try:
            return await answer
        except asyncio.CancelledError:
            task.add_done_callback(lambda t: self._after_fenced_write(active, t, dispatches))
            self.track(active, task)
            raise

    def _after_fenced_write(
        self, active: ActiveRun, task: asyncio.Future[Any], dispatches: Sequence[str] = ()
    ) -> None:
        if task.cancelled():
            return
        exc = task.exception()
        if exc is None:
            for key in dispatches:
                self.track(active, self.release_send(active, key, NOT_SENT), busy=False)
        if isinstance(exc, errors.LeaseLost):
            self.track(active, self.report_stale(active, exc))

    async def dispatch(
        self, active: ActiveRun, call: Call, *, attempts_seen: int, to_send: bool = False
    ) -> int:
        """``dispatch_call``; the attempt number. ``attempts_seen``: the call's attempts
        before this send (they only grow while we hold the lease). ``to_send``: the tool is
        invoked next (not a failover's probe, whose call may have been sent on a lost
        timeline): if the run is fenced while the dispatch is on its way and it lands, the
        call is released as never sent (see :meth:`write`)."""
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
            dispatches=(call.idempotency_key,) if to_send else (),
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
        dispatch, in the same transaction (``complete_and_dispatch``): then the next
        call's attempt number. Without one, the result is group-committed with the other
        results of the run that are ready (:meth:`_group_commit`).

        The result is not dropped when the database fails the write for a passing
        reason (a full disk): it is sent again, with backoff, until the lease's local
        deadline; then :class:`LocalLeaseExpired`, and the caller hands it over
        (:meth:`release_send`)."""
        c = active.claim
        args = (c.run_id, c.lease_id, c.fencing_token, call.idempotency_key, outcome, result)
        attempt: int | None = None
        again = _Again(AGAIN_MAX)
        while True:
            try:
                if next_call is None:
                    await self._group_commit(active, call, outcome, result, receipt)
                else:
                    attempt = await self.write(
                        active,
                        "complete_call",
                        dispatches=(next_call.idempotency_key,),
                        coro=self.store.complete_and_dispatch(
                            *args,
                            receipt,
                            next_key=next_call.idempotency_key,
                            next_attempts_seen=next_call.attempts,
                        ),
                    )
                break
            except errors.ServerError as exc:
                await self._hold(active, call, exc, again)
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

    async def _hold(
        self, active: ActiveRun, call: Call, exc: errors.ServerError, again: _Again
    ) -> None:
        """A completion the database failed: wait, then it is sent again, while the
        lease's local deadline (and the listener's vouch) hold; else raise."""
        if not _retried(exc):
            raise exc
        left = min(active.deadline, active.vouch.until) - time.monotonic()
        if left <= 0:  # the lease's end: the caller hands the result over
            raise LocalLeaseExpired(active.run_id) from exc
        c = active.claim
        fields = {
            "run_id": c.run_id,
            "worker_id": self.worker_id,
            "fencing_token": c.fencing_token,
            "call": call.idempotency_key,
        }
        await again.pause("complete_call", exc, "the result", fields, left)
        if time.monotonic() >= min(active.deadline, active.vouch.until):
            raise LocalLeaseExpired(active.run_id) from exc

    async def _group_commit(
        self,
        active: ActiveRun,
        call: Call,
        outcome: Outcome,
        result: Any,
        receipt: dict[str, Any] | None,
    ) -> None:
        """Queue this result for the run's writer and wait until it is committed. The
        writer starts when nothing of the run is being written and runs once the caller
        yields: the results of sibling calls that are ready by then go in the same
        commit. A result that fails the store's checks is refused for its call alone."""
        lease = (active.run_id, active.claim.fencing_token)
        queued = _Queued(
            checked=self.store.completion(call.idempotency_key, outcome, result, receipt),
        )
        self._queued.setdefault(lease, []).append(queued)
        writer = self._writers.get(lease)
        if writer is None:
            writer = asyncio.ensure_future(self._writer(active))
            self._writers[lease] = writer
        try:
            await asyncio.shield(queued.done)
        except asyncio.CancelledError:
            # fenced locally: the commit goes on (and a refusal is still recorded)
            queued.abandoned = True
            if not writer.done():
                self.track(active, writer)
            raise

    def _next_batch(self, lease: tuple[str, int]) -> list[_Queued]:
        """The oldest queued results of this lease, at most :data:`BATCH_MAX`."""
        queued = self._queued.get(lease)
        if not queued:
            self._queued.pop(lease, None)
            return []
        batch, rest = queued[:BATCH_MAX], queued[BATCH_MAX:]
        if rest:
            self._queued[lease] = rest
        else:
            del self._queued[lease]
        return batch

    async def _writer(self, active: ActiveRun) -> None:
        """Commit the run's queued results, batch after batch, until none are left."""
        c = active.claim
        lease = (c.run_id, c.fencing_token)
        try:
            while batch := self._next_batch(lease):
                active.operation = "complete_call"
                try:
                    if len(batch) == 1:  # alone: complete_call, as without group commit
                        await self.store.complete_checked(
                            c.run_id, c.lease_id, c.fencing_token, batch[0].checked
                        )
                    else:
                        await self.store.complete_calls(
                            c.run_id, c.lease_id, c.fencing_token, [q.checked for q in batch]
                        )
                except Exception as exc:
                    for q in batch:
                        q.done.set_exception(exc)
                        q.done.exception()  # retrieved: an abandoned caller never looks
                    if isinstance(exc, errors.LeaseLost) and all(q.abandoned for q in batch):
                        await self.report_stale(active, exc)
                    continue
                for q in batch:
                    q.done.set_result(None)
        finally:
            del self._writers[lease]

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
        active.ending = True
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
        active.ending = True
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

    async def release_send(self, active: ActiveRun, key: str, ended: dict[str, Any]) -> None:
        """Tell the run's next holder that this lease's send of call ``key`` has ended
        (``release_call``): how (``ended``: the tool returned, with its result; raised;
        was cancelled; or was never started, :data:`NOT_SENT`), so that it need not wait
        for this lease to expire. Nothing is written when the call's outcome was journaled
        meanwhile. A write the database failed for a passing reason (a full disk) is sent
        again, with backoff, until it lands: the result it carries is not dropped. Any
        other failure is logged, and the next holder waits for the lease instead."""
        c = active.claim
        args = (c.run_id, c.lease_id, c.fencing_token, key, self.worker_id)
        call = (c.run_id, key)
        task = asyncio.current_task()
        if task is not None:
            self._releasing[call] = task
        again = _Again(RELEASE_AGAIN_MAX)
        try:
            while True:
                try:
                    try:
                        told = await self.store.release_call(*args, ended)
                    except errors.InvalidInput:  # the result is over the payload cap
                        told = await self.store.release_call(*args, {"ended": ended["ended"]})
                    break
                except Exception as exc:
                    if not _retried(exc):
                        log.info(
                            "the end of a send not released: %s",
                            describe(exc),
                            extra={"run_id": c.run_id, "key": key},
                        )
                        return
                    fields = {"run_id": c.run_id, "key": key, "fencing_token": c.fencing_token}
                    kept = f"the end of the send ({ended['ended']})"
                    await again.pause("release_call", exc, kept, fields, RELEASE_AGAIN_MAX)
        finally:
            if task is not None and self._releasing.get(call) is task:
                del self._releasing[call]
        if told:
            log.info(
                "call released to the run's next holder",
                extra={
                    "run_id": c.run_id,
                    "key": key,
                    "fencing_token": c.fencing_token,
                    "ended": ended["ended"],
                },
            )

    def releasing(self, run_id: str, key: str) -> asyncio.Task[Any] | None:
        """The task still releasing the end of this worker's send of the call under an
        earlier lease (:meth:`release_send`), if one is: a later holder here waits for it
        before it judges the call, whose release may carry the tool's result."""
        task = self._releasing.get((run_id, key))
        return None if task is None or task.done() else task

    def track(
        self, active: ActiveRun, aw: Awaitable[T], *, busy: bool = True, kind: str | None = None
    ) -> asyncio.Future[T]:
        """Keep a background task of this run (a tool thread's result, a write in flight).
        ``busy=False``: one that need not hold the lease back (:meth:`busy` leaves it out),
        such as the release of a send that has ended. ``kind``: another name, for one that
        :meth:`settled` does not wait for either (the hand-back of a fenced run)."""
        task = asyncio.ensure_future(aw)
        task.set_name(f"{kind or ('late' if busy else 'told')}:{active.run_id}")
        self._late.add(task)
        task.add_done_callback(self._late.discard)
        return task

    async def settled(self, run_id: str) -> None:
        """Wait until no background task of this run is left: its tool threads, writes
        and the releases of its sends (not the hand-backs of its fenced leases, which
        wait for this themselves)."""
        names = (f"late:{run_id}", f"told:{run_id}")
        while True:
            left = [t for t in self._late if t.get_name() in names]
            if not left:
                return
            await asyncio.wait(left)

    def busy(self, run_id: str) -> bool:
        """Whether a tool thread or a write of this run is still in flight."""
        return any(t.get_name() == f"late:{run_id}" and not t.done() for t in self._late)

    async def settle(self, timeout: float) -> None:
        """Give background results and writes up to ``timeout`` s to reach the database."""
        if self._late:
            await asyncio.wait(set(self._late), timeout=timeout)
