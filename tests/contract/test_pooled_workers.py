"""Workers behind a pooler (revision 0032): a registration not tied to a database session.

Through PgBouncer a worker has no session of its own. In session mode the pooler keeps the
server session open after the worker died; in transaction mode the next transaction may
be on another server session, and the first stays open for other clients. So
``register_worker_v2(..., p_session => false)`` records no session, and the id is held by
the worker's heartbeats instead: refused to another worker until its holder stopped or
has been silent for ``p_silent_after`` (by the database clock); taken back at once by the
same process (``p_incarnation``), and by a worker that found the registered process gone
on its own host (``p_gone_process``). ``heartbeat_worker`` with ``p_incarnation`` refuses
any process but the holder. Here the "pooled" sessions are plain sessions that stay open,
as a pooler's do.
"""

from __future__ import annotations

import datetime as dt
import uuid
from typing import Any

import psycopg

from runledger.testing import DbClock

from .conftest import Connect
from .helpers import FLOW_REF, one, refused, scalar, sqlstate

Conn = psycopg.Connection[Any]

LEASE = dt.timedelta(seconds=30)
REGISTER = (
    "SELECT * FROM runledger.register_worker_v2(%s, %s, %s, %s::text[], %s, %s, %s::uuid, %s,"
    " %s::interval, %s)"
)
HEARTBEAT = "SELECT runledger.heartbeat_worker(%s, %s, %s::uuid)"


def register(
    conn: Conn,
    incarnation: uuid.UUID,
    *,
    worker_id: str = "w",
    host: str = "host-a",
    pid: int = 100,
    session: bool = False,
    lock: bool = False,
    process: str | None = None,
    gone: str | None = None,
    silent_after: dt.timedelta | None = LEASE,
) -> dict[str, Any]:
    row = conn.execute(
        REGISTER,
        (worker_id, host, pid, [FLOW_REF], lock, process, incarnation, session, silent_after, gone),
    ).fetchone()
    assert row is not None
    return dict(row)


def worker_row(admin: Conn, worker_id: str = "w") -> dict[str, Any]:
    row = one(admin, "SELECT * FROM runledger.workers WHERE worker_id = %s", (worker_id,))
    assert row is not None
    return row


def test_without_a_session_the_id_is_held_by_heartbeats_not_by_the_session(
    connect: Connect, admin_conn: Conn, db_clock: DbClock
) -> None:
    first, second = uuid.uuid4(), uuid.uuid4()
    pooled = connect("runledger_worker")
    row = register(pooled, first)
    assert row["session_lock"] is None
    assert row["session_pid"] == scalar(pooled, "SELECT pg_backend_pid()")
    stored = worker_row(admin_conn)
    assert (stored["session_pid"], stored["session_started_at"]) == (None, None)
    assert (stored["incarnation"], stored["silent_after"]) == (first, LEASE)

    # another worker, on the very server session the first registered on (a pooler hands
    # it out again): refused, the session is not what holds the id
    with refused(admin_conn, "RL008", "the same pooled session") as caught:
        register(pooled, second, host="host-b", pid=200)
    detail = caught.value.diag.message_detail or ""
    assert "without a session of its own" in detail and "silent for 00:00:30" in detail, detail
    # nor does the pooled session's end free it
    pooled.close()
    other = connect("runledger_worker")
    with refused(admin_conn, "RL008", "the session ended"):
        register(other, second, host="host-b", pid=200)

    # it heartbeats: still its own past the first lease
    db_clock.advance(20)
    other.execute(HEARTBEAT, ("w", False, first))
    db_clock.advance(20)
    with refused(admin_conn, "RL008", "heartbeated 20 s ago"):
        register(other, second, host="host-b", pid=200)
    # silent for its lease: another worker takes it over
    db_clock.advance(11)
    register(other, second, host="host-b", pid=200)
    stored = worker_row(admin_conn)
    assert (stored["hostname"], stored["pid"], stored["incarnation"]) == ("host-b", 200, second)


def test_the_same_process_takes_its_id_back_at_once(connect: Connect, admin_conn: Conn) -> None:
    mine, theirs = uuid.uuid4(), uuid.uuid4()
    register(connect("runledger_worker"), mine)
    # its listener moved to another server session: the same incarnation, accepted
    register(connect("runledger_worker"), mine, pid=100)
    assert worker_row(admin_conn)["incarnation"] == mine
    with refused(admin_conn, "RL008", "another process"):
        register(connect("runledger_worker"), theirs)


