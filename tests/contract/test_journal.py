"""The journal: checkpoints (CAS), turns, calls and their idempotency keys."""

from __future__ import annotations

import datetime as dt
import uuid
from typing import Any

import psycopg
import pytest
from psycopg.types.json import Jsonb

from runledger import errors

from .helpers import (
    call,
    call_row,
    checkpoint,
    claim,
    complete,
    count,
    dispatch,
    dispatched_call,
    events,
    finish,
    key,
    plan_call,
    record_turn,
    refused,
    rows,
    run_row,
    set_payload_cap,
    submit_and_claim,
    unchanged,
)

Conn = psycopg.Connection[Any]

# -- checkpoint ---------------------------------------------------------------------------


def test_checkpoint_bumps_the_version_by_one(worker: Conn, admin_conn: Conn) -> None:
    lease = submit_and_claim(worker)

    assert checkpoint(worker, lease, 0, {"step": 1}) == 1
    assert checkpoint(worker, lease, 1, {"step": 2}) == 2

    run = run_row(admin_conn, "r1")
    assert (run["state"], run["state_version"]) == ({"step": 2}, 2)
    cps = events(admin_conn, "r1", "checkpoint")
    assert [(e["state_version"], e["fencing_token"], e["actor"]) for e in cps] == [
        (1, 1, "w1"),
        (2, 1, "w1"),
    ]


def test_checkpoint_on_a_stale_version_is_a_conflict_and_changes_nothing(
    worker: Conn, admin_conn: Conn
) -> None:
    lease = submit_and_claim(worker)
    checkpoint(worker, lease, 0, {"step": 1})

    for expected in [0, 2, 100, -1, None]:
        with refused(admin_conn, "RL002", expected) as info:
            worker.execute(
                "SELECT runledger.checkpoint(%s, %s, %s, %s, %s)",
                (lease.run_id, lease.lease_id, lease.token, expected, Jsonb({"step": "stale"})),
            )
        assert "r1" in info.value.diag.message_primary
        assert "the run is at 1" in info.value.diag.message_detail
    assert run_row(admin_conn, "r1")["state"] == {"step": 1}
    assert checkpoint(worker, lease, 1, {"step": 2}) == 2


async def test_store_maps_version_conflict(store: Any, admin_conn: Conn) -> None:
    await store.worker.submit_run("r1", "demo", "1", {})
    [(c, _)] = await store.worker.claim_runs("w1", ["demo@1"], dt.timedelta(seconds=30), 1)
    assert await store.worker.checkpoint("r1", c.lease_id, c.fencing_token, 0, {"a": 1}) == 1

    with unchanged(admin_conn), pytest.raises(errors.VersionConflict) as info:
        await store.worker.checkpoint("r1", c.lease_id, c.fencing_token, 0, {"a": 2})
    assert (info.value.run_id, info.value.fencing_token) == ("r1", c.fencing_token)


def test_checkpoint_state_must_be_an_object(worker: Conn, admin_conn: Conn) -> None:
    lease = submit_and_claim(worker)
    for literal in ["[]", '"s"', "1", "null"]:
        with refused(admin_conn, "RL006", literal):
            worker.execute(
                "SELECT runledger.checkpoint(%s, %s, %s, 0, %s::jsonb)",
                (lease.run_id, lease.lease_id, lease.token, literal),
            )
    with refused(admin_conn, "RL006", "SQL NULL"):
        worker.execute(
            "SELECT runledger.checkpoint(%s, %s, %s, 0, NULL)",
            (lease.run_id, lease.lease_id, lease.token),
        )


def test_checkpoint_of_a_missing_run_is_not_found(worker: Conn, admin_conn: Conn) -> None:
    lease = submit_and_claim(worker)
    with refused(admin_conn, "RL003"):
        worker.execute(
            "SELECT runledger.checkpoint('nope', %s, %s, 0, '{}'::jsonb)",
            (lease.lease_id, lease.token),
        )


