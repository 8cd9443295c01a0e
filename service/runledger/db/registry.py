"""Who a worker is: its registration on its listener session, its heartbeats, the
checkpoints of the event chains it makes, and the reads of its health endpoints.

Part of :class:`~runledger.db.worker_store.WorkerStore` (its ``registry``), over the same
:class:`~runledger.db.execution.Executor`. The statements on the listener session go
through :meth:`Executor.send_on`: that session is the worker's own, not a pooled one.
"""

from __future__ import annotations

import datetime as dt
import time
import uuid
from collections.abc import Sequence
from typing import Any

import psycopg

from runledger.clock import DatabaseClock
from runledger.db import observe, reads
from runledger.db.execution import Executor
from runledger.db.reads import Registration
from runledger.db.validate import check_text

RUNS_CHANNEL = "runledger_runs"  # what a run to claim is NOTIFYed on


class WorkerRegistry:
    """A worker's registration and heartbeats, over one :class:`Executor`."""

    def __init__(self, executor: Executor, clock: DatabaseClock | None = None) -> None:
        self.executor = executor
        # measured on each heartbeat (the database's now comes back with it)
        self.clock = clock if clock is not None else DatabaseClock()

    async def register_worker(
        self,
        conn: psycopg.AsyncConnection[Any],
        worker_id: str,
        hostname: str,
        pid: int,
        flows: Sequence[str],
        *,
        session_lock: bool,
        process: str | None = None,
        incarnation: uuid.UUID | None = None,
        session: bool = True,
        silent_after: float | None = None,
        gone_process: str | None = None,
    ) -> tuple[int | None, int]:
        """Register the worker on ``conn``, its long-lived session (its listener
        connection), not on a pooled one: the database ties the registration to the
        calling session and refuses the id (:class:`~runledger.errors.WorkerConflict`)
        while another live session holds it. With ``session_lock`` the session takes a
        session-level advisory lock under a fresh key. Returns the key (None without one)
        and the session's backend pid. Not retried: when ``conn`` fails, the caller opens
        a new session and registers on that one.

        ``session`` false: ``conn`` goes through a pooler, so the id is not
        tied to its session but held while the worker heartbeats: it is free once the
        worker has been silent for ``silent_after`` seconds. ``incarnation``: this
        process's own id (the same process may take its id back); ``gone_process``: the
        registered process, found gone on this host."""
        check_text("worker id", worker_id)
        check_text("hostname", hostname)
        for f in flows:
            check_text("flow", f)
        silent = None if silent_after is None else dt.timedelta(seconds=silent_after)
        row = await self.executor.send_on(
            conn,
            "SELECT session_lock, session_pid FROM runledger.register_worker_v2"
            "(%s, %s, %s, %s::text[], %s, %s, %s::uuid, %s, %s::interval, %s)",
            (
                worker_id,
                hostname,
                pid,
                list(flows),
                session_lock,
                process,
                incarnation,
                session,
                silent,
                gone_process,
            ),
        )
        assert row is not None
        key, backend = row[0], row[1]
        return (None if key is None else int(key)), int(backend)

    async def heartbeat_listener(
        self, conn: psycopg.AsyncConnection[Any], worker_id: str
    ) -> tuple[int, bool]:
        """The listener's heartbeat on ``conn``: the backend pid that answered and whether
        a run of the worker's flows waits, held by a session that ended. Not retried."""
        row = await self.executor.send_on(
            conn,
            "SELECT session_pid, takeover_due FROM runledger.heartbeat_listener(%s)",
            (worker_id,),
        )
        assert row is not None
        return int(row[0]), bool(row[1])

    async def heartbeat_worker(
        self, worker_id: str, *, stopped: bool = False, incarnation: uuid.UUID | None = None
    ) -> None:
        """The worker's heartbeat (``stopped``: it has drained); with ``incarnation``, refused with
        :class:`~runledger.errors.WorkerConflict` once another process holds the id. It
        says how far this host's clock is from the database's (as :attr:`clock` last
        measured it), and the database's clock comes back with it: a measurement."""
        offset = self.clock.host_offset()
        sent = time.monotonic()
        rows = await self.executor.read(
            "SELECT runledger.heartbeat_worker(%s, %s, %s::uuid, %s::interval),"
            " runledger.now() AS now",
            (
                worker_id,
                stopped,
                incarnation,
                None if offset is None else dt.timedelta(seconds=offset),
            ),
        )
        self.clock.measure(rows[0]["now"], sent, time.monotonic())

    async def checkpoint_events(self, actor: str, min_age: dt.timedelta) -> dict[str, Any]:
        """A checkpoint of the event chains unless
        the last one is younger than ``min_age`` (or another is being made, or no event
        came since); the newest checkpoint either way. Safe to repeat."""
        rows = await self.executor.read(
            "SELECT * FROM runledger.checkpoint_events(%s, %s)", (actor, min_age)
        )
        return rows[0]

    async def worker_registration(self, worker_id: str) -> Registration | None:
        """Who holds ``worker_id`` (None: never registered), and whether the session it
        was registered on is still open."""
        return await reads.worker_registration(self.executor, worker_id)

    # -- the listener's session ---------------------------------------------------------

    async def set_session(
        self, conn: psycopg.AsyncConnection[Any], settings: Sequence[tuple[str, str]]
    ) -> None:
        """Set ``settings`` (name, value) for the rest of ``conn``'s session."""
        await self.executor.send_on(
            conn,
            "SELECT set_config(n, v, false) FROM unnest(%s::text[], %s::text[]) AS u(n, v)",
            ([n for n, _ in settings], [v for _, v in settings]),
        )

    async def listen(self, conn: psycopg.AsyncConnection[Any]) -> None:
        """LISTEN on ``conn`` for :data:`RUNS_CHANNEL`: a run to claim."""
        await self.executor.send_on(conn, "LISTEN " + RUNS_CHANNEL, ())

    # -- health (runledger.db.observe): scrape time, never the hot path ------------------

    async def queue_depth(self, flows: Sequence[str]) -> dict[tuple[str, str], int]:
        async with self.executor.pool.connection() as conn:
            return await observe.queue_depth(conn, flows)

    async def takeover_holder(self, run_id: str, fencing_token: int) -> str | None:
        async with self.executor.pool.connection() as conn:
            return await observe.takeover_holder(conn, run_id, fencing_token)

    async def schema_revision(self) -> str | None:
        async with self.executor.pool.connection() as conn:
            return await observe.schema_revision(conn)
