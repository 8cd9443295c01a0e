"""Leases and fencing: a stale worker is refused by the database, whatever it runs."""

from __future__ import annotations

import datetime as dt
import uuid
from collections.abc import Callable
from dataclasses import replace
from typing import Any

import psycopg
import pytest

from runledger import errors
from runledger.testing import DbClock

from .helpers import (
    LEASE_SECONDS,
    Lease,
    call,
    cancel,
    checkpoint,
    claim,
    complete,
    dispatch,
    dispatched_call,
    events,
    finish,
    key,
    plan_call,
    record_turn,
    refused,
    release,
    renew,
    report_stale_write,
    rows,
    run_row,
    sqlstate,
    submit,
    submit_and_claim,
    unchanged,
)

Conn = psycopg.Connection[Any]

# Each write a worker makes: (prepare under the live lease, the write itself).
WRITES: dict[str, tuple[Callable[[Conn, Lease], Any], Callable[[Conn, Lease, Any], Any]]] = {
    "checkpoint": (
        lambda c, lease: None,
        lambda c, lease, _: checkpoint(c, lease, 0, {"step": 1}),
    ),
    "record_turn": (
        lambda c, lease: None,
        lambda c, lease, _: record_turn(c, lease, 0, [call("c1")]),
    ),
    "dispatch_call": (
        lambda c, lease: plan_call(c, lease),
        lambda c, lease, k: dispatch(c, lease, k),
    ),
    "complete_call": (
        lambda c, lease: dispatched_call(c, lease),
        lambda c, lease, k: complete(c, lease, k, "succeeded", {"ok": True}, {"id": "T-1"}),
    ),
    "finish_run": (
        lambda c, lease: None,
        lambda c, lease, _: finish(c, lease, "succeeded", {"done": True}),
    ),
    "release_lease": (
        lambda c, lease: None,
        lambda c, lease, _: release(c, lease),
    ),
}


def _prepare_every_write(conn: Conn) -> dict[str, tuple[Lease, Any]]:
    """One claimed run per kind of write, prepared up to that write."""
    out: dict[str, tuple[Lease, Any]] = {}
    for write, (prepare, _) in WRITES.items():
        lease = submit_and_claim(conn, write.replace("_", "-"))
        out[write] = (lease, prepare(conn, lease))
    return out


def test_write_after_lease_expiry_is_refused_and_writes_nothing(
    worker: Conn, admin_conn: Conn, db_clock: DbClock
) -> None:
    prepared = _prepare_every_write(worker)
    db_clock.advance(LEASE_SECONDS + 1)

    for write, (lease, arg) in prepared.items():
        with refused(admin_conn, "RL001", write) as info:
            WRITES[write][1](worker, lease, arg)
        assert "expired" in info.value.diag.message_primary, write
        assert run_row(admin_conn, lease.run_id)["status"] == "running"


def test_write_just_before_lease_expiry_is_accepted(
    worker: Conn, admin_conn: Conn, db_clock: DbClock
) -> None:
    prepared = _prepare_every_write(worker)
    db_clock.advance(LEASE_SECONDS - 5)

    for write, (lease, arg) in prepared.items():
        before = len(events(admin_conn, lease.run_id))
        WRITES[write][1](worker, lease, arg)
        assert len(events(admin_conn, lease.run_id)) == before + 1, write


def test_no_takeover_while_the_lease_is_live(
    worker: Conn, worker2: Conn, admin_conn: Conn, db_clock: DbClock
) -> None:
    submit_and_claim(worker)
    db_clock.advance(LEASE_SECONDS - 1)

    with unchanged(admin_conn):
        assert claim(worker2, "w2") == []


