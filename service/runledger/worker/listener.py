"""The worker's listener session: LISTEN, the registration, the session lock, the heartbeat.

The listener is one long-lived connection of its own. The worker registers on it
(``register_worker_v2``), so the registration lives exactly as long as that database
session, and -- where the session is provably the worker's own -- it holds a
session-level advisory lock under a key minted for this session. Claims stamp that key
on the runs; when the session ends (the process died and the kernel closed its socket,
or the server dropped the session), the server frees the lock at once and another
worker takes the runs over without waiting for their leases to expire.

That is safe only because a worker that is alive but cut off stops every run before the
server can drop its session (docs/leases.md has the argument):

- the worker: a heartbeat every :data:`HEARTBEAT` s; when none was answered within
  :data:`BUDGET` s of being sent, the worker fences every run (the watchdog enforces it,
  whatever the heartbeat coroutine is stuck in); libpq keepalives and
  ``tcp_user_timeout`` (:data:`CLIENT_TCP`) make the socket itself fail soon after;
- the server: this session's ``tcp_keepalives_*`` and ``tcp_user_timeout``
  (:data:`SERVER_TCP`) keep it from dropping the session sooner than
  :data:`SERVER_MIN_DROP` s after it last heard from the worker.

``BUDGET`` + the watchdog's tick + the one-way delay bound < ``SERVER_MIN_DROP``.

Where the session cannot be trusted to be the worker's own (a pooler or proxy between
the worker and the server: the backend pid changes between statements, or the server
sees another client port than the worker's socket has), the worker registers without
a lock and its runs are taken over on lease expiry only (:func:`untrusted_because`).
Nor is its registration tied to that session (``register_worker_v2``'s ``p_session``
false, revision 0032): a pooler's server session outlives the worker (session mode) or
serves another client at the next transaction (transaction mode). The id is then the
worker's until it stops or has been silent for its lease. Through a pooler in
transaction mode the listener does not LISTEN either (a notification would go to
whichever client the server session serves), and prepares nothing: the worker polls.
A direct URL (``RUNLEDGER_DIRECT_URL``) past the pooler gives the listener a session of
its own again.
"""

from __future__ import annotations

import asyncio
import functools
import logging
import time
import uuid
from collections.abc import AsyncIterator, Callable, Sequence
from dataclasses import dataclass
from typing import Any

import psycopg
from psycopg.conninfo import make_conninfo

from runledger.db.pooler import Reach, backend, local_port
from runledger.db.registry import RUNS_CHANNEL
from runledger.db.worker_store import WorkerStore
from runledger.worker.liveness import process_identity

log = logging.getLogger(__name__)

CHANNEL = RUNS_CHANNEL

HEARTBEAT = 0.5  # s between two heartbeats on the listener (also the takeover wake-up)
BUDGET = 5.0  # s: no heartbeat answered within this since it was sent -> fence every run
SERVER_MIN_DROP = 15.0  # s: the server keeps the session at least this long without news

# Per listener session, on the server. With tcp_user_timeout set, Linux drops a
# connection on keepalive failure only once nothing was received for tcp_user_timeout,
# and on unacknowledged data once it stayed unacknowledged that long; without it
# (PostgreSQL < 12), keepalive drops after idle + count * interval = 15 s. (Session 4
# raised BUDGET from 3 s and the drop from 10 s: on a loaded 2-core CI box an event loop
# and its backend were held up past 3 s, and the worker fenced runs it still held.)
SERVER_TCP: tuple[tuple[str, str], ...] = (
    ("tcp_keepalives_idle", "10"),
    ("tcp_keepalives_interval", "1"),
    ("tcp_keepalives_count", "5"),
)
SERVER_USER_TIMEOUT_MS = "15000"

# libpq, for the listener connection: a dead network fails the socket itself soon after
# the heartbeat has given up (the heartbeat, not these, is what fences the runs)
CLIENT_TCP: dict[str, str] = {
    "keepalives": "1",
    "keepalives_idle": "1",
    "keepalives_interval": "1",
    "keepalives_count": "2",
    "tcp_user_timeout": "5000",
}


class ListenerMoved(ConnectionError):
    """The heartbeat was answered by another backend than the one registered on: the
    session is not the worker's own (a pooler moved it)."""


@dataclass(slots=True, kw_only=True)
class ListenerSession:
    """An open listener connection, registered on and listening."""

    conn: psycopg.AsyncConnection[Any]
    backend_pid: int
    lock_key: int | None  # the session lock's key; None: no lock (lease expiry only)
    untrusted: str | None  # why there is no lock, when there is none
    # the session is the worker's own: the registration is tied to it (and another
    # backend answering a heartbeat means it moved); else the id is held by heartbeats
    own: bool = True
    listening: bool = True  # LISTEN works on it (not through a transaction pooler)
    # when (monotonic) its last statement was sent, answered: the server heard from us
    # then, as after a heartbeat
    vouched_at: float
    # when (monotonic) the registration was sent: without a session of its own, the id is
    # the worker's until it has been silent for its lease, counted from then at the latest
    registered_at: float = 0.0


