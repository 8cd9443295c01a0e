"""The worker's claims, as a base class of :class:`~runledger.worker.process.Worker`:
the claimer loop, and the claim that rides on a run's final decision.

The claimer claims up to the free slots whenever it is woken (a notification, a finished
run, the poll interval). A worker with one run in hand does better at that run's end: its
final decision goes as ``finish_and_claim`` (revision 0026), which also claims the next
runs in the same transaction, so the next run starts without a claim statement, a commit
and a wake-up of the claimer in between (:meth:`Claiming.next_claim`). Only then: with
several runs in hand, their decisions share commits (write coalescing) and the claimer
claims for all the slots that freed at once. One claim is out at a time, the claimer's
or one with a decision, so the two never claim the same free slots twice.

A claim that fails (a full disk: the database fails every write) is one warning, its
cause first, and the claimer backs off: the poll interval, doubled at each failure in a
row up to :data:`CLAIM_BACKOFF_MAX`.
"""

from __future__ import annotations

import asyncio
import contextlib
import contextvars
import datetime as dt
import logging
import random
import time
from collections.abc import Coroutine, Sequence
from dataclasses import dataclass
from typing import Any

from runledger.db.rows import ClaimedJournal
from runledger.db.sqlstate import describe
from runledger.db.worker_store import WorkerStore
from runledger.flows import Flow
from runledger.model import ClaimedRun
from runledger.worker.metrics import Metrics
from runledger.worker.runs import ActiveRun, Vouch

log = logging.getLogger("runledger.worker.process")

# the longest wait between two claims after failed ones (unless the poll interval is longer)
CLAIM_BACKOFF_MAX = 10.0

Claimed = list[tuple[ClaimedRun, ClaimedJournal]]


@dataclass(frozen=True, slots=True, kw_only=True)
class NextClaim:
    """A claim sent with a run's final decision (``finish_and_claim``): the claimer's
    arguments, when it was sent (the claimed leases' local deadlines count from then) and
    the listener's generation then (runs claimed across a change are handed back)."""

    worker_id: str
    flows: tuple[str, ...]
    lease: dt.timedelta
    max_runs: int
    sent: float
    generation: int