def test_takeover_after_expiry_mints_a_new_lease_and_logs_the_previous_owner(
    worker: Conn, worker2: Conn, admin_conn: Conn, db_clock: DbClock
) -> None:
    first = submit_and_claim(worker)
    assert (first.token, first.takeover) == (1, False)
    db_clock.advance(LEASE_SECONDS + 1)

    [second] = claim(worker2, "w2")

    assert second.run_id == "r1"
    assert second.takeover is True
    assert second.token == first.token + 1
    assert second.lease_id != first.lease_id
    run = run_row(admin_conn, "r1")
    assert run["status"] == "running"
    assert run["lease_owner"] == "w2"
    assert run["lease_id"] == second.lease_id
    assert run["fencing_token"] == 2
    assert run["claims"] == 2
    assert run["lease_expires_at"] == second.lease_expires_at
    assert [e["kind"] for e in events(admin_conn, "r1")] == ["submitted", "claimed", "takeover"]
    [took] = events(admin_conn, "r1", "takeover")
    assert took["actor"] == "w2"
    assert took["fencing_token"] == 2
    assert took["detail"]["previous_owner"] == "w1"
    assert took["detail"]["previous_token"] == 1
    assert took["detail"]["lease_id"] == str(second.lease_id)
    [history] = rows(admin_conn, "SELECT * FROM runledger.lease_history WHERE kind = 'takeover'")
    assert (history["worker_id"], history["previous_owner"], history["previous_token"]) == (
        "w2",
        "w1",
        1,
    )
    assert history["lease_id"] == second.lease_id


def test_the_new_holder_can_write_and_the_old_one_cannot(
    worker: Conn, worker2: Conn, admin_conn: Conn, db_clock: DbClock
) -> None:
    first = submit_and_claim(worker)
    db_clock.advance(LEASE_SECONDS + 1)
    [second] = claim(worker2, "w2")

    with refused(admin_conn, "RL001"):
        checkpoint(worker, first, 0, {"stale": True})
    assert checkpoint(worker2, second, 0, {"fresh": True}) == 1
    assert run_row(admin_conn, "r1")["state"] == {"fresh": True}


def test_a_write_needs_both_the_current_lease_id_and_token(
    worker: Conn, worker2: Conn, admin_conn: Conn, db_clock: DbClock
) -> None:
    first = submit_and_claim(worker)
    db_clock.advance(LEASE_SECONDS + 1)
    [second] = claim(worker2, "w2")
    forged = {
        "old lease id, new token": replace(second, lease_id=first.lease_id),
        "new lease id, old token": replace(second, token=first.token),
        "new lease id, token + 1": replace(second, token=second.token + 1),
    }

    for case, lease in forged.items():
        with refused(admin_conn, "RL001", case):
            checkpoint(worker2, lease, 0, {"forged": True})
        with refused(admin_conn, "RL001", case):
            record_turn(worker2, lease, 0, [call("c1")])
        with refused(admin_conn, "RL001", case):
            finish(worker2, lease, "succeeded")
    assert checkpoint(worker2, second, 0, {"real": True}) == 1


def test_a_token_granted_twice_is_told_apart_by_the_lease_id(
    worker: Conn, admin_conn: Conn
) -> None:
    """After a failover that lost commits the counter repeats; the uuid does not."""
    lease = submit_and_claim(worker)
    twin = replace(lease, lease_id=uuid.uuid4())

    with refused(admin_conn, "RL001"):
        checkpoint(worker, twin, 0, {"twin": True})


def test_lease_lost_names_the_run_the_token_seen_and_the_token_expected(
    worker: Conn, worker2: Conn, db_clock: DbClock
) -> None:
    first = submit_and_claim(worker, "run-42")
    db_clock.advance(LEASE_SECONDS + 1)
    [second] = claim(worker2, "w2")

    with sqlstate("RL001") as info:
        checkpoint(worker, first, 0, {"x": 1})

    diag = info.value.diag
    assert "run-42" in diag.message_primary
    assert "token 1" in diag.message_primary
    assert f"seen lease {first.lease_id} token 1" in diag.message_detail
    assert f"current lease {second.lease_id} token 2 held by w2" in diag.message_detail
    assert diag.message_hint


def test_lease_expired_names_the_run_and_the_tokens(worker: Conn, db_clock: DbClock) -> None:
    lease = submit_and_claim(worker, "run-43")
    db_clock.advance(LEASE_SECONDS + 1)

    with sqlstate("RL001") as info:
        checkpoint(worker, lease, 0, {"x": 1})

    diag = info.value.diag
    assert "run-43" in diag.message_primary
    assert "expired" in diag.message_primary
    assert f"token {lease.token}" in diag.message_primary
    assert f"seen lease {lease.lease_id} token 1" in diag.message_detail
    assert f"current lease {lease.lease_id} token 1" in diag.message_detail


