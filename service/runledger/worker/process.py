"""One worker process: claimer, lease keeper, listener and N run slots on asyncio.

- claimer: woken by ``LISTEN runledger_runs`` (or a finished run, or the poll
  interval), claims up to the free slots for the ``name@version`` pairs registered;
- lease keeper: renews every held lease in one ``renew_leases`` call every lease/3;
  a run missing from the answer is cancelled at once. The local deadline of a lease
  is measured from when the renew request was *sent*, minus a margin, so the worker
  stops trusting a lease before the database does;
- listener: its own long-lived connection, which LISTENs and is also the one the
  worker registers on (``register_worker_v2``), so the registration lives exactly as
  long as that session: the database refuses a second live worker with the same id
  (RL008). Where the session is the worker's own, it holds a session lock that claims
  stamp on the runs: when the session ends, other workers take the runs over at once
  (:mod:`runledger.worker.listener`, docs/leases.md). Its heartbeat (every 0.5 s) also
  wakes the claimer when such a run waits. A listener that holds a lock and stops
  answering within its budget fences every run at once, before the server can free
  the lock; then nothing is claimed until it has reconnected and registered again (a
  new lock). Without a lock, polling goes on meanwhile. If the id was taken while it
  was away, the worker stops (every run fenced);
- supervisor: the lease keeper, the watchdog and the listener run in one task group.
  Each survives what the database may do to it (refusals, lost connections,
  timeouts); an unexpected exception -- a bug -- would silently cost the worker its
  self-fencing, so instead the whole worker stops: every run is cancelled locally,
  nothing more is claimed, the leases that can be are handed back, and
  :meth:`Worker.run` raises :class:`WorkerFailed` (the process exits non-zero);
- SIGTERM/SIGINT: stop claiming, let in-flight calls finish within the grace period,
  release the leases of unfinished runs. A second signal exits at once.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import datetime as dt
import logging
import os
import signal
import socket
import time
import uuid
from collections.abc import Coroutine, Sequence
from typing import Any

import psycopg

from runledger import errors
from runledger.config import default
from runledger.db.sqlstate import describe
from runledger.db.worker_store import WorkerStore
from runledger.flows import Flow
from runledger.worker import listener
from runledger.worker.claiming import Claiming
from runledger.worker.crash import CrashPoints
from runledger.worker.executor import ActiveRun, Limits, RunExecutor
from runledger.worker.listener import ListenerSession
from runledger.worker.listening import (
    EXPECTED,
    REGISTER_PATIENCE,
    Listening,
    WorkerIdTaken,
    conflict_message,
    is_worker_conflict,
)
from runledger.worker.metrics import Metrics, PrometheusMetrics

log = logging.getLogger(__name__)

# how long a start retries a listener connection the server ended while it registered
REGISTER_RETRY_SECONDS = 10.0

CHANNEL = listener.CHANNEL
CHECKPOINT_EVERY = 10.0  # s between two checkpoints of the event chains (any worker's)

__all__ = [
    "CHANNEL",
    "EXPECTED",
    "REGISTER_PATIENCE",
    "Worker",
    "WorkerFailed",
    "WorkerIdTaken",
    "conflict_message",
    "default_worker_id",
    "is_worker_conflict",
]


class WorkerFailed(RuntimeError):
    """An internal task of the worker (lease keeper, watchdog, listener) died: the worker
    stopped, fencing all its runs."""

    def __init__(self, task: str, error: BaseException) -> None:
        super().__init__(f"internal task {task} died: {error!r}")
        self.task = task
        self.error = error


def _first(group: BaseExceptionGroup[WorkerFailed]) -> WorkerFailed:
    """The first helper that died (the others were cancelled by the task group)."""
    first = group.exceptions[0]
    return first if isinstance(first, WorkerFailed) else _first(first)


def default_worker_id() -> str:
    return f"{socket.gethostname()}:{os.getpid()}:{uuid.uuid4().hex[:6]}"


class Worker(Listening, Claiming):
    def __init__(
        self,
        *,
        database_url: str,
        flows: Sequence[Flow],
        worker_id: str | None = None,
        concurrency: int = default("concurrency"),
        lease_seconds: float = default("lease_seconds"),
        poll_seconds: float = default("poll_seconds"),
        grace_seconds: float = default("grace_seconds"),
        limits: Limits | None = None,
        crash: CrashPoints | None = None,
        session_locks: bool = default("session_locks"),
        http_port: int | None = None,
        http_host: str = default("http_host"),
        pooler: str = default("pooler"),
        direct_url: str | None = None,
    ) -> None:
        if not flows:
            raise ValueError("a worker needs at least one flow")
        self.flows = {f.ref: f for f in flows}
        if len(self.flows) != len(flows):
            raise ValueError("the same name@version was registered twice")
        for f in flows:
            f.validate()
        self.database_url = database_url
        # what database_url reaches (auto: found out when connecting), and a URL past the
        # pooler, for the listener (docs/operating.md, "PgBouncer")
        self.pooler = pooler
        self.direct_url = direct_url
        self.worker_id = worker_id or default_worker_id()
        self.concurrency = concurrency
        self.lease = dt.timedelta(seconds=lease_seconds)
        self.lease_seconds = lease_seconds
        self.margin = min(1.0, lease_seconds * 0.1)
        self.poll_seconds = poll_seconds
        self.grace_seconds = grace_seconds
        self.limits = limits or Limits()
        self.crash = crash or CrashPoints.from_env()
        self.active: dict[str, ActiveRun] = {}
        self.stopping = asyncio.Event()
        self.wake = asyncio.Event()
        self._signals = 0
        self.store: WorkerStore | None = None
        self.executor: RunExecutor
        self.http_port = http_port
        self.http_host = http_host
        # counters only when served (--http-port): else every event is a no-op call
        self.metrics: Metrics = (
            Metrics() if http_port is None else PrometheusMetrics(lambda: len(self.active))
        )
        self._init_listening(session_locks)
        self._init_claiming()

    # -- lifecycle ---------------------------------------------------------------------

    def request_stop(self) -> None:
        self._signals += 1
        if self._signals > 1:
            log.warning("second stop signal: exiting at once", extra={"worker_id": self.worker_id})
            os._exit(1)
        log.info("stopping: draining runs", extra={"worker_id": self.worker_id})
        self.stopping.set()
        self.wake.set()
        # at once, not when the claimer gets to _drain: a call that returns right after
        # the signal must not be followed by a new step
        for a in self.active.values():
            a.draining = True

    def install_signal_handlers(self) -> None:
        loop = asyncio.get_running_loop()
        for sig in (signal.SIGTERM, signal.SIGINT):
            loop.add_signal_handler(sig, self.request_stop)

    async def run(self) -> None:
        # plain-def tools and policies run in threads: one per run slot, or a slot would
        # wait for a thread while its lease runs
        loop = asyncio.get_running_loop()
        loop.set_default_executor(
            concurrent.futures.ThreadPoolExecutor(
                max_workers=self.concurrency + 4, thread_name_prefix="runledger-tool"
            )
        )
        store = await WorkerStore.connect(
            self.database_url,
            min_size=1,
            # the runs' pinned connections; the helpers' (claimer, keeper, checkpointer,
            # health); the coalescers' senders (2) and the writes a failed batch sends alone
            max_size=self.concurrency + 8,
            application_name=f"runledger-worker:{self.worker_id}",
            pooler=self.pooler,
        )
        # the completions and decisions of concurrent runs share commits
        store.coalesce_writes()
        # a listener connection the server ends while it registers (an operator's
        # pg_terminate_backend, a restart: SQLSTATE class 57P) is opened again for a while
        # rather than fail the start
        until = loop.time() + REGISTER_RETRY_SECONDS
        while True:
            try:
                listen = await self._register(store)
                break
            except psycopg.OperationalError as exc:
                if (exc.sqlstate or "").startswith("57P") and loop.time() < until:
                    await asyncio.sleep(0.1)
                    continue
                await store.close()
                said = (str(exc).strip().splitlines() or ["connection failed"])[0]
                raise errors.DatabaseUnavailable(
                    f"could not open the worker's listener connection: {said}"
                ) from exc
            except BaseException:
                await store.close()
                raise
        self.store = store  # set once registered: callers wait on it
        log.info(
            "worker started",
            extra={
                "worker_id": self.worker_id,
                "flows": sorted(self.flows),
                "concurrency": self.concurrency,
                # uvloop or asyncio (--event-loop)
                "event_loop": type(asyncio.get_running_loop()).__module__.split(".")[0],
                # what the database URL reaches: direct, session or transaction (pooler)
                "database": store.executor.reach,
            },
        )
        executor = self.executor = RunExecutor(
            store,
            self.flows,
            worker_id=self.worker_id,
            limits=self.limits,
            crash=self.crash,
            metrics=self.metrics,
            claims=self,
        )
        failure: WorkerFailed | None = None
        health = None
        try:
            health = await self._serve_health()
            failure = await self._supervise(executor, listen)
            if failure is not None:
                await self._fence_all()
        finally:
            taken = failure is not None and isinstance(failure.error, WorkerIdTaken)
            if not taken:  # the row is the other worker's now: leave it alone
                with contextlib.suppress(Exception):
                    await store.registry.heartbeat_worker(
                        self.worker_id, stopped=True, incarnation=self.incarnation
                    )
            # closing the listener frees its session lock, and a run left with a tool
            # still running would be taken over at once: let those end first (the grace)
            with contextlib.suppress(Exception):
                await self.executor.settle(timeout=self.grace_seconds)
            with contextlib.suppress(Exception):
                await listen.conn.close()  # closed already unless the listener never ran
            if health is not None:
                await health.stop()
            await store.close()
            log.info("worker stopped", extra={"worker_id": self.worker_id})
        if failure is not None:
            raise failure

    async def _serve_health(self) -> Any:
        """Start /livez, /readyz and /metrics (``--http-port``); None when off."""
        if self.http_port is None:
            return None
        from runledger.worker.health import HealthServer

        assert isinstance(self.metrics, PrometheusMetrics)
        health = HealthServer(self, self.metrics, self.http_host, self.http_port)
        try:
            await health.start()
        except OSError as exc:  # the port is taken, the host is not ours: one line
            raise errors.ConfigurationError(
                f"--http-port {self.http_port} on {self.http_host}: {exc.strerror or exc}"
            ) from None
        return health

    async def _supervise(
        self, executor: RunExecutor, listen: ListenerSession
    ) -> WorkerFailed | None:
        """Claim and drain with the helpers in one task group. A helper that dies takes
        the claimer down with it; returns that failure (None after a normal stop)."""
        failure: WorkerFailed | None = None
        try:
            async with asyncio.TaskGroup() as tg:
                helpers = [
                    tg.create_task(self._guard("lease-keeper", self._keeper())),
                    tg.create_task(self._guard("watchdog", self._watchdog())),
                    tg.create_task(self._guard("listener", self._listener(listen))),
                    tg.create_task(self._guard("checkpointer", self._checkpointer())),
                ]
                await self._claimer()
                await self._drain()
                for t in helpers:
                    t.cancel()
        except* WorkerFailed as group:
            failure = _first(group)
            if isinstance(failure.error, WorkerIdTaken):  # one line: not a bug
                log.critical(
                    "worker stopping: %s; fencing every run",
                    failure.error,
                    extra={"worker_id": self.worker_id, "runs": sorted(self.active)},
                )
            else:
                log.critical(
                    "worker stopping: internal task %s died (%r); fencing every run",
                    failure.task,
                    failure.error,
                    exc_info=failure.error,
                    extra={
                        "worker_id": self.worker_id,
                        "task": failure.task,
                        "runs": sorted(self.active),
                    },
                )
        return failure

    async def _guard(self, name: str, helper: Coroutine[Any, Any, None]) -> None:
        """Run one helper; what it did not expect becomes the worker's failure."""
        try:
            await helper
        except Exception as exc:
            raise WorkerFailed(name, exc) from exc

    async def _fence_all(self) -> None:
        """After a helper died: stop every run now and hand back what can be handed back."""
        self.stopping.set()
        for a in self.active.values():
            a.draining = True
        leftovers = list(self.active.values())
        for a in leftovers:
            self._fence(a, "the worker is stopping after an internal failure")
        await self._hand_back(leftovers)

    async def _hand_back(self, leftovers: list[ActiveRun]) -> None:
        """Wait for the (cancelled) tasks of ``leftovers``, let their writes and tool
        results land, then release each lease no tool thread still works under."""
        for a in leftovers:
            if a.task is not None:
                with contextlib.suppress(asyncio.CancelledError, Exception):
                    await a.task
        # writes already sent and results of tool threads still running: let them land
        # before handing runs back, so a late receipt is journaled, not lost
        await self.executor.settle(timeout=max(1.0, min(self.grace_seconds, 10.0)))
        for a in leftovers:
            if self.executor.busy(a.run_id):
                log.warning(
                    "a tool thread is still running: leaving the lease to expire",
                    extra={"run_id": a.run_id, "worker_id": self.worker_id},
                )
                continue
            with contextlib.suppress(Exception):
                assert self.store is not None
                await self.store.release_lease(a.run_id, a.claim.lease_id, a.claim.fencing_token)
                self.metrics.finished(a.claim, "released")

    async def _drain(self) -> None:
        for a in self.active.values():
            a.draining = True
        tasks = [a.task for a in self.active.values() if a.task is not None]
        if tasks:
            _, pending = await asyncio.wait(tasks, timeout=self.grace_seconds)
            leftovers = [a for a in self.active.values() if a.task in pending]
            for a in leftovers:
                assert a.task is not None
                a.task.cancel()
            await self._hand_back(leftovers)
        await self.executor.settle(timeout=1.0)

    async def _execute(self, active: ActiveRun, after: asyncio.Task[None] | None = None) -> None:
        try:
            if after is not None:  # a run claimed with another's final decision: its end
                await asyncio.wait([after])  # (and its connection given back) first
            await self.executor.execute(active)
        finally:
            # the same run may have been claimed again meanwhile (its lease expired while
            # this task still ran): only forget our own entry
            if self.active.get(active.run_id) is active:
                del self.active[active.run_id]
            if active.fenced is not None:
                writes = self.executor.writes
                writes.track(active, self._release_stale(active), busy=False, kind="stale")
            self.wake.set()

    async def _release_stale(self, active: ActiveRun) -> None:
        """A fenced run whose lease a failover made stale: once nothing of it is in flight
        here (its tools ended, their sends released), hand it back, so that it is claimed
        at once rather than when the failover's wait on its lease ends. Any other lease
        is left alone (``release_stale_lease`` says false)."""
        assert self.store is not None
        c = active.claim
        await self.executor.writes.settled(c.run_id)
        try:
            released = await self.store.release_stale_lease(
                c.run_id, c.lease_id, c.fencing_token, self.worker_id
            )
        except Exception as exc:  # its lease expires instead
            log.info("a fenced run not handed back: %r", exc, extra={"run_id": c.run_id})
            return
        if released:
            log.info(
                "fenced run handed back after a failover",
                extra={
                    "run_id": c.run_id,
                    "worker_id": self.worker_id,
                    "fencing_token": c.fencing_token,
                },
            )

    # -- lease keeper --------------------------------------------------------------------

    async def _keeper(self) -> None:
        assert self.store is not None
        interval = self.lease_seconds / 3
        while True:
            await asyncio.sleep(interval)
            _stop_if_cancelled()
            held = list(self.active.values())
            # asyncio.timeout, not wait_for: on 3.11, wait_for returns the result of a
            # statement that completed as this task was cancelled, swallowing the cancel,
            # and this loop ends only by its cancellation (the worker's stop would wait
            # for it forever)
            try:
                if held:
                    await self._renew(held, interval)
                beat = time.monotonic()
                async with asyncio.timeout(interval):
                    # refused once another process took the id (it was silent too long)
                    await self.store.registry.heartbeat_worker(
                        self.worker_id, incarnation=self.incarnation
                    )
                self._vouched(beat)
            except errors.WorkerConflict as exc:
                raise WorkerIdTaken(conflict_message(self.worker_id, exc)) from exc
            except EXPECTED as exc:  # the watchdog fences meanwhile; anything else is a bug
                log.warning(
                    "lease renewal or heartbeat failed: %s",
                    describe(exc),
                    extra={"worker_id": self.worker_id},
                )
                log.debug("lease renewal or heartbeat failed", exc_info=True)

    async def _renew(self, held: list[ActiveRun], interval: float) -> None:
        """Renew every held lease in one call through the pool. When the pool fails (a
        pooler restarting, a pooled connection broken and the pool waiting before it
        reconnects), again on a session of its own, to the direct URL when there is one,
        with a short back-off, until the first of the leases' local deadlines: a pooler
        outage shorter than that costs no lease. Past it the watchdog fences."""
        assert self.store is not None
        until = min(a.deadline for a in held)
        run_ids, lease_ids = [a.run_id for a in held], [a.claim.lease_id for a in held]
        sent = time.monotonic()
        try:
            # a renewal stuck (a lock, a half-open connection) must not outlive the
            # leases it is for
            async with asyncio.timeout(max(0.0, min(interval, until - sent))):
                renewed = await self.store.renew_leases(
                    self.worker_id, run_ids, lease_ids, self.lease
                )
        except EXPECTED as exc:
            aside = self.direct_url or self.database_url
            log.warning(
                "lease renewal through the pool failed (%s): renewing on a session of its own",
                describe(exc),
                extra={"worker_id": self.worker_id, "runs": len(held)},
            )
            delay = 0.05
            while True:
                left = until - time.monotonic()
                if left <= 0:
                    raise
                sent = time.monotonic()
                try:
                    renewed = await self.store.renew_leases(
                        self.worker_id, run_ids, lease_ids, self.lease, aside=aside, timeout=left
                    )
                    break
                except EXPECTED as again:
                    log.debug("lease renewal aside failed: %s", describe(again))
                await asyncio.sleep(min(delay, max(0.0, until - time.monotonic())))
                delay = min(delay * 2, 0.5)
            log.info(
                "leases renewed on a session of their own",
                extra={"worker_id": self.worker_id, "runs": len(renewed)},
            )
        kept = {r.run_id for r in renewed}
        self.metrics.renewed(len(kept))
        for a in held:
            if a.run_id in kept:
                a.deadline = sent + self.lease_seconds - self.margin
            elif self.active.get(a.run_id) is a and not a.ending:
                # not one that just finished (its task is still unwinding), nor one whose
                # final write is on its way
                self._fence(a, "lease not renewed")

    async def _checkpointer(self) -> None:
        """A checkpoint of the event chains every :data:`CHECKPOINT_EVERY` s, made by
        whichever worker comes first (``checkpoint_events`` skips when the last one is
        younger). A failure is logged and tried again at the next tick."""
        assert self.store is not None
        every = dt.timedelta(seconds=CHECKPOINT_EVERY)
        while True:
            await asyncio.sleep(CHECKPOINT_EVERY)
            _stop_if_cancelled()
            try:
                # a backlog's checkpoint (500,000 events at most) takes seconds; a timeout
                # scope, not wait_for, as in _keeper: a cancellation is never swallowed
                async with asyncio.timeout(6 * CHECKPOINT_EVERY):
                    made = await self.store.registry.checkpoint_events(self.worker_id, every)
            except EXPECTED as exc:
                log.warning(
                    "event checkpoint failed: %s",
                    describe(exc),
                    extra={"worker_id": self.worker_id},
                )
                log.debug("event checkpoint failed", exc_info=True)
                continue
            if made["created"]:
                log.debug(
                    "event checkpoint %s: %s runs through event %s",
                    made["checkpoint_id"],
                    made["runs"],
                    made["through_event_id"],
                    extra={"worker_id": self.worker_id},
                )

    async def _watchdog(self) -> None:
        """Fence every run whose local deadline passed, whatever the keeper is doing."""
        tick = min(0.25, self.lease_seconds / 6)
        while True:
            await asyncio.sleep(tick)
            now = time.monotonic()
            deadline = self._listener_deadline
            if deadline is not None and now >= deadline:
                self._listener_lost("no listener heartbeat answered within its budget")
            for a in list(self.active.values()):
                if now >= a.deadline:
                    self._fence(a, "local lease deadline passed")

    def _fence(self, active: ActiveRun, why: str) -> None:
        """Stop working on a run at once: its lease is gone or may be gone."""
        self.metrics.lease_lost()
        log.warning(
            "dropping run: %s",
            why,
            extra={
                "run_id": active.run_id,
                "worker_id": self.worker_id,
                "fencing_token": active.claim.fencing_token,
            },
        )
        if active.task is not None and not active.task.done():
            active.fenced = active.fenced or why
            active.task.cancel()


def _stop_if_cancelled() -> None:
    """End a helper loop whose cancellation a callee swallowed. On Python 3.11 a wait that
    completes as its task is cancelled (``asyncio.wait_for``, also inside psycopg_pool's
    ``getconn`` when a connection is handed over at that moment) returns its result and
    drops the CancelledError, but the request stays counted (``Task.cancelling()``): the
    keeper and the checkpointer, which end only by cancellation, check it every turn."""
    task = asyncio.current_task()
    if task is not None and task.cancelling():
        raise asyncio.CancelledError