async def test_store_refuses_nul_in_state_before_sending(store: Any, admin_conn: Conn) -> None:
    await store.worker.submit_run("r1", "demo", "1", {})
    [(c, _)] = await store.worker.claim_runs("w1", ["demo@1"], dt.timedelta(seconds=30), 1)

    with unchanged(admin_conn), pytest.raises(errors.InvalidInput) as info:
        await store.worker.checkpoint("r1", c.lease_id, c.fencing_token, 0, {"note": "a\x00"})
    assert info.value.__cause__ is None


# -- payload caps on every JSON argument ---------------------------------------------------

BIG = {"pad": "x" * 3000}

# (prepare under the lease, the oversized write)
OVERSIZED: dict[str, tuple[Any, Any]] = {
    "checkpoint state": (lambda w, lease: None, lambda w, lease, _: checkpoint(w, lease, 0, BIG)),
    "record_turn calls": (
        lambda w, lease: None,
        lambda w, lease, _: record_turn(w, lease, 0, [call("c1", **BIG)]),
    ),
    "complete result": (
        dispatched_call,
        lambda w, lease, k: complete(w, lease, k, "succeeded", BIG, None),
    ),
    "complete receipt": (
        dispatched_call,
        lambda w, lease, k: complete(w, lease, k, "succeeded", {"ok": True}, BIG),
    ),
    "finish result": (lambda w, lease: None, lambda w, lease, _: finish(w, lease, "failed", BIG)),
}


def test_every_json_argument_is_capped(worker: Conn, admin_conn: Conn) -> None:
    leases = {what: submit_and_claim(worker, f"r{i}") for i, what in enumerate(OVERSIZED)}
    prepared = {what: OVERSIZED[what][0](worker, lease) for what, lease in leases.items()}
    set_payload_cap(admin_conn, 2048)

    for what, (_, write) in OVERSIZED.items():
        with refused(admin_conn, "RL006", what) as info:
            write(worker, leases[what], prepared[what])
        assert "over the cap of 2048 bytes" in info.value.diag.message_primary, what


# -- record_turn ----------------------------------------------------------------------------


def test_record_turn_plans_each_call_under_a_stable_key(worker: Conn, admin_conn: Conn) -> None:
    lease = submit_and_claim(worker)

    record_turn(worker, lease, 0, [call("c1", title="a"), {"call_id": "c2", "tool": "send_email"}])

    [turn] = rows(admin_conn, "SELECT * FROM runledger.run_turns")
    assert (turn["run_id"], turn["turn"], turn["fencing_token"]) == ("r1", 0, lease.token)
    assert [c["call_id"] for c in turn["calls"]] == ["c1", "c2"]
    calls = rows(admin_conn, "SELECT * FROM runledger.run_calls ORDER BY position")
    assert [
        (c["idempotency_key"], c["position"], c["tool"], c["args"], c["status"], c["attempts"])
        for c in calls
    ] == [
        ("r1:0:c1", 0, "create_ticket", {"title": "a"}, "planned", 0),
        ("r1:0:c2", 1, "send_email", {}, "planned", 0),
    ]
    [ev] = events(admin_conn, "r1", "turn_recorded")
    assert ev["detail"] == {"turn": 0, "calls": 2}
    assert ev["fencing_token"] == lease.token


def test_turns_start_at_zero(worker: Conn, admin_conn: Conn) -> None:
    lease = submit_and_claim(worker)
    for first in (1, 5):
        with refused(admin_conn, "RL004", first) as info:
            record_turn(worker, lease, first, [call("c1")])
        assert "the next turn to record is 0" in info.value.diag.message_detail
    with refused(admin_conn, "RL006", "negative"):
        record_turn(worker, lease, -1, [call("c1")])


def test_turns_are_recorded_in_order(worker: Conn, admin_conn: Conn) -> None:
    lease = submit_and_claim(worker)
    k = dispatched_call(worker, lease, 0)
    complete(worker, lease, k, "succeeded", {"ok": True})

    with refused(admin_conn, "RL004"):
        record_turn(worker, lease, 2, [call("c1")])
    record_turn(worker, lease, 1, [call("c1")])
    assert [t["turn"] for t in rows(admin_conn, "SELECT turn FROM runledger.run_turns")] == [0, 1]