async def test_store_raises_lease_lost_with_run_and_token(
    store: Any, admin_conn: Conn, db_clock: DbClock
) -> None:
    await store.worker.submit_run("r1", "demo", "1", {"a": 1})
    [(first, _)] = await store.worker.claim_runs("w1", ["demo@1"], dt.timedelta(seconds=30), 1)
    db_clock.advance(31)
    [(second, _)] = await store.worker.claim_runs("w2", ["demo@1"], dt.timedelta(seconds=30), 1)
    assert second.takeover and second.fencing_token == first.fencing_token + 1

    with unchanged(admin_conn), pytest.raises(errors.LeaseLost) as info:
        await store.worker.checkpoint("r1", first.lease_id, first.fencing_token, 0, {"x": 1})

    assert info.value.run_id == "r1"
    assert info.value.fencing_token == first.fencing_token
    assert info.value.detail is not None and "token 2" in info.value.detail
    assert isinstance(info.value.__cause__, psycopg.Error)
    assert info.value.__cause__.sqlstate == "RL001"


# -- renewals ---------------------------------------------------------------------------


def test_renew_extends_a_live_lease(worker: Conn, admin_conn: Conn, db_clock: DbClock) -> None:
    lease = submit_and_claim(worker)
    db_clock.advance(20)

    [renewed] = renew(worker, "w1", [lease], lease_seconds=60)

    run = run_row(admin_conn, "r1")
    assert renewed["run_id"] == "r1"
    assert renewed["lease_expires_at"] == run["lease_expires_at"]
    assert run["lease_expires_at"] > lease.lease_expires_at
    assert (run["lease_id"], run["fencing_token"]) == (lease.lease_id, lease.token)
    assert events(admin_conn, "r1", "renewal_failed") == []
    # Renewed: still writable after the original expiry.
    db_clock.advance(LEASE_SECONDS)
    assert checkpoint(worker, lease, 0, {"still": "mine"}) == 1


def test_renew_of_an_expired_lease_returns_nothing_and_logs_the_failure(
    worker: Conn, admin_conn: Conn, db_clock: DbClock
) -> None:
    lease = submit_and_claim(worker)
    db_clock.advance(LEASE_SECONDS + 1)

    assert renew(worker, "w1", [lease]) == []

    run = run_row(admin_conn, "r1")
    assert run["lease_expires_at"] == lease.lease_expires_at
    [failed] = events(admin_conn, "r1", "renewal_failed")
    assert failed["actor"] == "w1"
    assert failed["fencing_token"] is None
    assert failed["detail"]["lease_id"] == str(lease.lease_id)
    with sqlstate("RL001"):
        checkpoint(worker, lease, 0, {"x": 1})


def test_renew_of_a_taken_over_lease_returns_nothing_and_leaves_the_new_lease(
    worker: Conn, worker2: Conn, admin_conn: Conn, db_clock: DbClock
) -> None:
    first = submit_and_claim(worker)
    db_clock.advance(LEASE_SECONDS + 1)
    [second] = claim(worker2, "w2")

    assert renew(worker, "w1", [first], lease_seconds=600) == []

    run = run_row(admin_conn, "r1")
    assert (run["lease_id"], run["lease_owner"]) == (second.lease_id, "w2")
    assert run["lease_expires_at"] == second.lease_expires_at
    [failed] = events(admin_conn, "r1", "renewal_failed")
    assert failed["detail"]["current_lease_id"] == str(second.lease_id)
    assert failed["detail"]["current_owner"] == "w2"


def test_renew_batch_returns_only_the_leases_still_held(worker: Conn, admin_conn: Conn) -> None:
    submit(worker, "a")
    submit(worker, "b")
    held = {x.run_id: x for x in claim(worker, "w1", max_runs=2)}
    cancel(admin_conn, "b")

    got = renew(worker, "w1", [held["a"], held["b"]])

    assert [r["run_id"] for r in got] == ["a"]
    # the cancellation has its own event naming the holder; no renewal failure on top
    assert events(admin_conn, "b", "renewal_failed") == []
    assert events(admin_conn, "b", "run_cancelled")[0]["detail"]["previous_owner"] == "w1"
    assert events(admin_conn, "a", "renewal_failed") == []


