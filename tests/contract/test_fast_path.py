"""The fast path of revision 0008, called as a live or a stale worker would: the journal
with the claim, decision + checkpoint + finish in one transaction, and complete_call_v2 (a
result and the next dispatch in one).

Until the baseline "0.1" the first two were claim_runs_v2 and record_turn_v3; they are
retired, and the tests call their live successors with the same meaning: claim_runs_v4
(the same columns and more) and record_turn_v4 (the same arguments, and no calls to
dispatch). Where a test compared record_turn_v3 with its slow twin record_turn_v2 (retired
too), it compares record_turn_v4 with record_turn_v2's body, vendored as a reference in
reference/record_turn_v2.sql (commit 4b19f01, service/runledger/db/sql/04_journal.sql)
and installed as record_turn_v2_ref."""

from __future__ import annotations

import dataclasses
import datetime as dt
from pathlib import Path
from typing import Any

import psycopg
import pytest
from psycopg.types.json import Jsonb

from runledger.testing import DbClock

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
    one,
    record_v2,
    refused,
    rows,
    run_row,
    scalar,
    sqlstate,
    submit,
    submit_and_claim,
)

Conn = psycopg.Connection[Any]


REFERENCE = Path(__file__).parent / "reference" / "record_turn_v2.sql"


def install_reference(admin: Conn) -> None:
    """record_turn_v2's body (retired) as runledger.record_turn_v2_ref."""
    admin.execute(REFERENCE.read_text(encoding="utf-8"))  # type: ignore[arg-type]


def ref_v2(conn: Conn, lease: Lease, turn: int, calls: Any, record: Any = None) -> None:
    """The decision through the reference: record_turn_v2 as it was."""
    conn.execute(
        "SELECT runledger.record_turn_v2_ref(%s, %s, %s, %s, %s, %s, NULL)",
        (
            lease.run_id,
            lease.lease_id,
            lease.token,
            turn,
            Jsonb(calls),
            None if record is None else Jsonb(record),
        ),
    )


def claim_v4(conn: Conn, worker_id: str = "w1", max_runs: int = 10) -> list[dict[str, Any]]:
    return rows(
        conn,
        "SELECT * FROM runledger.claim_runs_v4(%s, %s::text[], %s, %s)",
        (worker_id, [FLOW_REF], dt.timedelta(seconds=LEASE_SECONDS), max_runs),
    )


def lease_of(r: dict[str, Any], worker_id: str = "w1") -> Lease:
    return Lease(
        run_id=r["run_id"],
        lease_id=r["lease_id"],
        token=r["fencing_token"],
        state_version=r["state_version"],
        takeover=r["takeover"],
        lease_expires_at=r["lease_expires_at"],
        worker_id=worker_id,
    )


def v4(
    conn: Conn,
    lease: Lease,
    turn: int,
    calls: Any,
    *,
    record: Any = None,
    output: Any = None,
    expected: int | None = None,
    state: Any = None,
    finish: bool | None = False,
) -> int:
    """record_turn_v4 without calls to dispatch (what record_turn_v3 took): the state
    version it leaves."""
    return int(
        scalar(
            conn,
            "SELECT d.state_version FROM runledger.record_turn_v4(%s, %s, %s, %s, %s, %s, %s,"
            " %s, %s, %s, NULL) AS d",
            (
                lease.run_id,
                lease.lease_id,
                lease.token,
                turn,
                Jsonb(calls),
                None if record is None else Jsonb(record),
                None if output is None else Jsonb(output),
                expected,
                None if state is None else Jsonb(state),
                finish,
            ),
        )
    )


def complete_v2(
    conn: Conn,
    lease: Lease,
    idempotency_key: str,
    outcome: str = "succeeded",
    result: Any = None,
    next_key: str | None = None,
) -> int | None:
    value = scalar(
        conn,
        "SELECT runledger.complete_call_v2(%s, %s, %s, %s, %s, %s, NULL, %s)",
        (
            lease.run_id,
            lease.lease_id,
            lease.token,
            idempotency_key,
            outcome,
            None if result is None else Jsonb(result),
            next_key,
        ),
    )
    return None if value is None else int(value)


