"""Session locks (revision 0011): a run whose holder's listener session ended is taken over
before its lease expires; a live holder keeps its runs; fencing is as for any takeover."""

from __future__ import annotations

from typing import Any

import psycopg

from runledger.testing import DbClock, wait_for

from .conftest import Connect
from .helpers import (
    FLOW_REF,
    LEASE_SECONDS,
    Lease,
    checkpoint,
    claim,
    events,
    refused,
    run_row,
    scalar,
    submit,
    submit_and_claim,
    unchanged,
)

Conn = psycopg.Connection[Any]


def register(listener: Conn, worker_id: str, *, lock: bool = True) -> int | None:
    row = listener.execute(
        "SELECT * FROM runledger.register_worker_v2(%s, 'host', 1, %s::text[], %s)",
        (worker_id, [FLOW_REF], lock),
    ).fetchone()
    assert row is not None
    assert row["session_pid"] == scalar(listener, "SELECT pg_backend_pid()")
    return row["session_lock"]  # type: ignore[no-any-return]


def heartbeat(listener: Conn, worker_id: str) -> dict[str, Any]:
    row = listener.execute(
        "SELECT * FROM runledger.heartbeat_listener(%s)", (worker_id,)
    ).fetchone()
    assert row is not None
    return dict(row)


def taken_over(conn: Conn, worker_id: str) -> list[Lease]:
    """Claim until something is claimed (the ended session's backend may take a moment
    to exit and free its lock)."""
    return wait_for(lambda: claim(conn, worker_id), timeout=10, what=f"{worker_id} claims")


def test_a_run_whose_holders_session_ended_is_taken_over_before_its_lease_expires(
    connect: Connect, worker: Conn, worker2: Conn, admin_conn: Conn
) -> None:
    listener = connect("runledger_worker")
    key = register(listener, "w1")
    assert key is not None
    assert scalar(admin_conn, "SELECT session_lock FROM runledger.workers") == key
    old = submit_and_claim(worker, "r1", "w1")
    assert run_row(admin_conn, "r1")["lease_lock"] == key

    # alive: the lease holds, nobody takes the run, the heartbeat reports nothing due
    assert claim(worker2, "w2") == []
    listener2 = connect("runledger_worker")
    register(listener2, "w2")
    assert heartbeat(listener2, "w2")["takeover_due"] is False

    listener.close()  # the session ends: the server frees its lock
    wait_for(lambda: heartbeat(listener2, "w2")["takeover_due"], what="takeover due")
    [new] = taken_over(worker2, "w2")
    assert new.run_id == "r1" and new.takeover and new.token == old.token + 1
    assert new.lease_id != old.lease_id
    assert old.lease_expires_at > scalar(admin_conn, "SELECT runledger.now()")  # not expired
    [event] = events(admin_conn, "r1", "takeover")
    assert event["detail"]["holder"] == "session_ended"
    assert event["detail"]["previous_owner"] == "w1"
    assert event["detail"]["previous_token"] == old.token
    # w2's own lock is stamped now; the old holder is fenced as after any takeover
    assert run_row(admin_conn, "r1")["lease_lock"] == scalar(
        admin_conn, "SELECT session_lock FROM runledger.workers WHERE worker_id = 'w2'"
    )
    with refused(admin_conn, "RL001"):
        checkpoint(worker, old, 0, {"late": True})
    assert heartbeat(listener2, "w2")["takeover_due"] is False


def test_a_restarted_worker_with_the_same_id_gets_a_new_key_and_does_not_keep_its_runs(
    connect: Connect, worker: Conn, worker2: Conn, admin_conn: Conn
) -> None:
    first = connect("runledger_worker")
    old_key = register(first, "w1")
    old = submit_and_claim(worker, "r1", "w1")
    first.close()
    # the same worker id registers again from a new session (a restarted process)
    second = connect("runledger_worker")
    new_key = wait_for(lambda: _register_when_free(second, "w1"), what="w1 registered again")
    assert new_key not in (None, old_key)
    # its run still carries the ended session's lock: anyone may take it over
    [new] = taken_over(worker2, "w2")
    assert (new.run_id, new.token) == ("r1", old.token + 1)


def _register_when_free(listener: Conn, worker_id: str) -> int | None:
    try:
        return register(listener, worker_id)
    except psycopg.Error as exc:
        if exc.sqlstate == "RL008":  # the old backend has not exited yet
            return None
        raise


