"""Revision 0026, finish_and_claim: a run's final decision and the same worker's next
claim in one transaction. Rows written by one transaction carry its id (``xmin``)."""

from __future__ import annotations

import datetime as dt
from typing import Any

import psycopg
from psycopg.types.json import Jsonb

from .helpers import (
    FLOW_REF,
    LEASE_SECONDS,
    Lease,
    call,
    events,
    refused,
    rows,
    run_row,
    submit,
    submit_and_claim,
)
from .test_record_turn_v4 import v4

Conn = psycopg.Connection[Any]


def finish_and_claim(
    conn: Conn,
    lease: Lease,
    turn: int,
    *,
    expected: int | None = None,
    state: Any = None,
    output: Any = None,
    worker_id: str = "w1",
    max_runs: int = 1,
) -> list[dict[str, Any]]:
    return rows(
        conn,
        "SELECT * FROM runledger.finish_and_claim(%s, %s, %s, %s, NULL, %s, %s, %s, %s,"
        " %s::text[], %s, %s)",
        (
            lease.run_id,
            lease.lease_id,
            lease.token,
            turn,
            None if output is None else Jsonb(output),
            expected,
            None if state is None else Jsonb(state),
            worker_id,
            [FLOW_REF],
            dt.timedelta(seconds=LEASE_SECONDS),
            max_runs,
        ),
    )


def _xmin(admin: Conn, run_id: str, kind: str) -> str:
    [row] = rows(
        admin,
        "SELECT xmin::text AS xmin FROM runledger.run_events WHERE run_id = %s AND kind = %s",
        (run_id, kind),
    )
    return str(row["xmin"])


def _one_call_turn(worker: Conn, lease: Lease) -> None:
    """Turn 0 with one call, completed: the run is due its final decision (turn 1)."""
    v4(worker, lease, 0, [call("c1")], ["c1"], expected=0)
    worker.execute(
        "SELECT runledger.complete_call(%s, %s, %s, %s, 'succeeded', '{}', NULL)",
        (lease.run_id, lease.lease_id, lease.token, f"{lease.run_id}:0:c1"),
    )


def test_the_final_decision_and_the_next_claim_commit_together(
    worker: Conn, admin_conn: Conn
) -> None:
    lease = submit_and_claim(worker, "r1")
    _one_call_turn(worker, lease)
    submit(worker, "r2")
    submit(worker, "r3")
    got = finish_and_claim(
        worker, lease, 1, expected=0, state={"completed_turns": 1}, output={"ok": 1}
    )
    assert [r["run_id"] for r in got] == ["r2"]  # max_runs 1, oldest first
    (claimed,) = got
    assert claimed["finished_version"] == 1  # the checkpoint came with the decision
    assert claimed["takeover"] is False and claimed["stalled_claims"] == 1
    assert claimed["turns"] == [] and claimed["calls"] == []  # its journal, as claim_runs_v4
    assert claimed["lease_id"] == run_row(admin_conn, "r2")["lease_id"]
    finished = run_row(admin_conn, "r1")
    assert (finished["status"], finished["result"], finished["state"]) == (
        "succeeded",
        {"ok": 1},
        {"completed_turns": 1},
    )
    assert run_row(admin_conn, "r2")["lease_owner"] == "w1"
    assert run_row(admin_conn, "r3")["status"] == "queued"
    # one transaction: the run's end and the next one's claim
    assert _xmin(admin_conn, "r1", "run_succeeded") == _xmin(admin_conn, "r2", "claimed")
    assert [e["kind"] for e in events(admin_conn, "r1")][-3:] == [
        "checkpoint",
        "turn_recorded",
        "run_succeeded",
    ]


def test_with_nothing_to_claim_one_row_carries_the_finished_version(
    worker: Conn, admin_conn: Conn
) -> None:
    lease = submit_and_claim(worker, "r1")
    (row,) = finish_and_claim(worker, lease, 0, max_runs=8)
    assert row["finished_version"] == 0
    assert all(v is None for k, v in row.items() if k != "finished_version")
    assert run_row(admin_conn, "r1")["status"] == "succeeded"


def test_a_stale_lease_finishes_nothing_and_claims_nothing(
    worker: Conn, worker2: Conn, admin_conn: Conn, db_clock: Any
) -> None:
    lease = submit_and_claim(worker, "r1")
    db_clock.advance(LEASE_SECONDS + 1)
    submit(worker, "r2")
    with refused(admin_conn, "RL001"):
        finish_and_claim(worker, lease, 0)
    assert run_row(admin_conn, "r1")["status"] == "running"
    assert run_row(admin_conn, "r2")["status"] == "queued"


def test_a_refused_claim_undoes_the_finish(worker: Conn, admin_conn: Conn) -> None:
    lease = submit_and_claim(worker, "r1")
    with refused(admin_conn, "RL006"):
        finish_and_claim(worker, lease, 0, max_runs=-1)
    with refused(admin_conn, "RL006"):
        finish_and_claim(worker, lease, 0, worker_id="")
    assert run_row(admin_conn, "r1")["status"] == "running"
    assert [e["kind"] for e in events(admin_conn, "r1")] == ["submitted", "claimed"]


def test_a_final_decision_with_calls_is_not_one(worker: Conn, admin_conn: Conn) -> None:
    """The function has no calls argument: the decision it records is empty. A turn
    already recorded with calls is another decision (RL004), not replaced."""
    lease = submit_and_claim(worker, "r1")
    v4(worker, lease, 0, [call("c1")], None, expected=0)
    with refused(admin_conn, "RL004"):
        finish_and_claim(worker, lease, 0)