def test_renew_racing_its_own_finish_is_not_a_renewal_failure(
    worker: Conn, admin_conn: Conn
) -> None:
    lease = submit_and_claim(worker)
    finish(worker, lease, "succeeded")  # the keeper's list was taken just before this

    assert renew(worker, "w1", [lease]) == []
    assert events(admin_conn, "r1", "renewal_failed") == []


def test_renew_by_another_worker_id_is_refused(worker: Conn, admin_conn: Conn) -> None:
    lease = submit_and_claim(worker)

    assert renew(worker, "intruder", [lease], lease_seconds=600) == []
    assert run_row(admin_conn, "r1")["lease_expires_at"] == lease.lease_expires_at


# -- finishing, releasing, cancelling ---------------------------------------------------


def test_finish_run_clears_the_lease(worker: Conn, admin_conn: Conn) -> None:
    lease = submit_and_claim(worker)

    finish(worker, lease, "succeeded", {"answer": 42})

    run = run_row(admin_conn, "r1")
    assert run["status"] == "succeeded"
    assert run["result"] == {"answer": 42}
    assert (run["lease_id"], run["lease_expires_at"], run["lease_owner"]) == (None, None, None)
    assert run["finished_at"] is not None
    assert run["fencing_token"] == lease.token
    [done] = events(admin_conn, "r1", "run_succeeded")
    assert (done["actor"], done["fencing_token"]) == ("w1", lease.token)
    with refused(admin_conn, "RL001"):
        checkpoint(worker, lease, 0, {"after": "finish"})
    assert renew(worker, "w1", [lease]) == []


def test_finish_run_failed_records_the_error(worker: Conn, admin_conn: Conn) -> None:
    lease = submit_and_claim(worker)

    finish(worker, lease, "failed", {"code": "E42"}, reason="tool failed")

    run = run_row(admin_conn, "r1")
    assert run["status"] == "failed"
    assert run["error"] == {"reason": "tool failed", "code": "E42"}
    assert run["result"] is None
    assert (run["lease_id"], run["lease_expires_at"]) == (None, None)


def test_finished_run_is_never_claimed_again(
    worker: Conn, admin_conn: Conn, db_clock: DbClock
) -> None:
    lease = submit_and_claim(worker)
    finish(worker, lease, "succeeded")
    db_clock.advance(3600)

    with unchanged(admin_conn):
        assert claim(worker, "w2") == []


def test_release_lease_requeues_the_run(worker: Conn, worker2: Conn, admin_conn: Conn) -> None:
    lease = submit_and_claim(worker)

    release(worker, lease)

    run = run_row(admin_conn, "r1")
    assert run["status"] == "queued"
    assert (run["lease_id"], run["lease_expires_at"], run["lease_owner"]) == (None, None, None)
    [again] = claim(worker2, "w2")
    assert (again.token, again.takeover) == (lease.token + 1, False)
    with sqlstate("RL001"):
        release(worker, lease)


def test_cancel_of_a_running_run_fences_out_its_holder(
    worker: Conn, operator: Conn, admin_conn: Conn
) -> None:
    lease = submit_and_claim(worker)
    k = dispatched_call(worker, lease)

    cancel(operator, "r1", "alice", "wrong input")

    run = run_row(admin_conn, "r1")
    assert run["status"] == "cancelled"
    assert (run["lease_id"], run["lease_expires_at"], run["lease_owner"]) == (None, None, None)
    assert run["finished_at"] is not None
    [ev] = events(admin_conn, "r1", "run_cancelled")
    assert ev["actor"] == "alice"
    assert ev["detail"]["previous_owner"] == "w1"
    with unchanged(admin_conn):
        with sqlstate("RL001") as info:
            complete(worker, lease, k, "succeeded", {"ok": True})
        assert "cancelled" in info.value.diag.message_detail
        with sqlstate("RL001"):
            checkpoint(worker, lease, 0, {"x": 1})
        with sqlstate("RL001"):
            finish(worker, lease, "succeeded")
    assert renew(worker, "w1", [lease]) == []