def test_a_locked_session_of_its_own_still_open_is_waited_for_unless_through_a_pooler(
    connect: Connect, admin_conn: Conn
) -> None:
    """The same process on a session of its own waits for its previous locked session to
    end (docs/leases.md); registering through a pooler, it takes the id back at once (the
    lock stays on a server session no run of its claims will carry again)."""
    mine = uuid.uuid4()
    locked = connect("runledger_worker")
    assert register(locked, mine, session=True, lock=True)["session_lock"] is not None
    with refused(admin_conn, "RL008", "own locked session still open"):
        register(connect("runledger_worker"), mine, session=True)
    register(connect("runledger_worker"), mine)
    stored = worker_row(admin_conn)
    assert (stored["session_pid"], stored["session_lock"]) == (None, None)


def test_a_worker_that_found_the_registered_process_gone_takes_the_id(
    connect: Connect, admin_conn: Conn
) -> None:
    """A restart under the same id: the dead worker's server session is still open (a
    pooler keeps it), its process is gone, as the restarted worker saw on its host."""
    dead = "linux/boot/pidns/4242/777"
    pooled = connect("runledger_worker")  # stays open, as PgBouncer keeps it
    register(pooled, uuid.uuid4(), session=True, process=dead)
    restart = connect("runledger_worker")
    with refused(admin_conn, "RL008", "no evidence"):
        register(restart, uuid.uuid4(), pid=300)
    with refused(admin_conn, "RL008", "evidence about another process"):
        register(restart, uuid.uuid4(), pid=300, gone="linux/boot/pidns/4242/778")
    register(restart, uuid.uuid4(), pid=300, process="linux/boot/pidns/300/900", gone=dead)
    stored = worker_row(admin_conn)
    assert (stored["pid"], stored["process"], stored["session_pid"]) == (
        300,
        "linux/boot/pidns/300/900",
        None,
    )


def test_heartbeats_and_the_stop_of_another_process_are_refused(
    connect: Connect, admin_conn: Conn, db_clock: DbClock
) -> None:
    mine, stale = uuid.uuid4(), uuid.uuid4()
    conn = connect("runledger_worker")
    register(conn, stale)
    db_clock.advance(31)  # silent: taken over
    register(conn, mine, host="host-b")
    for stopped in (False, True):
        with refused(admin_conn, "RL008", f"stale process, stopped={stopped}") as caught:
            conn.execute(HEARTBEAT, ("w", stopped, stale))
        assert "taken over" in caught.value.diag.message_primary
        assert "host host-b" in (caught.value.diag.message_detail or "")
    before = worker_row(admin_conn)["heartbeat_at"]
    db_clock.advance(1)
    conn.execute(HEARTBEAT, ("w", False, mine))
    assert worker_row(admin_conn)["heartbeat_at"] > before
    # without an incarnation (a worker of the previous release), as before; an unknown
    # id is a no-op either way
    conn.execute("SELECT runledger.heartbeat_worker('w', false)")
    conn.execute(HEARTBEAT, ("nobody", False, mine))
    conn.execute(HEARTBEAT, ("w", True, mine))
    assert worker_row(admin_conn)["stopped_at"] is not None


def test_bad_arguments_are_refused(connect: Connect, admin_conn: Conn) -> None:
    conn = connect("runledger_worker")
    cases: list[tuple[str, dict[str, Any]]] = [
        ("a lock without a session", {"lock": True, "session": False}),
        ("no silence without a session", {"silent_after": None}),
        ("a silence of nothing", {"silent_after": dt.timedelta(0)}),
        ("a silence over a day", {"silent_after": dt.timedelta(days=2)}),
        ("gone process too long", {"gone": "x" * 300}),
    ]
    for case, kwargs in cases:
        with refused(admin_conn, "RL006", case):
            register(conn, uuid.uuid4(), **kwargs)
    with sqlstate("RL006", "session NULL"):
        conn.execute(REGISTER, ("w", "h", 1, [FLOW_REF], False, None, None, None, LEASE, None))
