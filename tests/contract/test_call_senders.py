"""Revision 0031: a call an earlier holder sent is not sent again while that sender may
still be sending it -- the database refuses (RL009) until the sender released it, the
holder found its process gone, or the sender's lease expired by the database clock."""

from __future__ import annotations

import dataclasses
from typing import Any

import psycopg
from psycopg.types.json import Jsonb

from runledger.testing import DbClock, wait_for

from .conftest import Connect
from .helpers import (
    FLOW_REF,
    LEASE_SECONDS,
    Lease,
    call,
    call_row,
    claim,
    complete,
    dispatch,
    dispatched_call,
    events,
    key,
    record_turn,
    refused,
    scalar,
    submit,
    submit_and_claim,
)

Conn = psycopg.Connection[Any]


def register(listener: Conn, worker_id: str, process: str | None = None) -> None:
    listener.execute(
        "SELECT * FROM runledger.register_worker_v2(%s, 'host', 1, %s::text[], true, %s)",
        (worker_id, [FLOW_REF], process),
    )


def refused_registration(listener: Conn, worker_id: str, process: str) -> bool:
    """Register ``worker_id`` on ``listener``; True when the id is still another live
    session's (RL008)."""
    try:
        register(listener, worker_id, process)
    except psycopg.Error as exc:
        if exc.sqlstate != "RL008":
            raise
        return True
    return False


def sender(conn: Conn, lease: Lease, k: str) -> dict[str, Any] | None:
    row = conn.execute(
        "SELECT * FROM runledger.call_sender(%s, %s, %s, %s)",
        (lease.run_id, lease.lease_id, lease.token, k),
    ).fetchone()
    return None if row is None else dict(row)


def release(conn: Conn, lease: Lease, k: str, worker_id: str, detail: dict[str, Any]) -> bool:
    return bool(
        scalar(
            conn,
            "SELECT runledger.release_call(%s, %s, %s, %s, %s, %s)",
            (lease.run_id, lease.lease_id, lease.token, k, worker_id, Jsonb(detail)),
        )
    )


def taken_over_in_flight(
    connect: Connect, worker: Conn, worker2: Conn, process: str | None = None
) -> tuple[Lease, Lease, str]:
    """w1 (its listener holding a session lock) sends r1's call; its listener session
    ends while the call is in flight; w2 takes the run over before w1's lease expires."""
    listener = connect("runledger_worker")
    register(listener, "w1", process)
    old = submit_and_claim(worker, "r1", "w1")
    k = dispatched_call(worker, old)
    listener2 = connect("runledger_worker")
    register(listener2, "w2")
    listener.close()  # the session ends; the process (this test) lives on
    [new] = wait_for(lambda: claim(worker2, "w2"), timeout=10, what="w2 takes r1 over")
    assert new.takeover and new.token == old.token + 1
    return old, new, k


def test_a_call_in_flight_is_not_sent_again_while_its_sender_may_be_sending_it(
    connect: Connect, worker: Conn, worker2: Conn, admin_conn: Conn
) -> None:
    old, new, k = taken_over_in_flight(connect, worker, worker2)
    seen = sender(worker2, new, k)
    assert seen is not None
    assert seen["sender"] == "w1" and seen["sender_token"] == old.token and seen["attempt"] == 1
    assert seen["until"] == old.lease_expires_at  # the lease that still ran
    assert seen["released"] is None
    with refused(admin_conn, "RL009") as caught:
        dispatch(worker2, new, k)
    assert "until" in str(caught.value.diag.message_detail) or caught.value.diag.message_detail
    assert call_row(admin_conn, k)["dispatched_token"] == old.token  # nothing written


def test_the_senders_release_lets_the_holder_send_it_again_and_carries_its_result(
    connect: Connect, worker: Conn, worker2: Conn, admin_conn: Conn
) -> None:
    old, new, k = taken_over_in_flight(connect, worker, worker2)
    # the sender's tool returned after the takeover: its write is refused, its release is not
    with refused(admin_conn, "RL001"):
        complete(worker, old, k, "succeeded", {"id": 7})
    returned = {"ended": "returned", "result": {"id": 7}, "receipt": {"ref": "x"}}
    assert release(worker, old, k, "w1", returned) is True
    assert release(worker, old, k, "w1", returned) is False  # once
    seen = sender(worker2, new, k)
    assert seen is not None and seen["until"] is None
    assert seen["released"]["result"] == {"id": 7} and seen["released"]["by"] == "sender"
    [event] = events(admin_conn, "r1", "send_released")
    assert event["actor"] == "w1" and event["fencing_token"] is None
    assert event["detail"]["sender_token"] == old.token and event["detail"]["attempt"] == 1
    assert dispatch(worker2, new, k) == 2