def kinds(conn: Conn, run_id: str) -> list[str]:
    return [e["kind"] for e in events(conn, run_id)]


# -- claim_runs_v4 -------------------------------------------------------------------------


def test_claim_v4_returns_the_journal_as_load_journal_reads_it(
    worker: Conn, admin_conn: Conn, db_clock: DbClock
) -> None:
    lease = submit_and_claim(worker)
    record_v2(worker, lease, 0, [{**call("c1"), "provider_id": "toolu_1"}], {"role": "x"})
    dispatch(worker, lease, key("r1", 0, "c1"))
    complete(worker, lease, key("r1", 0, "c1"), "succeeded", {"ok": 1})
    submit(worker, "fresh")
    db_clock.advance(LEASE_SECONDS + 1)

    got = {r["run_id"]: r for r in claim_v4(worker, "w2")}
    assert set(got) == {"r1", "fresh"}
    taken = got["r1"]
    assert (taken["takeover"], taken["fencing_token"], taken["stalled_claims"]) == (True, 2, 1)
    assert taken["turns"] == [
        {
            "turn": 0,
            "calls": [{**call("c1"), "provider_id": "toolu_1"}],
            "record": {"role": "x"},
            "output": None,
        }
    ]
    [c] = taken["calls"]
    stored = call_row(admin_conn, key("r1", 0, "c1"))
    assert c["idempotency_key"] == stored["idempotency_key"]
    assert (c["status"], c["result"], c["attempts"], c["provider_id"], c["approval"]) == (
        "succeeded",
        {"ok": 1},
        1,
        "toolu_1",
        None,
    )
    assert set(c) >= {"dispatched_token", "completed_token", "receipt", "error", "position"}
    assert (got["fresh"]["turns"], got["fresh"]["calls"], got["fresh"]["stalled_claims"]) == (
        [],
        [],
        1,
    )
    # the claim itself is claim_runs': the events are its events
    assert kinds(admin_conn, "r1")[-1] == "takeover"
    assert kinds(admin_conn, "fresh") == ["submitted", "claimed"]


def test_a_run_claimed_again_without_progress_comes_without_its_journal(
    worker: Conn, db_clock: DbClock
) -> None:
    submit(worker, "r1")
    [first] = claim_v4(worker)
    assert (first["stalled_claims"], first["turns"], first["calls"]) == (1, [], [])
    db_clock.advance(LEASE_SECONDS + 1)
    [again] = claim_v4(worker, "w2")
    # stalled: the worker checks for a crash loop before it loads (and decodes) anything
    assert (again["stalled_claims"], again["turns"], again["calls"]) == (2, None, None)


def test_claim_v4_refuses_as_claim_runs_did_and_claims_after(
    worker: Conn, admin_conn: Conn
) -> None:
    submit(worker, "r1")
    with refused(admin_conn, "RL006"):
        rows(worker, "SELECT * FROM runledger.claim_runs_v4('w1', ARRAY['demo'], '30 s', 1)")
    with refused(admin_conn, "RL006"):
        rows(worker, "SELECT * FROM runledger.claim_runs_v4('w1', ARRAY['demo@1'], '2 days', 1)")
    assert [c.run_id for c in claim(worker)] == ["r1"]


# -- record_turn_v4: the checks of record_turn_v2 ------------------------------------------