def test_without_a_session_lock_a_run_is_taken_over_on_expiry_only(
    connect: Connect, worker: Conn, worker2: Conn, admin_conn: Conn, db_clock: DbClock
) -> None:
    listener = connect("runledger_worker")
    assert register(listener, "w1", lock=False) is None
    old = submit_and_claim(worker, "r1", "w1")
    assert run_row(admin_conn, "r1")["lease_lock"] is None
    listener.close()
    wait_for(
        lambda: scalar(
            admin_conn,
            "SELECT count(*) = 0 FROM pg_stat_activity WHERE pid = %s",
            (scalar(admin_conn, "SELECT session_pid FROM runledger.workers"),),
        ),
        what="w1's session gone",
    )
    assert claim(worker2, "w2") == []
    db_clock.advance(LEASE_SECONDS + 1)
    [new] = claim(worker2, "w2")
    assert (new.run_id, new.token) == ("r1", old.token + 1)
    [event] = events(admin_conn, "r1", "takeover")
    assert event["detail"]["holder"] == "expired"


def test_a_worker_of_the_previous_release_does_not_inherit_a_key(
    connect: Connect, worker: Conn, worker2: Conn, admin_conn: Conn
) -> None:
    first = connect("runledger_worker")
    assert register(first, "w1") is not None
    first.execute("SELECT runledger.heartbeat_worker('w1', true)")  # stopped cleanly
    first.close()
    old_release = connect("runledger_worker")
    old_release.execute(  # no session lock: what the previous release's register_worker did
        "SELECT runledger.register_worker_v2('w1', 'host', 2, %s::text[], false)", [[FLOW_REF]]
    )
    assert scalar(admin_conn, "SELECT session_lock FROM runledger.workers") is None
    submit(worker, "r1")
    [held] = claim(worker, "w1")
    assert run_row(admin_conn, "r1")["lease_lock"] is None
    assert claim(worker2, "w2") == []  # live lease, no key: only expiry frees it
    assert held.run_id == "r1"


def test_register_worker_v2_refuses_a_null_choice_and_writes_nothing(
    worker: Conn, admin_conn: Conn
) -> None:
    with unchanged(admin_conn), refused(admin_conn, "RL006"):
        worker.execute(
            "SELECT * FROM runledger.register_worker_v2('w1', 'h', 1, %s::text[], NULL)",
            [[FLOW_REF]],
        )


def test_a_claim_costs_no_lock_of_a_live_session(
    connect: Connect, worker: Conn, worker2: Conn, admin_conn: Conn
) -> None:
    """The dead-holder check keeps no lock of a live session, and the locks it takes on
    ended sessions last only for the claim's transaction."""
    listener = connect("runledger_worker")
    key = register(listener, "w1")
    submit_and_claim(worker, "r1", "w1")
    claim(worker2, "w2")
    held = admin_conn.execute(
        "SELECT pid FROM pg_locks WHERE locktype = 'advisory' AND granted"
        " AND ((classid::bigint << 32) | objid::bigint) = %s",
        (key,),
    ).fetchall()
    assert [r[0] for r in held] == [scalar(listener, "SELECT pg_backend_pid()")]


def test_a_session_never_takes_over_the_runs_of_its_own_lock(
    connect: Connect, admin_conn: Conn
) -> None:
    """A session may take again a lock it holds: its own key is left out of the check,
    or a client that claims on its listener session would take its own runs over."""
    listener = connect("runledger_worker")
    register(listener, "w1")
    held = submit_and_claim(listener, "r1", "w1")
    assert heartbeat(listener, "w1")["takeover_due"] is False
    assert claim(listener, "w1") == []
    assert run_row(admin_conn, "r1")["fencing_token"] == held.token


def test_a_claim_from_a_worker_whose_listener_session_ended_claims_nothing(
    connect: Connect, worker: Conn, worker2: Conn, admin_conn: Conn
) -> None:
    """The server runs a statement to its end after its client died: a dead worker's claim
    in flight must not take runs (nor its own, whose lock its death just freed)."""
    listener = connect("runledger_worker")
    register(listener, "w1")
    held = submit_and_claim(worker, "r1", "w1")
    submit(worker, "r2")
    listener.close()  # w1's process is gone; a claim it sent is still on its way
    wait_for(
        lambda: (
            not scalar(
                admin_conn,
                "SELECT count(*) FROM pg_locks WHERE locktype = 'advisory' AND granted",
            )
        ),
        what="the ended session's lock freed",
    )
    with unchanged(admin_conn):
        assert claim(worker, "w1") == []  # neither r2 (queued) nor r1 (its own)
    # a live worker takes both: r1 through the ended session, r2 from the queue
    listener2 = connect("runledger_worker")
    register(listener2, "w2")
    taken = {c.run_id: c for c in claim(worker2, "w2")}
    assert set(taken) == {"r1", "r2"}
    assert taken["r1"].token == held.token + 1
