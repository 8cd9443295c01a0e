"""Unknown outcomes: pause, then an operator reconciles (resolve_call, retry_run)."""

from __future__ import annotations

from typing import Any

import psycopg
import pytest

from runledger import errors

from .helpers import (
    call_row,
    claim,
    complete,
    dispatch,
    dispatched_call,
    events,
    finish,
    paused_on_unknown,
    refused,
    resolve,
    retry,
    run_row,
    submit,
    submit_and_claim,
)

Conn = psycopg.Connection[Any]


def test_an_unknown_outcome_leaves_the_run_running_until_it_pauses(
    worker: Conn, admin_conn: Conn
) -> None:
    lease = submit_and_claim(worker)
    k = dispatched_call(worker, lease)

    complete(worker, lease, k, "unknown", {"error": "timeout after send"})

    row = call_row(admin_conn, k)
    assert (row["status"], row["result"], row["error"]) == (
        "unknown",
        None,
        {"error": "timeout after send"},
    )
    assert run_row(admin_conn, "r1")["status"] == "running"

    finish(worker, lease, "paused", reason="call r1:0:c1 unknown")

    run = run_row(admin_conn, "r1")
    assert run["status"] == "paused"
    assert run["pause_reason"] == "call r1:0:c1 unknown"
    assert (run["lease_id"], run["lease_expires_at"], run["finished_at"]) == (None, None, None)
    [paused] = events(admin_conn, "r1", "run_paused")
    assert paused["detail"] == {"reason": "call r1:0:c1 unknown"}
    assert claim(worker, "w2") == []  # a paused run is not claimable


def test_resolve_applied_records_the_receipt_and_requeues(
    worker: Conn, operator: Conn, admin_conn: Conn
) -> None:
    lease = submit_and_claim(worker)
    [k] = paused_on_unknown(worker, lease)

    resolve(operator, k, "applied", {"ticket": "T-9"}, "alice", "found it in the console")

    row = call_row(admin_conn, k)
    assert (row["status"], row["receipt"], row["result"]) == (
        "succeeded",
        {"ticket": "T-9"},
        {"ticket": "T-9"},
    )
    assert row["error"] is None  # a succeeded call, like one completed as succeeded
    assert (row["resolved_by"], row["resolution_note"]) == ("alice", "found it in the console")
    assert row["resolved_at"] is not None
    assert row["attempts"] == 1
    run = run_row(admin_conn, "r1")
    assert (run["status"], run["pause_reason"]) == ("queued", None)
    [resolved] = events(admin_conn, "r1", "call_resolved")
    assert resolved["actor"] == "alice"
    assert resolved["fencing_token"] is None
    assert resolved["detail"]["resolution"] == "applied"
    assert resolved["detail"]["unknown_error"] == {"error": "timeout"}
    assert [e["detail"] for e in events(admin_conn, "r1", "run_requeued")] == [
        {"after": "resolve_call"}
    ]
    # The next worker takes it under a new token and sees the call done.
    [again] = claim(worker, "w2")
    assert (again.token, again.takeover) == (lease.token + 1, False)
    with refused(admin_conn, "RL004"):
        dispatch(worker, again, k)


def test_resolve_not_applied_sends_the_same_key_again(
    worker: Conn, operator: Conn, admin_conn: Conn
) -> None:
    lease = submit_and_claim(worker)
    [k] = paused_on_unknown(worker, lease)

    resolve(operator, k, "not_applied", None, "alice", "provider has no record")

    row = call_row(admin_conn, k)
    assert (row["status"], row["result"], row["receipt"], row["error"]) == (
        "planned",
        None,
        None,
        None,
    )
    assert run_row(admin_conn, "r1")["status"] == "queued"
    [again] = claim(worker, "w2")
    assert dispatch(worker, again, k) == 2
    complete(worker, again, k, "succeeded", {"ok": True}, {"id": "T-2"})
    row = call_row(admin_conn, k)
    assert (row["idempotency_key"], row["status"], row["attempts"]) == ("r1:0:c1", "succeeded", 2)
    assert (row["dispatched_token"], row["completed_token"]) == (2, 2)


def test_resolve_abandoned_fails_the_call(worker: Conn, operator: Conn, admin_conn: Conn) -> None:
    lease = submit_and_claim(worker)
    [k] = paused_on_unknown(worker, lease)

    resolve(operator, k, "abandoned", None, "alice", "do not retry")

    row = call_row(admin_conn, k)
    assert row["status"] == "failed"
    assert row["error"] == {"reason": "abandoned", "note": "do not retry"}
    assert row["result"] is None
    assert run_row(admin_conn, "r1")["status"] == "queued"
    [again] = claim(worker, "w2")
    with refused(admin_conn, "RL004"):
        dispatch(worker, again, k)


