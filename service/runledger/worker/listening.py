"""The worker's side of its listener session, as a base class of
:class:`~runledger.worker.process.Worker`: open and register (retrying a refused id for a
moment), heartbeat and notifications, and what happens when the session comes up or is
lost. The session itself (settings, trust, lock, heartbeat statement) is
:mod:`runledger.worker.listener`; why losing it fences every run is docs/leases.md.
"""

from __future__ import annotations

import asyncio
import collections
import logging
import math
import os
import socket
import time
import uuid

import psycopg

from runledger import errors
from runledger.db.reads import Registration
from runledger.db.worker_store import WorkerStore
from runledger.flows import Flow
from runledger.worker import listener
from runledger.worker.listener import ListenerSession
from runledger.worker.liveness import process_gone
from runledger.worker.runs import ActiveRun, Vouch

log = logging.getLogger("runledger.worker.process")

# what a helper task survives and retries: the database refused, went away or was slow
EXPECTED = (errors.RunLedgerError, psycopg.Error, OSError, TimeoutError)

# how long a refused registration is retried: the backend of a predecessor that was just
# SIGKILLed with this id may take a moment to notice and exit
REGISTER_PATIENCE = 5.0
# while the worker's own lost listener session still holds its id: said again this often
OWN_SESSION_RETELL = 60.0
# how long a refused registration waits for a holder registered through a pooler (held
# by its heartbeats alone) to have been silent for its lease, at most (revision 0032)
SILENT_PATIENCE = 120.0


def is_worker_conflict(exc: BaseException) -> bool:
    """The database refused the registration: another live session holds the worker id
    (the store maps the refusal: runledger.db.sqlstate)."""
    return isinstance(exc, errors.WorkerConflict)


def conflict_message(worker_id: str, exc: BaseException) -> str:
    """One line for a refused worker id: who holds it (the refusal's DETAIL: host, pid,
    since when) and what to do."""
    detail = getattr(exc, "detail", None) or getattr(
        getattr(exc, "diag", None), "message_detail", None
    )
    held = f" ({' '.join(str(detail).split())})" if detail else ""
    return (
        f"worker id {worker_id!r} is in use by another live worker{held}: stop that "
        "worker or start this one with another --worker-id"
    )


class WorkerIdTaken(RuntimeError):
    """Registering again after the listener reconnected was refused: another live worker
    took this worker id while we were cut off."""


