"""record_turn_v4 (revision 0009): a decision and the dispatch of its first calls in one
transaction, called as a live or a stale worker would."""

from __future__ import annotations

from typing import Any

import psycopg
import pytest
from psycopg.types.json import Jsonb

from runledger.testing import DbClock

from .helpers import (
    LEASE_SECONDS,
    Lease,
    call,
    call_row,
    claim,
    complete,
    dispatch,
    events,
    key,
    refused,
    rows,
    run_row,
    submit_and_claim,
)

Conn = psycopg.Connection[Any]


def v4(
    conn: Conn,
    lease: Lease,
    turn: int,
    calls: Any,
    dispatch_ids: list[Any] | None,
    *,
    expected: int | None = None,
    state: Any = None,
    output: Any = None,
    finish: bool = False,
) -> tuple[int, list[int]]:
    [row] = rows(
        conn,
        "SELECT * FROM runledger.record_turn_v4(%s, %s, %s, %s, %s, NULL, %s, %s, %s, %s, %s)",
        (
            lease.run_id,
            lease.lease_id,
            lease.token,
            turn,
            Jsonb(calls),
            None if output is None else Jsonb(output),
            expected,
            None if state is None else Jsonb(state),
            finish,
            dispatch_ids,
        ),
    )
    return int(row["state_version"]), list(row["attempts"])


def test_the_decision_and_its_first_calls_commit_together(worker: Conn, admin_conn: Conn) -> None:
    lease = submit_and_claim(worker, "r1")
    calls = [call("c1"), call("c2"), call("c3")]
    got = v4(worker, lease, 0, calls, ["c1", "c2"], expected=0, state={"n": 0})
    assert got == (1, [1, 1])
    for cid in ("c1", "c2"):
        c = call_row(admin_conn, key("r1", 0, cid))
        assert (c["status"], c["attempts"], c["dispatched_token"], c["dispatched_by"]) == (
            "dispatched",
            1,
            1,
            "w1",
        )
    assert call_row(admin_conn, key("r1", 0, "c3"))["status"] == "planned"
    evs = events(admin_conn, "r1")
    assert [e["kind"] for e in evs][-4:] == [
        "checkpoint",
        "turn_recorded",
        "call_dispatched",
        "call_dispatched",
    ]
    sent = [e for e in evs if e["kind"] == "call_dispatched"]
    assert [e["detail"] for e in sent] == [
        {
            "idempotency_key": key("r1", 0, c),
            "tool": "create_ticket",
            "attempt": 1,
            "previous_status": "planned",
        }
        for c in ("c1", "c2")
    ]
    assert {e["state_version"] for e in sent} == {1}  # the version the checkpoint left
    # one transaction: every row and event of it carries the same clock reading
    assert len({e["at"] for e in evs[-4:]}) == 1
    # the dispatched calls complete as any other
    complete(worker, lease, key("r1", 0, "c1"), "succeeded", {"ok": 1})
    assert run_row(admin_conn, "r1")["stalled_claims"] == 0


@pytest.mark.parametrize("dispatch_ids", [None, []])
def test_without_calls_to_dispatch_it_is_record_turn_v3(
    worker: Conn, admin_conn: Conn, dispatch_ids: list[str] | None
) -> None:
    lease = submit_and_claim(worker, "r1")
    assert v4(worker, lease, 0, [call("c1")], dispatch_ids) == (0, [])
    assert call_row(admin_conn, key("r1", 0, "c1"))["status"] == "planned"
    assert [e["kind"] for e in events(admin_conn, "r1")][-1] == "turn_recorded"


def test_the_same_decision_again_dispatches_its_calls_again(worker: Conn, admin_conn: Conn) -> None:
    lease = submit_and_claim(worker, "r1")
    assert v4(worker, lease, 0, [call("c1")], ["c1"]) == (0, [1])
    # sent again (a retried ambiguous commit): the decision is not written twice, the
    # call is dispatched again as dispatch_call would, under the same key
    assert v4(worker, lease, 0, [call("c1")], ["c1"]) == (0, [2])
    assert len(events(admin_conn, "r1", "turn_recorded")) == 1
    assert call_row(admin_conn, key("r1", 0, "c1"))["attempts"] == 2