def test_cancel_is_idempotent_and_refused_for_finished_runs(
    worker: Conn, operator: Conn, admin_conn: Conn
) -> None:
    submit(worker, "q")
    cancel(operator, "q")
    with unchanged(admin_conn):
        cancel(operator, "q")
    lease = submit_and_claim(worker, "done")
    finish(worker, lease, "succeeded")

    with refused(admin_conn, "RL004"):
        cancel(operator, "done")
    with refused(admin_conn, "RL003"):
        cancel(operator, "missing")


def test_report_stale_write_keeps_the_stale_token_out_of_the_token_column(
    worker: Conn, worker2: Conn, admin_conn: Conn, db_clock: DbClock
) -> None:
    first = submit_and_claim(worker)
    db_clock.advance(LEASE_SECONDS + 1)
    [second] = claim(worker2, "w2")
    with sqlstate("RL001") as info:
        checkpoint(worker, first, 0, {"x": 1})

    report_stale_write(worker, first, "checkpoint", info.value.diag.message_primary)

    [ev] = events(admin_conn, "r1", "stale_write_rejected")
    assert ev["fencing_token"] is None
    assert ev["state_version"] is None
    assert ev["actor"] == "w1"
    assert ev["detail"]["stale_token"] == first.token
    assert ev["detail"]["stale_lease_id"] == str(first.lease_id)
    assert ev["detail"]["current_token"] == second.token
    assert ev["detail"]["current_owner"] == "w2"
    assert ev["detail"]["operation"] == "checkpoint"
    assert "r1" in ev["detail"]["message"]
    # Once the run was taken over, no event carries the stale token in its token column.
    [took] = events(admin_conn, "r1", "takeover")
    later = [e for e in events(admin_conn, "r1") if e["event_id"] > took["event_id"]]
    assert [e["kind"] for e in later] == ["stale_write_rejected"]
    assert all(e["fencing_token"] in (None, second.token) for e in later)


async def test_store_report_stale_write_after_lease_lost(
    store: Any, admin_conn: Conn, db_clock: DbClock
) -> None:
    await store.worker.submit_run("r1", "demo", "1", {})
    [(first, _)] = await store.worker.claim_runs("w1", ["demo@1"], dt.timedelta(seconds=30), 1)
    db_clock.advance(31)
    await store.worker.claim_runs("w2", ["demo@1"], dt.timedelta(seconds=30), 1)
    with pytest.raises(errors.LeaseLost) as info:
        await store.worker.record_turn("r1", first.lease_id, first.fencing_token, 0, [call("c1")])

    await store.worker.report_stale_write(
        "r1", "w1", first.lease_id, first.fencing_token, "record_turn", str(info.value)
    )

    [ev] = [e for e in await store.operator.list_events("r1") if e.kind == "stale_write_rejected"]
    assert ev.fencing_token is None
    assert ev.detail["stale_token"] == first.fencing_token
    assert ev.detail["current_token"] == first.fencing_token + 1
    assert rows(admin_conn, "SELECT * FROM runledger.run_turns") == []


def test_a_call_in_flight_under_the_old_lease_is_finished_by_the_new_holder(
    worker: Conn, worker2: Conn, admin_conn: Conn, db_clock: DbClock
) -> None:
    first = submit_and_claim(worker)
    k = dispatched_call(worker, first)
    db_clock.advance(LEASE_SECONDS + 1)
    [second] = claim(worker2, "w2")

    with refused(admin_conn, "RL001"):
        complete(worker, first, k, "succeeded", {"late": True})
    assert dispatch(worker2, second, k) == 2
    complete(worker2, second, k, "succeeded", {"ok": True}, {"ticket": "T-1"})

    row = rows(admin_conn, "SELECT * FROM runledger.run_calls")[0]
    assert row["idempotency_key"] == key("r1", 0, "c1")
    assert (row["status"], row["attempts"]) == ("succeeded", 2)
    assert (row["dispatched_token"], row["completed_token"]) == (2, 2)
    assert (row["dispatched_by"], row["completed_by"]) == ("w2", "w2")
    assert row["receipt"] == {"ticket": "T-1"}