BAD_CALLS: list[Any] = [
    {"calls": "x"},
    [1],
    [call("c1"), "not an object"],
    [{"tool": "t"}],
    [{"call_id": 7, "tool": "t"}],
    [{"call_id": "-bad", "tool": "t"}],
    [call("c1"), call("c2"), call("c1")],
    [call("c1"), {"call_id": "c1", "tool": "no tool!"}],  # the id repeats: named first
    [{"call_id": "c1", "tool": "bad tool"}, call("c1")],  # the first element is bad first
    [{"call_id": "c1", "tool": 3}],
    [{"call_id": "c1", "tool": "t", "args": [1]}],
    [{**call("c1"), "provider_id": 17}],
    [{**call("c1"), "provider_id": ""}],
    [{**call("c1"), "provider_id": "p" * 201}],
    [{**call("c1"), "approval": "yes"}],
    [{**call("c1"), "approval": None}],
    [call("c1"), {**call("c2"), "approval": 1}, {"call_id": "c3"}],
]


def _refusal(conn: Conn, admin: Conn, fn: Any) -> tuple[str | None, str | None, str | None]:
    with refused(admin, "RL006") as info:
        fn()
    diag = info.value.diag
    return info.value.sqlstate, diag.message_primary, diag.message_detail


@pytest.mark.parametrize("calls", BAD_CALLS, ids=[str(i) for i in range(len(BAD_CALLS))])
def test_v4_refuses_a_bad_decision_exactly_as_v2(
    worker: Conn, admin_conn: Conn, calls: Any
) -> None:
    install_reference(admin_conn)
    a = submit_and_claim(worker, "a")
    b = submit_and_claim(worker, "b")
    by_v2 = _refusal(worker, admin_conn, lambda: ref_v2(worker, a, 0, calls, None))
    by_v4 = _refusal(worker, admin_conn, lambda: v4(worker, b, 0, calls))
    assert by_v4[0] == by_v2[0] == "RL006"
    assert by_v4[1:] == (by_v2[1].replace("run a", "run b") if by_v2[1] else None, by_v2[2])


@pytest.mark.parametrize(
    ("args", "message"),
    [
        ({"output": {"x": 1}, "calls": [call("c1")]}, "output is the final decision's"),
        ({"state": [1]}, "state must be a JSON object"),
        ({"finish": None}, "finish must not be null"),
        ({"finish": True, "calls": [call("c1")]}, "only the final decision finishes the run"),
        ({"record": "text"}, "record must be a JSON object"),
    ],
)
def test_v4_refuses_its_own_arguments(
    worker: Conn, admin_conn: Conn, args: dict[str, Any], message: str
) -> None:
    lease = submit_and_claim(worker)
    calls = args.pop("calls", [])
    with refused(admin_conn, "RL006") as info:
        v4(worker, lease, 0, calls, **args)
    assert message in (info.value.diag.message_primary or "")


def test_v4_checks_the_lease_first_and_turn_order_and_open_calls(
    worker: Conn, admin_conn: Conn, db_clock: DbClock
) -> None:
    lease = submit_and_claim(worker)
    stale = dataclasses.replace(lease, token=lease.token + 5)
    with refused(admin_conn, "RL001"):
        v4(worker, stale, 0, "not even an array", finish=None)
    with refused(admin_conn, "RL004"):
        v4(worker, lease, 1, [call("c1")])  # turn 0 comes first
    v4(worker, lease, 0, [call("c1")])
    with refused(admin_conn, "RL004") as info:
        v4(worker, lease, 1, [call("c2")])  # c1 is planned
    assert "without a final result" in (info.value.diag.message_primary or "")
    with refused(admin_conn, "RL004"):
        v4(worker, lease, 0, [call("c9")])  # another decision for turn 0
    db_clock.advance(LEASE_SECONDS + 1)
    with refused(admin_conn, "RL001"):
        v4(worker, lease, 0, [call("c1")])


# -- record_turn_v4: what it writes --------------------------------------------------------