class Claiming:
    """The claims. ``Worker`` provides the attributes declared here."""

    worker_id: str
    flows: dict[str, Flow]
    store: WorkerStore | None
    concurrency: int
    lease: dt.timedelta
    lease_seconds: float
    margin: float
    poll_seconds: float
    stopping: asyncio.Event
    wake: asyncio.Event
    active: dict[str, ActiveRun]
    metrics: Metrics
    _generation: int
    _vouch: Vouch

    @property
    def claims_paused(self) -> bool:
        raise NotImplementedError  # Listening's

    def _init_claiming(self) -> None:
        # a claim is out (the claimer's, or one sent with a final decision)
        self._claiming = False
        # the context the runs' tasks start in: the claimer's, also for runs claimed with
        # another run's final decision (not that run's spans and pinned connection)
        self._runs_context = contextvars.copy_context()

    def _execute(
        self, active: ActiveRun, after: asyncio.Task[None] | None = None
    ) -> Coroutine[Any, Any, None]:
        raise NotImplementedError  # Worker's

    async def _claimer(self) -> None:
        assert self.store is not None
        self._runs_context = contextvars.copy_context()
        failures = 0  # claims failed in a row
        while not self.stopping.is_set():
            self.wake.clear()
            free = self.concurrency - len(self.active)
            claimed = 0
            if free > 0 and not self.claims_paused and not self._claiming:
                sent = time.monotonic()
                generation = self._generation
                self._claiming = True
                try:
                    # each run with its journal: nothing more is read after the claim
                    runs = await self.store.claim_runs(
                        self.worker_id, sorted(self.flows), self.lease, free
                    )
                    self.metrics.claim_took(time.monotonic() - sent)
                    failures = 0
                except Exception as exc:
                    failures += 1
                    # still "a claim is out" while it backs off: no final decision carries
                    # a claim meanwhile (it would fail the decision's write with it)
                    await self._claim_failed(exc, failures)
                    continue
                finally:
                    self._claiming = False
                claimed = len(runs)
                await self._take(runs, sent, generation)
            if claimed and claimed == free:
                continue  # there may be more waiting; go again at once
            # a timeout scope, not wait_for, which on 3.11 can swallow this task's
            # cancellation when the wake-up comes with it
            with contextlib.suppress(TimeoutError):
                async with asyncio.timeout(self.poll_seconds):
                    await self.wake.wait()

    def claim_backoff(self, failures: int) -> float:
        """How long the claimer waits after ``failures`` claims failed in a row: the poll
        interval, doubled at each failure up to :data:`CLAIM_BACKOFF_MAX` (or the poll
        interval, when that is longer), within a quarter either way."""
        cap = max(self.poll_seconds, CLAIM_BACKOFF_MAX)
        delay: float = min(self.poll_seconds * 2.0 ** min(failures - 1, 30), cap)
        return delay * random.uniform(0.75, 1.25)

    async def _claim_failed(self, exc: Exception, failures: int) -> None:
        """One line, the cause first (the traceback at debug level), then the backoff: a
        database that fails every claim (a full disk) is not asked again at every poll,
        nor at every notification meanwhile; only a stop ends the wait early."""
        delay = self.claim_backoff(failures)
        fields = {"worker_id": self.worker_id, "failures": failures, "retry_in": round(delay, 3)}
        log.warning("claim failed: %s; retrying in %.1f s", describe(exc), delay, extra=fields)
        log.debug("the failed claim's traceback", exc_info=exc, extra=fields)
        with contextlib.suppress(TimeoutError):
            async with asyncio.timeout(delay):
                await self.stopping.wait()

    def next_claim(self, finishing: ActiveRun) -> NextClaim | None:
        """The claim to send with ``finishing``'s final decision, or None: only when it is
        the one run this worker holds, no other claim is out, and the claimer would claim
        now (not stopping, claims not paused). Call :meth:`claimed` with what came back,
        and :meth:`claim_done` in any case."""
        if (
            self._claiming
            or self.stopping.is_set()
            or self.claims_paused
            or finishing.draining
            or len(self.active) != 1
            or self.active.get(finishing.run_id) is not finishing
        ):
            return None
        self._claiming = True
        return NextClaim(
            worker_id=self.worker_id,
            flows=tuple(sorted(self.flows)),
            lease=self.lease,
            max_runs=self.concurrency,  # the finishing run's slot frees with the commit
            sent=time.monotonic(),
            generation=self._generation,
        )

    async def claimed(self, request: NextClaim, runs: Claimed, finishing: ActiveRun) -> None:
        """The runs claimed with ``finishing``'s final decision: started as the claimer's
        are, each once ``finishing``'s task has ended (and given its connection back, which
        the next run then takes: one warm server backend); or handed back when the worker
        began to stop meanwhile (its drain waits for the runs it had)."""
        self.metrics.claim_took(time.monotonic() - request.sent)
        if runs and self.stopping.is_set():
            await self._hand_back_claims([run for run, _ in runs], "as the worker stops")
            return
        await self._take(runs, request.sent, request.generation, after=finishing.task)

    def claim_done(self) -> None:
        """The claim sent with a final decision is back (or failed): the claimer may claim."""
        self._claiming = False
        self.wake.set()

    async def _take(
        self,
        runs: Claimed,
        sent: float,
        generation: int,
        *,
        after: asyncio.Task[None] | None = None,
    ) -> None:
        """Start a task for each run claimed (the claim was sent at ``sent``), which waits
        for ``after`` to end first."""
        if runs and generation != self._generation:
            # the listener went down or came back while the claim was out: its runs may
            # carry the lock of a session that ended; hand them back
            await self._hand_back_claims([run for run, _ in runs], "while the listener changed")
            return
        for run, loaded in runs:
            active = ActiveRun(
                claim=run,
                deadline=sent + self.lease_seconds - self.margin,
                loaded=loaded,
                vouch=self._vouch,
            )
            active.draining = self.stopping.is_set()  # claimed as the stop came
            self.active[run.run_id] = active
            active.task = asyncio.create_task(
                self._execute(active, after),
                name=f"run:{run.run_id}",
                context=self._runs_context.copy(),
            )
            self.metrics.claimed(run)
            log.info(
                "claimed run",
                extra={
                    "run_id": run.run_id,
                    "worker_id": self.worker_id,
                    "fencing_token": run.fencing_token,
                    "takeover": run.takeover,
                },
            )

    async def _hand_back_claims(self, runs: Sequence[Any], why: str) -> None:
        assert self.store is not None
        for run in runs:
            log.warning(
                f"handing back a run claimed {why}",
                extra={"run_id": run.run_id, "worker_id": self.worker_id},
            )
            with contextlib.suppress(Exception):  # the lease expires instead
                await self.store.release_lease(run.run_id, run.lease_id, run.fencing_token)
