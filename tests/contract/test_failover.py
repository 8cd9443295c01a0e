"""Failover detection (revision 0010), called as workers would.

A real promotion is in tests/process/test_failover.py. Here the server stays on its
timeline and the table is made to say it last saw another one (a row added by the owner,
the table being append-only): to the claim that is the same as a promotion or a restore
(a timeline change), and the claim must record it,
end the leases it finds held, mark planned calls dispatched, list the unfinished runs
and say so in their events.
"""

from __future__ import annotations

import datetime as dt
from typing import Any

import psycopg
import pytest

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
    events,
    finish,
    key,
    paused_awaiting_approval,
    record_turn,
    record_v2,
    rows,
    run_row,
    scalar,
    sqlstate,
    submit,
    submit_and_claim,
)

Conn = psycopg.Connection[Any]


@pytest.fixture
def admin(connect: Connect) -> Conn:
    return connect("admin")


def claim_v4(conn: Conn, worker_id: str = "w2", max_runs: int = 10) -> list[dict[str, Any]]:
    return rows(
        conn,
        "SELECT * FROM runledger.claim_runs_v4(%s, %s::text[], %s, %s)",
        (worker_id, [FLOW_REF], dt.timedelta(seconds=LEASE_SECONDS), max_runs),
    )


def claim_lease(row: dict[str, Any]) -> Lease:
    return Lease(
        run_id=row["run_id"],
        lease_id=row["lease_id"],
        token=row["fencing_token"],
        state_version=row["state_version"],
        takeover=row["takeover"],
        lease_expires_at=row["lease_expires_at"],
        worker_id="w2",
    )


def timeline(conn: Conn) -> int:
    return int(scalar(conn, "SELECT runledger._timeline()"))


def pretend_last_seen(admin: Conn, other: int) -> None:
    """The schema last saw timeline ``other``: what a promotion looks like to a claim."""
    admin.execute(
        "INSERT INTO runledger.timelines (position, timeline, seen_at) "
        "SELECT max(position) + 1, %s, now() FROM runledger.timelines",
        (other,),
    )


def test_installed_on_the_current_timeline_and_claims_add_nothing(
    worker: Conn, admin: Conn
) -> None:
    seen = rows(admin, "SELECT * FROM runledger.timelines")
    assert [(r["position"], r["timeline"], r["previous_timeline"]) for r in seen] == [
        (1, timeline(admin), None)
    ]
    submit_and_claim(worker, "r1")
    claim_v4(worker)
    assert rows(admin, "SELECT position FROM runledger.timelines") == [{"position": 1}]
    assert rows(admin, "SELECT * FROM runledger.failover_runs") == []


def test_tokens_on_timeline_one_count_as_before(worker: Conn, admin: Conn) -> None:
    assert timeline(admin) == 1
    assert int(scalar(admin, "SELECT runledger._token_floor()")) == 0
    assert submit_and_claim(worker, "r1").token == 1


def test_a_new_timeline_is_recorded_with_the_runs_it_affected(worker: Conn, admin: Conn) -> None:
    now = timeline(admin)
    # a run held with a planned call, a dispatched call and one awaiting approval
    held = submit_and_claim(worker, "held", lease_seconds=3600)
    record_v2(
        worker,
        held,
        0,
        [call("c1"), call("c2"), {**call("c3"), "approval": True}],
    )
    assert dispatch(worker, held, key("held", 0, "c2")) == 1
    # a paused run whose call awaits approval, a queued run never claimed, a finished run
    paused = submit_and_claim(worker, "paused")
    paused_awaiting_approval(worker, paused)
    done = submit_and_claim(worker, "zdone")
    record_turn(worker, done, 0, [])
    finish(worker, done, "succeeded")
    submit(worker, "queued")
    last_event = int(scalar(admin, "SELECT max(event_id) FROM runledger.run_events"))

    pretend_last_seen(admin, now + 6)
    claimed = claim_v4(worker, "w2")

    seen = rows(admin, "SELECT * FROM runledger.timelines ORDER BY position")
    assert [(r["position"], r["timeline"], r["previous_timeline"]) for r in seen] == [
        (1, now, None),
        (2, now + 6, None),  # what the test added
        (3, now, now + 6),
    ]
    assert seen[2]["seen_by"] == "w2"
    assert seen[2]["affected_runs"] == 3
    assert seen[2]["last_event_id"] == last_event
    assert seen[2]["max_token"] == 1  # each run was claimed once
    affected = rows(
        admin,
        "SELECT run_id, status, lease_owner, fencing_token, turn, marked_calls "
        "FROM runledger.failover_runs ORDER BY run_id",
    )
    assert affected == [
        {
            "run_id": "held",
            "status": "running",
            "lease_owner": "w1",
            "fencing_token": held.token,
            "turn": 0,
            "marked_calls": [key("held", 0, "c1")],
        },
        {
            "run_id": "paused",
            "status": "paused",
            "lease_owner": None,
            "fencing_token": paused.token,
            "turn": 0,
            "marked_calls": [],
        },
        {
            "run_id": "queued",
            "status": "queued",
            "lease_owner": None,
            "fencing_token": 0,
            "turn": 0,
            "marked_calls": [],
        },
    ]
    # the planned call may have been sent: dispatched now, an attempt under the old token
    c1 = call_row(admin, key("held", 0, "c1"))
    assert (c1["status"], c1["attempts"], c1["dispatched_by"], c1["dispatched_token"]) == (
        "dispatched",
        1,
        "failover",
        held.token,
    )
    assert call_row(admin, key("held", 0, "c2"))["dispatched_by"] == "w1"  # as it was
    c3 = call_row(admin, key("held", 0, "c3"))
    assert (c3["status"], c3["approval"]) == ("planned", "pending")
    # nothing is taken for 10 s (revision 0011): the old holder may still have a call in
    # flight; its session lock is cleared, so only the wait frees the run
    assert claimed == []
    held_row = run_row(admin, "held")
    assert held_row["lease_lock"] is None
    settle = held_row["lease_expires_at"] - scalar(admin, "SELECT runledger.now()")
    assert dt.timedelta(seconds=9) < settle <= dt.timedelta(seconds=10)
    admin.execute("UPDATE runledger.settings SET clock_offset = clock_offset + interval '11 s'")
    claimed = claim_v4(worker, "w2")
    by_run = {r["run_id"]: r for r in claimed}
    assert set(by_run) == {"held", "queued"}
    assert by_run["held"]["takeover"] is True
    assert by_run["held"]["failover_turn"] == 0
    assert by_run["queued"]["failover_turn"] == 0
    # an event on each affected run, none on the finished one
    (event,) = events(admin, "held", "failover_detected")
    assert event["actor"] == "w2"
    assert event["detail"]["timeline"] == now
    assert event["detail"]["previous_timeline"] == now + 6
    assert event["detail"]["marked_dispatched"] == [key("held", 0, "c1")]
    assert event["detail"]["suspect_from_turn"] == 0
    assert len(events(admin, "paused", "failover_detected")) == 1
    assert events(admin, "zdone", "failover_detected") == []
    # the old holder is refused: its lease ended
    with sqlstate("RL001"):
        complete(worker, held, key("held", 0, "c2"), "succeeded", {"ok": True})
    # a second claim finds the timeline recorded and adds nothing
    claim_v4(worker, "w3")
    assert int(scalar(admin, "SELECT count(*) FROM runledger.timelines")) == 3
    assert int(scalar(admin, "SELECT count(*) FROM runledger.failover_runs")) == 3