def test_it_refuses_calls_it_may_not_dispatch_and_writes_nothing(
    worker: Conn, admin_conn: Conn, db_clock: DbClock
) -> None:
    lease = submit_and_claim(worker, "r1")
    calls = [call("c1"), {**call("c2"), "approval": True}]
    with refused(admin_conn, "RL004") as info:  # awaits approval: the decision goes too
        v4(worker, lease, 0, calls, ["c1", "c2"])
    assert "awaits approval" in (info.value.diag.message_primary or "")
    for bad in (["c9"], ["c1", "c1"], ["c1", None]):
        with refused(admin_conn, "RL006", bad):
            v4(worker, lease, 0, calls, bad)
    with refused(admin_conn, "RL006"):  # a final decision has no calls to dispatch
        v4(worker, lease, 0, [], ["c1"], finish=True)
    # the decision's own checks come first, as record_turn_v3's
    with refused(admin_conn, "RL006") as info:
        v4(worker, lease, 0, [{"call_id": "c1", "tool": "bad tool"}], ["c1"])
    assert "invalid tool name" in (info.value.diag.message_primary or "")
    # a call of an earlier turn is not one of this decision
    assert v4(worker, lease, 0, [call("c1")], ["c1"]) == (0, [1])
    complete(worker, lease, key("r1", 0, "c1"), "succeeded", {"ok": 1})
    with refused(admin_conn, "RL006"):
        v4(worker, lease, 1, [call("c2")], ["c1"])
    with refused(admin_conn, "RL004"):  # the calls of a turn already recorded
        v4(worker, lease, 0, [call("c1")], ["c1"])
    # a stale worker: the lease check first
    db_clock.advance(LEASE_SECONDS + 1)
    with refused(admin_conn, "RL001"):
        v4(worker, lease, 1, [call("c2")], ["c2"])


def test_the_old_dispatch_writes_the_same_as_before(worker: Conn, admin_conn: Conn) -> None:
    """dispatch_call and complete_call_v2 go through the same helper now: same rows,
    same event."""
    lease = submit_and_claim(worker, "r1")
    v4(worker, lease, 0, [call("c1")], None)
    assert dispatch(worker, lease, key("r1", 0, "c1")) == 1
    assert dispatch(worker, lease, key("r1", 0, "c1")) == 2  # recovery sends again
    [first, again] = events(admin_conn, "r1", "call_dispatched")
    assert first["detail"]["previous_status"] == "planned"
    assert again["detail"]["previous_status"] == "dispatched"
    assert again["detail"]["attempt"] == 2


def test_a_completion_resets_the_stall_count_and_otherwise_leaves_the_run_row_alone(
    worker: Conn, admin_conn: Conn, db_clock: DbClock
) -> None:
    lease = submit_and_claim(worker, "r1")
    v4(worker, lease, 0, [call("c1"), call("c2")], ["c1"])
    db_clock.advance(LEASE_SECONDS + 1)  # the worker dies mid-call; another takes over
    [taken] = claim(worker, "w2", max_runs=1)
    assert run_row(admin_conn, "r1")["stalled_claims"] == 1
    complete(worker, taken, key("r1", 0, "c1"), "succeeded", {"ok": 1})
    after = run_row(admin_conn, "r1")
    assert after["stalled_claims"] == 0  # progress under the new lease
    dispatch(worker, taken, key("r1", 0, "c2"))
    complete(worker, taken, key("r1", 0, "c2"), "succeeded", {"ok": 2})
    # nothing to reset: the run row is not written (its version stays), the call's is
    again = run_row(admin_conn, "r1")
    assert (again["updated_at"], again["stalled_claims"]) == (after["updated_at"], 0)
    assert call_row(admin_conn, key("r1", 0, "c2"))["completed_at"] > after["updated_at"]