def test_duplicate_call_ids_in_a_turn_are_invalid(worker: Conn, admin_conn: Conn) -> None:
    lease = submit_and_claim(worker)
    with refused(admin_conn, "RL006") as info:
        record_turn(worker, lease, 0, [call("c1"), call("c2"), call("c1", tool="other")])
    assert "c1 appears twice" in info.value.diag.message_primary


MALFORMED_CALLS: dict[str, Any] = {
    "object": {"call_id": "c1"},
    "string item": ["c1"],
    "no call id": [{"tool": "t"}],
    "empty call id": [{"call_id": "", "tool": "t"}],
    "space": [{"call_id": "c 1", "tool": "t"}],
    "colon": [{"call_id": "c:1", "tool": "t"}],
    "numeric call id": [{"call_id": 1, "tool": "t"}],
    "no tool": [{"call_id": "c1"}],
    "bad tool": [{"call_id": "c1", "tool": "bad tool"}],
    "array args": [{"call_id": "c1", "tool": "t", "args": [1]}],
}


def test_malformed_calls_are_invalid(worker: Conn, admin_conn: Conn) -> None:
    lease = submit_and_claim(worker)
    for case, calls in MALFORMED_CALLS.items():
        with refused(admin_conn, "RL006", case):
            record_turn(worker, lease, 0, calls)
    with refused(admin_conn, "RL006", "SQL NULL"):
        worker.execute(
            "SELECT runledger.record_turn_v4(%s, %s, %s, 0, NULL,"
            " NULL, NULL, NULL, NULL, false, NULL)",
            (lease.run_id, lease.lease_id, lease.token),
        )


def test_recording_the_same_decision_twice_is_a_no_op(worker: Conn, admin_conn: Conn) -> None:
    lease = submit_and_claim(worker)
    decision = [call("c1", title="a"), call("c2", tool="notify")]
    record_turn(worker, lease, 0, decision)
    dispatch(worker, lease, key("r1", 0, "c1"))

    with unchanged(admin_conn):
        record_turn(worker, lease, 0, decision)
    assert call_row(admin_conn, "r1:0:c1")["status"] == "dispatched"


def test_another_decision_for_a_recorded_turn_is_refused(worker: Conn, admin_conn: Conn) -> None:
    lease = submit_and_claim(worker)
    record_turn(worker, lease, 0, [call("c1", title="a")])
    others = {
        "no calls": [],
        "other args": [call("c1", title="b")],
        "one more call": [call("c1", title="a"), call("c2", tool="x")],
    }
    for case, other in others.items():
        with refused(admin_conn, "RL004", case) as info:
            record_turn(worker, lease, 0, other)
        assert "already recorded" in info.value.diag.message_primary


def _second_call_left(conn: Conn, run_id: str, status: str) -> Any:
    """Turn 0 with calls c1 (succeeded) and c2 left in ``status``."""
    lease = submit_and_claim(conn, run_id)
    record_turn(conn, lease, 0, [call("c1"), call("c2")])
    c1, c2 = key(run_id, 0, "c1"), key(run_id, 0, "c2")
    dispatch(conn, lease, c1)
    complete(conn, lease, c1, "succeeded", {"ok": True})
    if status != "planned":
        dispatch(conn, lease, c2)
    if status in ("succeeded", "failed", "unknown"):
        complete(conn, lease, c2, status, {"v": 1})
    return lease


def test_next_turn_waits_for_every_call_to_be_final(worker: Conn, admin_conn: Conn) -> None:
    for status in ["planned", "dispatched", "unknown"]:
        lease = _second_call_left(worker, status, status)
        assert call_row(admin_conn, key(status, 0, "c2"))["status"] == status

        with refused(admin_conn, "RL004", status) as info:
            record_turn(worker, lease, 1, [call("c3")])
        assert "without a final result" in info.value.diag.message_primary