def test_v4_stores_the_calls_as_v2_does(worker: Conn, admin_conn: Conn) -> None:
    install_reference(admin_conn)
    calls = [
        {"call_id": "a", "tool": "t"},
        {**call("b", x=[1, {"y": None}]), "provider_id": "p-1", "approval": True},
        {**call("c"), "approval": False},
    ]
    a = submit_and_claim(worker, "a")
    b = submit_and_claim(worker, "b")
    ref_v2(worker, a, 0, calls, {"m": 1})
    assert v4(worker, b, 0, calls, record={"m": 1}) == 0
    cols = "call_id, position, tool, args, status, attempts, provider_id, approval"

    def stored(run_id: str) -> list[dict[str, Any]]:
        return rows(
            admin_conn,
            f"SELECT {cols}, idempotency_key FROM runledger.run_calls"
            " WHERE run_id = %s ORDER BY position",
            (run_id,),
        )

    for x, y in zip(stored("a"), stored("b"), strict=True):
        assert y.pop("idempotency_key") == key("b", 0, y["call_id"])
        x.pop("idempotency_key")
        assert x == y
    assert one(admin_conn, "SELECT calls, record FROM runledger.run_turns WHERE run_id = 'b'") == {
        "calls": calls,
        "record": {"m": 1},
    }
    assert kinds(admin_conn, "b") == ["submitted", "claimed", "turn_recorded"]
    assert run_row(admin_conn, "b")["state_version"] == 0  # no state: no checkpoint
    assert v4(worker, b, 0, calls, record={"m": 1}) == 0  # the same decision: a no-op
    assert kinds(admin_conn, "b") == ["submitted", "claimed", "turn_recorded"]


def test_v4_checkpoints_with_the_turn_compare_and_set(worker: Conn, admin_conn: Conn) -> None:
    lease = submit_and_claim(worker)
    with refused(admin_conn, "RL002"):
        v4(worker, lease, 0, [call("c1")], expected=3, state={"completed_turns": 0})
    assert v4(worker, lease, 0, [call("c1")], expected=0, state={"completed_turns": 0}) == 1
    run = run_row(admin_conn, "r1")
    assert (run["state"], run["state_version"], run["stalled_claims"], run["status"]) == (
        {"completed_turns": 0},
        1,
        0,
        "running",
    )
    evs = events(admin_conn, "r1")
    assert [(e["kind"], e["state_version"]) for e in evs[2:]] == [
        ("checkpoint", 1),
        ("turn_recorded", 1),
    ]
    assert evs[3]["detail"] == {"turn": 0, "calls": 1}
    assert {e["actor"] for e in evs[2:]} == {"w1"} and {e["fencing_token"] for e in evs[2:]} == {1}


@pytest.mark.parametrize(
    ("output", "result"), [({"answer": 42}, {"answer": 42}), (None, {"turns": 2, "calls": 1})]
)
def test_the_final_decision_finishes_the_run(
    worker: Conn, admin_conn: Conn, output: Any, result: Any
) -> None:
    lease = submit_and_claim(worker)
    v4(worker, lease, 0, [call("c1")])
    dispatch(worker, lease, key("r1", 0, "c1"))
    complete(worker, lease, key("r1", 0, "c1"), "succeeded", {"ok": 1})
    assert v4(worker, lease, 1, [], output=output, expected=0, state={"done": 1}, finish=True) == 1
    run = run_row(admin_conn, "r1")
    assert (run["status"], run["result"], run["state"], run["state_version"]) == (
        "succeeded",
        result,
        {"done": 1},
        1,
    )
    assert (run["lease_id"], run["lease_owner"], run["lease_expires_at"]) == (None, None, None)
    assert run["finished_at"] is not None and run["error"] is None
    assert kinds(admin_conn, "r1")[-3:] == ["checkpoint", "turn_recorded", "run_succeeded"]
    [done] = events(admin_conn, "r1", "run_succeeded")
    assert (done["detail"], done["actor"], done["fencing_token"]) == ({}, "w1", 1)
    turn = one(admin_conn, "SELECT calls, output FROM runledger.run_turns WHERE turn = 1")
    assert turn == {"calls": [], "output": output}
    with sqlstate("RL001"):  # the lease ended with the run
        v4(worker, lease, 1, [], output=output, finish=True)


# -- complete_call_v2 ----------------------------------------------------------------------