def test_an_expired_lease_frees_the_call_without_a_release(
    connect: Connect, worker: Conn, worker2: Conn, admin_conn: Conn, db_clock: DbClock
) -> None:
    _, new, k = taken_over_in_flight(connect, worker, worker2)
    with refused(admin_conn, "RL009"):
        dispatch(worker2, new, k)
    # w2 renews while it waits; then the clock passes w1's lease
    worker2.execute(
        "SELECT * FROM runledger.renew_leases('w2', %s::text[], %s::uuid[], %s::interval)",
        ([new.run_id], [new.lease_id], "1 hour"),
    )
    db_clock.advance(LEASE_SECONDS + 1)
    seen = sender(worker2, new, k)
    assert seen is not None and seen["until"] is None and seen["released"] is None
    assert dispatch(worker2, new, k) == 2


def test_the_holder_releases_a_call_whose_senders_process_is_gone(
    connect: Connect, worker: Conn, worker2: Conn, admin_conn: Conn
) -> None:
    old, new, k = taken_over_in_flight(connect, worker, worker2, process="linux/b/ns/42/7")
    seen = sender(worker2, new, k)
    assert seen is not None
    assert seen["process"] == "linux/b/ns/42/7" and seen["registered_at"] <= seen["dispatched_at"]
    # only with the evidence
    for bad in ({"ended": "process_gone"}, {"ended": "returned", "process": "p"}):
        with refused(admin_conn, "RL006", bad):
            release(worker2, new, k, "w2", bad)
    # the old sender cannot claim its own process is gone
    with refused(admin_conn, "RL006"):
        release(worker, old, k, "w1", {"ended": "process_gone", "process": "p"})
    gone = {"ended": "process_gone", "process": seen["process"]}
    assert release(worker2, new, k, "w2", gone) is True
    [event] = events(admin_conn, "r1", "send_released")
    assert event["detail"]["by"] == "holder" and event["fencing_token"] == new.token
    assert dispatch(worker2, new, k) == 2


def test_a_release_is_refused_to_a_lease_that_did_not_send_the_call(
    connect: Connect, worker: Conn, worker2: Conn, admin_conn: Conn
) -> None:
    old, new, k = taken_over_in_flight(connect, worker, worker2)
    forged = dataclasses.replace(old, lease_id=new.lease_id)  # w1's token, w2's lease id
    for lease, detail in (
        (forged, {"ended": "cancelled"}),
        (new, {"ended": "cancelled"}),  # the holder: only process_gone, with evidence
    ):
        with refused(admin_conn, "RL001" if lease is forged else "RL006", lease.lease_id):
            release(worker2, lease, k, "w2", detail)
    for bad in (None, [], {"ended": "maybe"}, {"ended": 1}, {}):
        with refused(admin_conn, "RL006", bad):
            worker.execute(
                "SELECT runledger.release_call(%s, %s, %s, %s, 'w1', %s)",
                (old.run_id, old.lease_id, old.token, k, None if bad is None else Jsonb(bad)),
            )
    with refused(admin_conn, "RL003"):
        release(worker, old, key("r1", 0, "nope"), "w1", {"ended": "cancelled"})
    assert events(admin_conn, "r1", "send_released") == []


def test_a_run_requeued_by_its_holder_is_not_held_back(
    worker: Conn, worker2: Conn, admin_conn: Conn
) -> None:
    """Without a takeover from a lease that still ran (a release: the holder's own hand
    back, as after it has stopped its tools) nothing waits."""
    old = submit_and_claim(worker, "r1", "w1")
    k = dispatched_call(worker, old)
    worker.execute(
        "SELECT runledger.release_lease(%s, %s, %s)", (old.run_id, old.lease_id, old.token)
    )
    [new] = claim(worker2, "w2")
    assert not new.takeover
    seen = sender(worker2, new, k)
    assert seen is not None and seen["until"] is None
    assert dispatch(worker2, new, k) == 2