def test_the_run_waits_until_every_unknown_call_is_resolved(
    worker: Conn, operator: Conn, admin_conn: Conn
) -> None:
    lease = submit_and_claim(worker)
    k1, k2 = paused_on_unknown(worker, lease, ["c1", "c2"])

    resolve(operator, k1, "applied", {"id": 1})
    assert run_row(admin_conn, "r1")["status"] == "paused"
    assert events(admin_conn, "r1", "run_requeued") == []

    resolve(operator, k2, "abandoned")
    assert run_row(admin_conn, "r1")["status"] == "queued"
    assert len(events(admin_conn, "r1", "run_requeued")) == 1


def test_resolve_refuses_calls_that_are_not_unknown(
    worker: Conn, operator: Conn, admin_conn: Conn
) -> None:
    lease = submit_and_claim(worker)
    [k] = paused_on_unknown(worker, lease)
    # An unknown call of a run that is still running (not yet paused) is not resolved.
    live = submit_and_claim(worker, "live")
    lk = dispatched_call(worker, live)
    complete(worker, live, lk, "unknown", None)
    resolve(operator, k, "applied", {"id": 1})

    with refused(admin_conn, "RL004", "already resolved"):
        resolve(operator, k, "abandoned")
    with refused(admin_conn, "RL003", "no such call"):
        resolve(operator, "r1:0:nope", "applied", {"id": 1})
    with refused(admin_conn, "RL004", "running run"):
        resolve(operator, lk, "applied", {"id": 2})


def test_resolve_refuses_bad_words_and_arguments(
    worker: Conn, operator: Conn, admin_conn: Conn
) -> None:
    lease = submit_and_claim(worker)
    [k] = paused_on_unknown(worker, lease)

    for word in ["ok", "APPLIED", "succeeded", "", None]:
        with refused(admin_conn, "RL006", word) as info:
            resolve(operator, k, word, {"id": 1})  # type: ignore[arg-type]
        assert "unknown resolution" in info.value.diag.message_primary
    with refused(admin_conn, "RL006", "receipt not an object"):
        resolve(operator, k, "applied", [1, 2])
    with refused(admin_conn, "RL006", "no actor"):
        resolve(operator, k, "applied", {"id": 1}, actor="")
    admin_conn.execute("UPDATE runledger.settings SET max_payload_bytes = 2048")
    with refused(admin_conn, "RL006", "oversized receipt"):
        resolve(operator, k, "applied", {"pad": "x" * 3000})


async def test_store_resolves_through_the_operator_function(
    store: Any, worker: Conn, admin_conn: Conn
) -> None:
    lease = submit_and_claim(worker)
    [k] = paused_on_unknown(worker, lease)

    with pytest.raises(errors.InvalidTransition):
        await store.operator.retry_run("r1", "bob")  # unknown calls first
    await store.operator.resolve_call(k, "applied", {"ticket": "T-1"}, "bob", None)

    call = await store.operator.get_call(k)
    assert (call.status, call.receipt) == ("succeeded", {"ticket": "T-1"})
    assert (await store.operator.get_run("r1")).status == "queued"
    with pytest.raises(errors.InvalidTransition):
        await store.operator.resolve_call(k, "abandoned", None, "bob", None)
    with pytest.raises(errors.RunNotFound):
        await store.operator.resolve_call("r1:0:zz", "abandoned", None, "bob", None)


def test_retry_requeues_failed_and_paused_runs_only(
    worker: Conn, operator: Conn, admin_conn: Conn
) -> None:
    failed = submit_and_claim(worker, "failed")
    finish(worker, failed, "failed", {"code": 1}, reason="boom")
    paused = submit_and_claim(worker, "paused")
    finish(worker, paused, "paused", reason="manual check")
    done = submit_and_claim(worker, "done")
    finish(worker, done, "succeeded")
    submit(worker, "queued")

    retry(operator, "failed", "bob")
    retry(operator, "paused", "bob")

    for run_id in ("failed", "paused"):
        run = run_row(admin_conn, run_id)
        assert (run["status"], run["error"], run["finished_at"], run["pause_reason"]) == (
            "queued",
            None,
            None,
            None,
        ), run_id
        [ev] = events(admin_conn, run_id, "run_requeued")
        assert (ev["actor"], ev["detail"]["previous_status"]) == ("bob", run_id)
    for run_id in ("queued", "done"):
        with refused(admin_conn, "RL004", run_id):
            retry(operator, run_id, "bob")
    with refused(admin_conn, "RL003"):
        retry(operator, "missing", "bob")
    again = {c.run_id: c.token for c in claim(worker, "w2")}
    assert again == {"failed": 2, "paused": 2, "queued": 1}


def test_retry_refuses_a_run_with_unknown_calls(
    worker: Conn, operator: Conn, admin_conn: Conn
) -> None:
    lease = submit_and_claim(worker)
    paused_on_unknown(worker, lease)

    with refused(admin_conn, "RL004") as info:
        retry(operator, "r1", "bob")
    assert "1 unknown call(s)" in info.value.diag.message_primary