def two_calls(worker: Conn, run_id: str = "r1", approval: bool = False) -> tuple[Lease, str, str]:
    lease = submit_and_claim(worker, run_id)
    second = {**call("c2"), "approval": True} if approval else call("c2")
    v4(worker, lease, 0, [call("c1"), second])
    first = key(run_id, 0, "c1")
    dispatch(worker, lease, first)
    return lease, first, key(run_id, 0, "c2")


@pytest.mark.parametrize("outcome", ["succeeded", "failed"])
def test_complete_v2_completes_and_dispatches_the_next_call(
    worker: Conn, admin_conn: Conn, outcome: str
) -> None:
    lease, first, second = two_calls(worker)
    assert complete_v2(worker, lease, first, outcome, {"r": 1}, next_key=second) == 1
    done, sent = call_row(admin_conn, first), call_row(admin_conn, second)
    assert (done["status"], done["completed_token"]) == (outcome, 1)
    assert (done["result"], done["error"]) == (
        ({"r": 1}, None) if outcome == "succeeded" else (None, {"r": 1})
    )
    assert (sent["status"], sent["attempts"], sent["dispatched_token"]) == ("dispatched", 1, 1)
    assert sent["dispatched_by"] == "w1" and sent["dispatched_at"] == done["completed_at"]
    evs = events(admin_conn, "r1")[-2:]
    assert [e["kind"] for e in evs] == [f"call_{outcome}", "call_dispatched"]
    assert evs[1]["detail"] == {
        "idempotency_key": second,
        "tool": "create_ticket",
        "attempt": 1,
        "previous_status": "planned",
    }
    assert run_row(admin_conn, "r1")["stalled_claims"] == 0


def test_complete_v2_without_a_next_call_is_complete_call(worker: Conn, admin_conn: Conn) -> None:
    lease, first, second = two_calls(worker)
    assert complete_v2(worker, lease, first, "not_applied", {"why": "x"}) is None
    assert call_row(admin_conn, first)["status"] == "planned"
    assert call_row(admin_conn, second)["status"] == "planned"
    assert kinds(admin_conn, "r1")[-1] == "call_not_applied"


def test_complete_v2_refuses_a_next_call_it_may_not_send(
    worker: Conn, admin_conn: Conn, db_clock: DbClock
) -> None:
    lease, first, second = two_calls(worker, approval=True)
    with refused(admin_conn, "RL004") as info:  # awaits approval
        complete_v2(worker, lease, first, next_key=second)
    assert "awaits approval" in (info.value.diag.message_primary or "")
    with refused(admin_conn, "RL006"):  # a pause (unknown) sends nothing more
        complete_v2(worker, lease, first, "unknown", next_key=second)
    with refused(admin_conn, "RL006"):
        complete_v2(worker, lease, first, next_key=first)
    with refused(admin_conn, "RL003"):
        complete_v2(worker, lease, first, next_key="r1:0:nope")
    other, other_first, other_second = two_calls(worker, "r2")
    with refused(admin_conn, "RL003"):  # a call of another run
        complete_v2(worker, lease, first, next_key=other_first)
    complete(worker, other, other_first, "succeeded", {"ok": 1})
    dispatch(worker, other, other_second)
    with refused(admin_conn, "RL004"):  # the next call has its final result already
        complete_v2(worker, other, other_second, next_key=other_first)
    with refused(admin_conn, "RL006"):
        complete_v2(worker, lease, first, next_key="k" * 301)
    db_clock.advance(LEASE_SECONDS + 1)
    with refused(admin_conn, "RL001"):
        complete_v2(worker, lease, first, "bogus", next_key=second)


def test_old_writes_still_work_beside_the_new_ones(worker: Conn, admin_conn: Conn) -> None:
    lease, first, second = two_calls(worker)
    complete(worker, lease, first, "succeeded", {"ok": 1})
    dispatch(worker, lease, second)
    complete_v2(worker, lease, second, "succeeded", {"ok": 2})
    finish(worker, lease, "succeeded", {"done": True})
    assert run_row(admin_conn, "r1")["status"] == "succeeded"