def test_next_turn_is_allowed_once_calls_are_final(worker: Conn, admin_conn: Conn) -> None:
    for status in ["succeeded", "failed"]:
        lease = _second_call_left(worker, status, status)

        record_turn(worker, lease, 1, [call("c3")])

        assert call_row(admin_conn, key(status, 1, "c3"))["status"] == "planned"


def test_an_empty_turn_is_recorded(worker: Conn, admin_conn: Conn) -> None:
    lease = submit_and_claim(worker)
    record_turn(worker, lease, 0, [])
    assert count(admin_conn, "run_turns") == 1
    assert count(admin_conn, "run_calls") == 0


# -- dispatch and complete --------------------------------------------------------------------


def test_dispatch_then_complete_records_the_receipt(worker: Conn, admin_conn: Conn) -> None:
    lease = submit_and_claim(worker)
    k = plan_call(worker, lease)

    assert dispatch(worker, lease, k) == 1
    row = call_row(admin_conn, k)
    assert (row["status"], row["attempts"], row["dispatched_token"]) == ("dispatched", 1, 1)
    assert row["dispatched_by"] == "w1" and row["dispatched_at"] is not None

    complete(worker, lease, k, "succeeded", {"ticket": 7}, {"provider_id": "T-7"})

    row = call_row(admin_conn, k)
    assert (row["status"], row["result"], row["receipt"], row["error"]) == (
        "succeeded",
        {"ticket": 7},
        {"provider_id": "T-7"},
        None,
    )
    assert (row["completed_token"], row["completed_by"]) == (1, "w1")
    kinds = [e["kind"] for e in events(admin_conn, "r1")]
    assert kinds[-2:] == ["call_dispatched", "call_succeeded"]
    [ledger] = rows(admin_conn, "SELECT * FROM runledger.effect_ledger")
    assert (ledger["idempotency_key"], ledger["status"], ledger["receipt"]) == (
        k,
        "succeeded",
        {"provider_id": "T-7"},
    )


def test_a_failed_call_keeps_its_error_not_a_result(worker: Conn, admin_conn: Conn) -> None:
    lease = submit_and_claim(worker)
    k = dispatched_call(worker, lease)
    complete(worker, lease, k, "failed", {"reason": "card declined"})
    row = call_row(admin_conn, k)
    assert (row["status"], row["result"], row["error"]) == (
        "failed",
        None,
        {"reason": "card declined"},
    )


def test_dispatch_again_under_the_same_lease_counts_attempts(
    worker: Conn, admin_conn: Conn
) -> None:
    lease = submit_and_claim(worker)
    k = dispatched_call(worker, lease)
    assert dispatch(worker, lease, k) == 2
    assert call_row(admin_conn, k)["attempts"] == 2


def test_a_call_dispatched_under_an_earlier_lease_is_completed_by_the_next(
    worker: Conn, worker2: Conn, admin_conn: Conn, db_clock: Any
) -> None:
    first = submit_and_claim(worker)
    k = dispatched_call(worker, first)
    db_clock.advance(31)
    [second] = claim(worker2, "w2")

    complete(worker2, second, k, "succeeded", {"found": True}, {"id": "T-1"})

    row = call_row(admin_conn, k)
    assert (row["status"], row["attempts"]) == ("succeeded", 1)
    assert (row["dispatched_token"], row["completed_token"]) == (1, 2)


def test_complete_needs_a_dispatched_call(worker: Conn, admin_conn: Conn) -> None:
    lease = submit_and_claim(worker)
    k = plan_call(worker, lease)
    with refused(admin_conn, "RL004") as info:
        complete(worker, lease, k, "succeeded", {"ok": True})
    assert "not dispatched" in info.value.diag.message_primary


def test_a_final_call_is_neither_dispatched_nor_completed_again(
    worker: Conn, admin_conn: Conn
) -> None:
    for final in ["succeeded", "failed"]:
        lease = submit_and_claim(worker, final)
        k = dispatched_call(worker, lease)
        complete(worker, lease, k, final, {"v": 1}, {"r": 1})

        with refused(admin_conn, "RL004", final):
            dispatch(worker, lease, k)
        with refused(admin_conn, "RL004", final):
            complete(worker, lease, k, "succeeded", {"v": 2}, {"r": 2})