def test_a_next_call_dispatched_with_a_result_checks_its_sender_too(
    connect: Connect, worker: Conn, worker2: Conn, admin_conn: Conn
) -> None:
    """complete_call_v2's next call, dispatched in the same transaction: the same refusal,
    and nothing of the completion is written either."""
    listener = connect("runledger_worker")
    register(listener, "w1")
    submit(worker, "r1")
    [old] = claim(worker, "w1", max_runs=1)
    record_turn(worker, old, 0, [call("c1"), call("c2")])
    k1, k2 = key("r1", 0, "c1"), key("r1", 0, "c2")
    dispatch(worker, old, k1)
    dispatch(worker, old, k2)
    listener2 = connect("runledger_worker")
    register(listener2, "w2")
    listener.close()
    [new] = wait_for(lambda: claim(worker2, "w2"), timeout=10, what="w2 takes r1 over")
    assert release(worker, old, k1, "w1", {"ended": "cancelled"}) is True
    assert dispatch(worker2, new, k1) == 2
    with refused(admin_conn, "RL009"):
        worker2.execute(
            "SELECT runledger.complete_call_v2(%s, %s, %s, %s, 'succeeded', %s, NULL, %s)",
            (new.run_id, new.lease_id, new.token, k1, Jsonb({}), k2),
        )
    assert call_row(admin_conn, k2)["dispatched_token"] == old.token
    assert call_row(admin_conn, k1)["status"] == "dispatched"


def test_a_call_dispatched_but_never_sent_is_released_as_such(
    connect: Connect, worker: Conn, worker2: Conn, admin_conn: Conn
) -> None:
    old, new, k = taken_over_in_flight(connect, worker, worker2)
    assert release(worker, old, k, "w1", {"ended": "not_sent"}) is True
    seen = sender(worker2, new, k)
    assert seen is not None and seen["until"] is None
    assert seen["released"]["ended"] == "not_sent"
    assert dispatch(worker2, new, k) == 2


def test_a_sender_restarted_under_its_own_id_is_named_by_the_process_that_claimed(
    connect: Connect, worker: Conn, worker2: Conn, admin_conn: Conn
) -> None:
    """The worker id registered again by a new process (a restart under the same id):
    the sender's process is still the one that claimed the run under the sender's token
    (its claim's event records it), dated by that claim, so its peer can find it gone."""
    listener = connect("runledger_worker")
    register(listener, "w1", "linux/b/ns/42/7")
    old = submit_and_claim(worker, "r1", "w1")
    k = dispatched_call(worker, old)
    [claimed] = events(admin_conn, "r1", "claimed")
    assert claimed["detail"]["process"] == "linux/b/ns/42/7"
    listener.close()  # the old process is gone; the new one takes the id over
    listener2 = connect("runledger_worker")
    listener2.execute(
        "SELECT * FROM runledger.register_worker_v2('w1', 'host', 2, %s::text[], true,"
        " 'linux/b/ns/43/9', NULL, true, NULL, 'linux/b/ns/42/7')",
        ([FLOW_REF],),
    )
    [new] = wait_for(lambda: claim(worker2, "w1"), timeout=10, what="w1 takes r1 over")
    assert new.takeover and new.token == old.token + 1
    [takeover] = events(admin_conn, "r1", "takeover")
    assert takeover["detail"]["process"] == "linux/b/ns/43/9"
    seen = sender(worker2, new, k)
    assert seen is not None and seen["sender"] == "w1" and seen["sender_token"] == old.token
    assert seen["until"] is not None  # the old lease still runs: only the process tells
    assert seen["process"] == "linux/b/ns/42/7"
    assert seen["registered_at"] == claimed["at"] <= seen["dispatched_at"]


def test_a_claim_recorded_without_a_process_leaves_the_registered_one(
    connect: Connect, worker: Conn, worker2: Conn, admin_conn: Conn
) -> None:
    """A worker that registered no process claims with none in its event: the sender's
    process is then as its worker id is registered now, with the time of that
    registration (here after the send: no proof about the process that sent it)."""
    listener = connect("runledger_worker")
    register(listener, "w1")
    old = submit_and_claim(worker, "r1", "w1")
    k = dispatched_call(worker, old)
    [claimed] = events(admin_conn, "r1", "claimed")
    assert "process" not in claimed["detail"]
    listener.close()
    listener2 = connect("runledger_worker")
    register(listener2, "w2")
    listener3 = connect("runledger_worker")
    wait_for(
        lambda: not refused_registration(listener3, "w1", "linux/b/ns/43/9"),
        timeout=10,
        what="w1's id free again",
    )
    [new] = wait_for(lambda: claim(worker2, "w2"), timeout=10, what="w2 takes r1 over")
    seen = sender(worker2, new, k)
    assert seen is not None and seen["process"] == "linux/b/ns/43/9"
    assert seen["registered_at"] > seen["dispatched_at"]