def test_a_run_no_failover_affected_has_no_failover_turn(worker: Conn, admin: Conn) -> None:
    submit(worker, "r1")
    (row,) = claim_v4(worker)
    assert row["failover_turn"] is None
    assert run_row(admin, "r1")["status"] == "running"


def test_the_latest_turn_is_the_suspect_one(worker: Conn, admin: Conn) -> None:
    lease = submit_and_claim(worker, "r1")
    record_turn(worker, lease, 0, [call("c1")])
    assert dispatch(worker, lease, key("r1", 0, "c1")) == 1
    complete(worker, lease, key("r1", 0, "c1"), "succeeded", {"ok": True})
    record_turn(worker, lease, 1, [call("c1")])
    finish(worker, lease, "paused", reason="for the test")
    pretend_last_seen(admin, timeline(admin) + 1)
    claim_v4(worker)
    assert scalar(admin, "SELECT turn FROM runledger.failover_runs") == 1
    assert call_row(admin, key("r1", 0, "c1"))["status"] == "succeeded"
    assert call_row(admin, key("r1", 1, "c1"))["status"] == "dispatched"
    assert run_row(admin, "r1")["status"] == "paused"  # a paused run stays paused


def test_an_empty_table_records_the_timeline_and_no_failover(worker: Conn, admin: Conn) -> None:
    submit_and_claim(worker, "r1")
    # only past the wall (a superuser disabling its trigger) can the table be emptied
    admin.execute("ALTER TABLE runledger.timelines DISABLE TRIGGER tg_timelines_guard")
    admin.execute("DELETE FROM runledger.timelines")
    admin.execute("ALTER TABLE runledger.timelines ENABLE ALWAYS TRIGGER tg_timelines_guard")
    claim(worker, "w2")
    seen = rows(admin, "SELECT position, timeline, previous_timeline FROM runledger.timelines")
    assert seen == [{"position": 1, "timeline": timeline(admin), "previous_timeline": None}]
    assert rows(admin, "SELECT * FROM runledger.failover_runs") == []


def test_the_record_of_failovers_is_append_only(worker: Conn, admin: Conn) -> None:
    submit(worker, "r1")
    pretend_last_seen(admin, timeline(admin) + 1)
    claim_v4(worker)
    for statement in (
        "UPDATE runledger.timelines SET affected_runs = 0",
        "DELETE FROM runledger.timelines WHERE position > 1",
        "TRUNCATE runledger.timelines CASCADE",
        "UPDATE runledger.failover_runs SET turn = 5",
        "DELETE FROM runledger.failover_runs",
        "TRUNCATE runledger.failover_runs",
    ):
        with sqlstate("RL007", statement):
            admin.execute(statement)  # type: ignore[arg-type]
    assert int(scalar(admin, "SELECT count(*) FROM runledger.failover_runs")) == 1


def test_a_pruned_run_takes_its_failover_rows_with_it(
    worker: Conn, operator: Conn, admin: Conn
) -> None:
    submit(worker, "r1")
    pretend_last_seen(admin, timeline(admin) + 1)
    assert claim_v4(worker) == []  # the failover's wait
    admin.execute("UPDATE runledger.settings SET clock_offset = clock_offset + interval '11 s'")
    (row,) = claim_v4(worker)
    assert row["failover_turn"] == 0
    lease = claim_lease(row)
    record_turn(worker, lease, 0, [])
    finish(worker, lease, "succeeded")
    assert scalar(operator, "SELECT runledger.prune_runs('infinity', false)") == 1
    assert int(scalar(admin, "SELECT count(*) FROM runledger.failover_runs")) == 0
    assert int(scalar(admin, "SELECT count(*) FROM runledger.timelines")) == 3  # they stay