async def untrusted_because(conn: psycopg.AsyncConnection[Any]) -> str | None:
    """Why a session lock on ``conn`` could not be trusted to live exactly as long as
    this process's connection, or None when it can: the same backend answers two
    statements, and it sees the client port this socket has (no pooler, no proxy)."""
    first, port = await backend(conn)
    second, _ = await backend(conn)
    if first != second:
        return f"the backend changed between two statements ({first}, then {second}): a pooler"
    local = local_port(conn)
    if local != port:
        return (
            f"the server sees client port {port}, this connection's socket has {local}: "
            "a pooler or proxy between the worker and the server"
        )
    return None


THROUGH_POOLER = {
    "transaction": "the database URL reaches a pooler in transaction mode: no session of its own",
    "session": "the database URL reaches a pooler or proxy in session mode: its server "
    "session outlives the worker",
}


async def _set_server_timeouts(store: WorkerStore, conn: psycopg.AsyncConnection[Any]) -> None:
    """This session's server-side keepalives and (PostgreSQL 12+) ``tcp_user_timeout``."""
    settings = list(SERVER_TCP)
    if conn.info.server_version >= 120000:
        settings.append(("tcp_user_timeout", SERVER_USER_TIMEOUT_MS))
    await store.registry.set_session(conn, settings)


async def open_session(
    url: str,
    store: WorkerStore,
    *,
    worker_id: str,
    hostname: str,
    pid: int,
    flows: Sequence[str],
    session_locks: bool,
    through: Reach = "direct",
    incarnation: uuid.UUID | None = None,
    silent_after: float | None = None,
    gone_process: str | None = None,
    opened: Callable[[int], None] | None = None,
) -> ListenerSession:
    """A new listener connection: its timeouts set, registered on (with a session lock
    where the session is trusted), and listening. ``through``: what ``url`` reaches
    (:mod:`runledger.db.pooler`); through a pooler the registration is not tied to the
    session but held by heartbeats (``silent_after``, the worker's lease), and through
    one in transaction mode nothing is prepared and nothing LISTENed. ``opened`` is told
    the backend pid of the connection as soon as it is open, before anything is
    registered on it. ``gone_process``: the registered process of this worker id, which
    the caller found gone on this host (``register_worker_v2``'s ``p_gone_process``)."""
    pooled = through == "transaction"
    conn = await psycopg.AsyncConnection.connect(
        make_conninfo(url, **CLIENT_TCP),
        autocommit=True,
        application_name=f"runledger-listener:{worker_id}"[:63],
        # through a transaction pooler a prepared statement is another client's next time
        **({"prepare_threshold": None} if pooled else {}),
    )
    if opened is not None:
        opened(conn.info.backend_pid)
    try:
        untrusted: str | None = THROUGH_POOLER.get(through)
        if untrusted is None:
            if session_locks:
                await _set_server_timeouts(store, conn)
            untrusted = await untrusted_because(conn)
        own = untrusted is None
        if own and not session_locks:
            untrusted = "session locks are off (--no-session-locks)"
        process = process_identity(pid)  # for a peer on this host to tell it gone
        registered_at = time.monotonic()
        register = functools.partial(
            store.registry.register_worker,
            conn,
            worker_id,
            hostname,
            pid,
            flows,
            process=process,
            incarnation=incarnation,
            silent_after=silent_after,
        )
        key, answered = await register(
            session_lock=untrusted is None, session=own, gone_process=gone_process
        )
        if key is not None:
            again, _ = await backend(conn)
            if again != answered:  # the lock went to another backend: a pooler after all
                untrusted = f"the backend changed after registering ({answered}, then {again})"
                own = False
                registered_at = time.monotonic()
                key, answered = await register(session_lock=False, session=False)
        vouched_at = time.monotonic()
        if not pooled:
            await store.registry.listen(conn)
    except BaseException:
        await conn.close()
        raise
    return ListenerSession(
        conn=conn,
        backend_pid=answered,
        lock_key=key,
        untrusted=untrusted,
        own=own,
        listening=not pooled,
        vouched_at=vouched_at,
        registered_at=registered_at,
    )


async def heartbeat(session: ListenerSession, store: WorkerStore, worker_id: str) -> bool:
    """One heartbeat: whether a run of this worker's flows waits, held by a session that
    ended; :class:`ListenerMoved` if another backend answered a session of its own."""
    answered, due = await store.registry.heartbeat_listener(session.conn, worker_id)
    if session.own and answered != session.backend_pid:
        raise ListenerMoved(
            f"heartbeat answered by backend {answered}, registered on {session.backend_pid}"
        )
    return due


async def notifications(session: ListenerSession, timeout: float) -> AsyncIterator[str]:
    """The payloads of the notifications that arrive within ``timeout`` s (none, after
    that long, where the session does not LISTEN)."""
    if not session.listening:
        await asyncio.sleep(timeout)
        return
    async for note in session.conn.notifies(timeout=timeout):
        yield note.payload