class Listening:
    """The listener's state and loop. ``Worker`` provides the attributes declared here."""

    worker_id: str
    database_url: str
    direct_url: str | None
    poll_seconds: float
    lease_seconds: float
    margin: float
    flows: dict[str, Flow]
    session_locks: bool
    store: WorkerStore | None
    wake: asyncio.Event
    active: dict[str, ActiveRun]

    def _init_listening(self, session_locks: bool) -> None:
        # the listener session (docs/leases.md): whether session locks are wanted, whether
        # the current session is up and holds one, until when its last heartbeat vouches
        # for it, and a generation that moves whenever it comes up or goes down
        self.session_locks = session_locks
        self._listening = False
        self._locked = False
        self._listener_deadline: float | None = None
        self._vouch = Vouch()  # the same deadline, as every run claimed under it sees it
        self._generation = 0
        self._warned_untrusted = False
        # the backend pids of the last listener sessions this process opened that were not
        # refused (one may still hold the registration after the worker gave it up, or
        # registered before it failed: _register waits for it)
        self._own_backends: collections.deque[int] = collections.deque(maxlen=16)
        # this process's own id, which it registers with and heartbeats under: the same
        # process takes its id back at once (revision 0032)
        self.incarnation = uuid.uuid4()
        # registered without a session of its own (through a pooler): the id is this
        # worker's only while it heartbeats, and nothing is claimed past this (monotonic,
        # its last heartbeat's send time plus its lease, less the margin); inf: the
        # registration is tied to the listener's session instead
        self._registered_until = math.inf

    def _fence(self, active: ActiveRun, why: str) -> None:
        raise NotImplementedError

    @property
    def claims_paused(self) -> bool:
        """The listener that held a session lock is down: nothing is claimed until it is
        back with a new one (a claim would stamp the lock of a session that ended). Or,
        registered without a session of its own, the worker has not heartbeated for
        nearly its lease: its id may be another's by now (revision 0032)."""
        until = self._registered_until
        return (self._locked and not self._listening) or (
            until != math.inf and time.monotonic() >= until
        )

    def claims_paused_because(self) -> str | None:
        """Why nothing is claimed now (for /readyz), or None."""
        if self._locked and not self._listening:
            return "the listener session is down: claiming paused until it is back"
        if self.claims_paused:
            return "no heartbeat answered for nearly a lease: claiming paused until one is"
        return None

    def _vouched(self, sent: float) -> None:
        """A heartbeat sent at ``sent`` (monotonic) was answered: without a session of its
        own, the id is this worker's until ``sent`` + its lease by the database clock; it
        claims until a margin before that."""
        if self._registered_until != math.inf:
            self._registered_until = max(
                self._registered_until, sent + self.lease_seconds - self.margin
            )

    async def _open_listener(
        self, store: WorkerStore, gone_process: str | None = None
    ) -> ListenerSession:
        """A new listener session: registered on (the registration is this session's,
        with a session lock where it is trusted, or held by heartbeats through a pooler)
        and listening (except through a pooler in transaction mode)."""
        opened: list[int] = []
        through = "direct" if self.direct_url else store.executor.reach
        try:
            session = await listener.open_session(
                self.direct_url or self.database_url,
                store,
                worker_id=self.worker_id,
                hostname=socket.gethostname(),
                pid=os.getpid(),
                flows=sorted(self.flows),
                session_locks=self.session_locks,
                through=through,
                incarnation=self.incarnation,
                silent_after=self.lease_seconds,
                gone_process=gone_process,
                opened=opened.append,
            )
        except Exception as exc:
            if not is_worker_conflict(exc):  # refused: that session holds nothing
                self._own_backends.extend(opened)
            raise
        self._own_backends.extend(opened)
        if (
            session.untrusted is not None
            and (self.session_locks or not session.listening)
            and not self._warned_untrusted
        ):
            self._warned_untrusted = True  # once: it is the deployment, not an event
            polls = "" if session.listening else f", and claims poll every {self.poll_seconds:g} s"
            log.warning(
                "no session lock: a dead worker's runs are taken over on lease expiry only"
                "%s (%s)%s",
                polls,
                session.untrusted,
                self._pooler_advice(store, session),
                extra={"worker_id": self.worker_id},
            )
        return session

    def _pooler_advice(self, store: WorkerStore, session: ListenerSession) -> str:
        """What the one line about a pooler adds: how it was found, what to set."""
        if self.direct_url or session.own:
            return ""
        said = ""
        if store.executor.reach_why:  # found out when connecting, not said by RUNLEDGER_POOLER
            said = f"; found out when connecting: {store.executor.reach_why}"
            if store.executor.reach == "transaction":
                said += "; say so with RUNLEDGER_POOLER=transaction"
        return (
            f"{said}; set RUNLEDGER_DIRECT_URL to a URL past the pooler for a takeover at once"
            + ("" if session.listening else " and notifications")
        )

    async def _register(self, store: WorkerStore) -> ListenerSession:
        """Open the listener and register on it; a refused worker id is retried for up to
        ``REGISTER_PATIENCE`` s (a predecessor's backend may still be exiting), then
        raised.

        A refusal because a listener session of this very process still holds the id (when
        it registers again) is retried for as long as that session is open: the worker
        gave it up and fenced its runs, the server has not noticed yet (a partition that
        healed before the session's keepalives ended it; a backend slow to exit or
        stopped). The id is not another worker's, so stopping would be wrong.

        Revision 0032: the id is taken over at once from a process this host shows gone
        (a restart under the same id, whose predecessor's server session a pooler keeps
        open); and from a worker registered through a pooler, once it has been silent for
        its lease: the retry goes on until then, and stops if it heartbeats meanwhile."""
        deadline = time.monotonic() + REGISTER_PATIENCE
        delay = 0.1
        warned = False  # a live session of another process: one line, not one per attempt
        waiting_since: float | None = None
        told_at = -math.inf
        gone: str | None = None  # the registered process, found gone on this host
        silent_wait = False  # waiting for a holder without a session to be silent
        while True:
            try:
                session = await self._open_listener(store, gone)
            except Exception as exc:
                if not is_worker_conflict(exc):
                    raise
                reg = await self._registration(store)
                held_by = self._held_by_own_session(reg)
                if held_by is not None:
                    now = time.monotonic()
                    if waiting_since is None:
                        waiting_since = now
                    if now - told_at >= OWN_SESSION_RETELL:  # at once, then each minute
                        told_at = now
                        so_far = (
                            f" ({now - waiting_since:.0f} s now)" if now > waiting_since else ""
                        )
                        log.warning(
                            "this worker's previous listener session (backend %s) is still "
                            "open on the server%s; registering again once it has ended",
                            held_by,
                            so_far,
                            extra={"worker_id": self.worker_id},
                        )
                elif (
                    reg is not None
                    and reg.process
                    and reg.process != gone
                    and (process_gone(reg.process))
                ):
                    gone = reg.process
                    log.info(
                        "the process that registered this worker id (host %s pid %s) is "
                        "gone; taking the id over",
                        reg.hostname,
                        reg.pid,
                        extra={"worker_id": self.worker_id},
                    )
                    continue  # at once, with the evidence
                elif (
                    reg is not None
                    and reg.free_in is not None
                    and not silent_wait
                    and reg.free_in <= SILENT_PATIENCE
                ):
                    # held by heartbeats alone (registered through a pooler): free once the
                    # holder has been silent for its lease; a live one heartbeats first.
                    # (INFO: a wait of up to a lease says why; a refusal is still one line.)
                    silent_wait = True
                    deadline = max(deadline, time.monotonic() + max(reg.free_in, 0.0) + 1.0)
                    log.info(
                        "worker id held by a worker registered through a pooler (host %s "
                        "pid %s); taking it over if it stays silent for %.0f s more",
                        reg.hostname,
                        reg.pid,
                        max(reg.free_in, 0.0),
                        extra={"worker_id": self.worker_id},
                    )
                elif time.monotonic() + delay > deadline:
                    raise
                elif not warned:  # the refusal that ends it is the one line the user sees
                    warned = True
                    log.debug(
                        "worker id in use by a live session; retrying for up to %.0f s",
                        REGISTER_PATIENCE,
                        extra={"worker_id": self.worker_id},
                    )
            else:
                self._listener_up(session)
                return session
            await asyncio.sleep(delay)
            delay = min(delay * 2, 1.0)

    async def _registration(self, store: WorkerStore) -> Registration | None:
        """Who holds this worker id, or None when it could not be read (the refusal then
        stands as another worker's)."""
        try:
            return await store.registry.worker_registration(self.worker_id)
        except EXPECTED as exc:
            log.warning(
                "could not read who holds this worker id: %r",
                exc,
                extra={"worker_id": self.worker_id},
            )
            return None

    def _held_by_own_session(self, reg: Registration | None) -> int | None:
        """The backend pid of the listener session of this process that the worker id is
        registered on, while that session is open; None if it is another's, or when who
        holds it is not known."""
        if (
            reg is not None
            and reg.session_open
            and reg.session_pid in self._own_backends
            and reg.pid == os.getpid()
            and reg.hostname == socket.gethostname()
        ):
            return reg.session_pid
        return None

    def _listener_up(self, session: ListenerSession) -> None:
        self._generation += 1
        self._listening = True
        self._locked = session.lock_key is not None
        # without a session of its own, the registration vouches for the id from when it
        # was sent; the keeper's heartbeats renew that
        self._registered_until = (
            math.inf if session.own else session.registered_at + self.lease_seconds - self.margin
        )
        # the registration's last statement vouches for the session as a heartbeat does
        # (counting from before the connect would fence a worker whose connection setup
        # took longer than the budget, again and again)
        self._listener_deadline = session.vouched_at + listener.BUDGET if self._locked else None
        # a new vouch for the runs claimed from now on; those of an earlier session keep
        # theirs, spent when that session was lost
        self._vouch = Vouch(self._listener_deadline or math.inf)
        self.wake.set()  # catch up on what was submitted while we were away

    def _listener_lost(self, why: str) -> None:
        """The listener session is gone or may be: with a session lock, every run stops
        now (the server may free the lock soon, and another worker take the runs over)."""
        if not self._listening:
            return
        self._generation += 1
        self._listening = False
        self._listener_deadline = None
        if not self._locked:
            log.warning(
                "listener lost, polling meanwhile: %s", why, extra={"worker_id": self.worker_id}
            )
            return
        self._vouch.until = 0.0  # nothing more is sent under these leases
        log.warning(
            "listener lost: %s; fencing every run",
            why,
            extra={"worker_id": self.worker_id, "runs": sorted(self.active)},
        )
        for a in list(self.active.values()):
            a.deadline = 0.0  # nothing more is sent under these leases
            self._fence(a, "the listener session was lost")

    async def _listener(self, session: ListenerSession | None) -> None:
        assert self.store is not None
        delay = 0.1
        while True:
            try:
                if session is None:
                    try:
                        session = await self._register(self.store)
                    except Exception as exc:
                        if is_worker_conflict(exc):
                            raise WorkerIdTaken(conflict_message(self.worker_id, exc)) from exc
                        raise
                async with session.conn:
                    delay = 0.1
                    await self._serve(session)
            except EXPECTED as exc:
                self._listener_lost(repr(exc))
            session = None
            await asyncio.sleep(delay)
            delay = min(delay * 2, 5.0)

    async def _serve(self, session: ListenerSession) -> None:
        """Heartbeats and notifications on the listener, until it fails. The watchdog
        fences on the heartbeat's budget; this only says when the session is done."""
        assert self.store is not None
        while True:
            sent = time.monotonic()
            # asyncio.timeout, not wait_for: on 3.11, wait_for returns the result of an
            # operation that completed as the task was cancelled, swallowing the cancel
            async with asyncio.timeout(listener.BUDGET):
                due = await listener.heartbeat(session, self.store, self.worker_id)
            if not self._listening:  # the watchdog gave up on this session meanwhile
                raise ConnectionError("the listener heartbeat missed its budget")
            if self._locked:
                self._listener_deadline = self._vouch.until = sent + listener.BUDGET
            if due:
                self.wake.set()
            async for payload in listener.notifications(session, listener.HEARTBEAT):
                if payload in self.flows:
                    self.wake.set()