def test_an_unknown_call_cannot_be_dispatched_by_a_worker(worker: Conn, admin_conn: Conn) -> None:
    lease = submit_and_claim(worker)
    k = dispatched_call(worker, lease)
    complete(worker, lease, k, "unknown", {"error": "timeout"})

    with refused(admin_conn, "RL004") as info:
        dispatch(worker, lease, k)
    assert "resolve" in info.value.diag.message_hint


def test_dispatch_of_an_unknown_key(worker: Conn, admin_conn: Conn) -> None:
    lease = submit_and_claim(worker)
    plan_call(worker, lease)
    for bad_key in ["r1:0:c9", "r1:1:c1", "other:0:c1", "r1:0:C1"]:
        with refused(admin_conn, "RL003", bad_key):
            dispatch(worker, lease, bad_key)
    with refused(admin_conn, "RL006", "long"):
        dispatch(worker, lease, "x" * 301)


def test_a_call_of_another_run_is_not_reachable_with_my_lease(
    worker: Conn, admin_conn: Conn
) -> None:
    a = submit_and_claim(worker, "a")
    b = submit_and_claim(worker, "b")
    kb = plan_call(worker, b)
    with refused(admin_conn, "RL003"):
        dispatch(worker, a, kb)


def test_unknown_outcome_and_status_words_are_invalid(worker: Conn, admin_conn: Conn) -> None:
    lease = submit_and_claim(worker)
    k = dispatched_call(worker, lease)
    for outcome in ["done", "SUCCEEDED", "", "planned", "dispatched", None]:
        with refused(admin_conn, "RL006", outcome) as info:
            worker.execute(
                "SELECT runledger.complete_call(%s, %s, %s, %s, %s, NULL, NULL)",
                (lease.run_id, lease.lease_id, lease.token, k, outcome),
            )
        assert "unknown outcome" in info.value.diag.message_primary
    for status in ["cancelled", "queued", "running", "done", None]:
        with refused(admin_conn, "RL006", status) as info:
            worker.execute(
                "SELECT runledger.finish_run(%s, %s, %s, %s, NULL, NULL)",
                (lease.run_id, lease.lease_id, lease.token, status),
            )
        assert "unknown status" in info.value.diag.message_primary


async def test_store_refuses_unknown_words_before_sending(store: Any, admin_conn: Conn) -> None:
    with unchanged(admin_conn):
        with pytest.raises(errors.InvalidInput):
            await store.worker.complete_call("r1", uuid.uuid4(), 1, "r1:0:c1", "done", None, None)
        with pytest.raises(errors.InvalidInput):
            await store.worker.finish_run("r1", uuid.uuid4(), 1, "cancelled", None, None)
        with pytest.raises(errors.InvalidInput):
            await store.operator.resolve_call("r1:0:c1", "ok", None, "alice", None)


def test_a_run_cannot_succeed_with_open_calls(worker: Conn, admin_conn: Conn) -> None:
    for status in ["planned", "dispatched", "unknown"]:
        lease = _second_call_left(worker, status, status)

        with refused(admin_conn, "RL004", status) as info:
            finish(worker, lease, "succeeded", {"done": True})
        assert "1 open call(s)" in info.value.diag.message_primary

        if status == "planned":  # never sent: failing is fine
            finish(worker, lease, "failed", None, reason="gave up")
            assert run_row(admin_conn, status)["status"] == "failed"
        else:  # may have taken effect: it must stay reconcilable, so pause, not fail
            with refused(admin_conn, "RL004", status) as info:
                finish(worker, lease, "failed", None, reason="gave up")
            assert "in flight or unknown" in info.value.diag.message_primary
            finish(worker, lease, "paused", None, reason="needs a person")
            assert run_row(admin_conn, status)["status"] == "paused"
