"""Store: the Python wrapper maps each function and each refusal one-to-one."""

from __future__ import annotations

import datetime as dt
import uuid
from typing import Any

import psycopg
import pytest

from runledger import errors
from runledger.db.sqlstate import map_error
from runledger.model import CallStatus, RunStatus
from runledger.testing import DbClock

from .helpers import events, rows, run_row, unchanged

Conn = psycopg.Connection[Any]
LEASE = dt.timedelta(seconds=30)


async def test_a_whole_run_through_the_store(store: Any, admin_conn: Conn) -> None:
    submitted = await store.worker.submit_run("r1", "demo", "1", {"title": "hi"})
    assert (submitted.run_id, submitted.created) == ("r1", True)
    [(c, _)] = await store.worker.claim_runs("w1", ["demo@1"], LEASE, 5)
    assert (c.run_id, c.fencing_token, c.takeover, c.state_version) == ("r1", 1, False, 0)

    decision = [{"call_id": "c1", "tool": "create_ticket", "args": {"title": "hi"}}]
    await store.worker.record_turn("r1", c.lease_id, c.fencing_token, 0, decision)
    await store.worker.record_turn("r1", c.lease_id, c.fencing_token, 0, decision)  # retried: no-op
    assert await store.worker.dispatch_call("r1", c.lease_id, c.fencing_token, "r1:0:c1") == 1
    await store.worker.complete_call(
        "r1", c.lease_id, c.fencing_token, "r1:0:c1", "succeeded", {"id": 7}, {"ticket": "T-7"}
    )
    assert await store.worker.checkpoint("r1", c.lease_id, c.fencing_token, 0, {"turn": 1}) == 1
    [renewed] = await store.worker.renew_leases("w1", ["r1"], [c.lease_id], LEASE)
    assert renewed.run_id == "r1"
    await store.worker.finish_run(
        "r1", c.lease_id, c.fencing_token, "succeeded", {"ok": True}, None
    )

    run = await store.operator.get_run("r1")
    assert (run.status, run.result, run.state, run.state_version) == (
        RunStatus.SUCCEEDED,
        {"ok": True},
        {"turn": 1},
        1,
    )
    assert (run.lease_id, run.lease_expires_at) == (None, None)
    [call] = await store.operator.list_calls("r1")
    assert (call.status, call.receipt, call.attempts) == (
        CallStatus.SUCCEEDED,
        {"ticket": "T-7"},
        1,
    )
    assert await store.operator.list_turns("r1") == [(0, decision)]
    kinds = [e.kind for e in await store.operator.list_events("r1")]
    assert kinds == [
        "submitted",
        "claimed",
        "turn_recorded",
        "call_dispatched",
        "call_succeeded",
        "checkpoint",
        "run_succeeded",
    ]
    assert kinds == [e["kind"] for e in events(admin_conn, "r1")]


async def test_store_maps_every_refusal(store: Any, admin_conn: Conn, db_clock: DbClock) -> None:
    await store.worker.submit_run("r1", "demo", "1", {})
    [(c, _)] = await store.worker.claim_runs("w1", ["demo@1"], LEASE, 1)

    with unchanged(admin_conn):
        with pytest.raises(errors.RunNotFound):
            await store.worker.checkpoint("nope", c.lease_id, c.fencing_token, 0, {})
        with pytest.raises(errors.RunNotFound):
            await store.operator.get_run("nope")
        with pytest.raises(errors.InvalidTransition):
            await store.worker.record_turn("r1", c.lease_id, c.fencing_token, 3, [])
        with pytest.raises(errors.InvalidInput):
            await store.worker.submit_run("-bad", "demo", "1", {})
        with pytest.raises(errors.InvalidInput):
            await store.worker.claim_runs("w1", ["demo"], LEASE, 1)
        with pytest.raises(errors.RunConflict):
            await store.worker.submit_run("r1", "demo", "1", {"other": 1})
        with pytest.raises(errors.VersionConflict):
            await store.worker.checkpoint("r1", c.lease_id, c.fencing_token, 5, {})
        with pytest.raises(errors.LeaseLost):
            await store.worker.checkpoint("r1", uuid.uuid4(), c.fencing_token, 0, {})
        db_clock.advance(31)
        with pytest.raises(errors.LeaseLost) as info:
            await store.worker.release_lease("r1", c.lease_id, c.fencing_token)
    assert info.value.run_id == "r1"
    assert run_row(admin_conn, "r1")["status"] == "running"
    with pytest.raises(psycopg.Error) as raw:
        admin_conn.execute("DELETE FROM runledger.run_events")
    mapped = map_error(raw.value, run_id="r1")
    assert isinstance(mapped, errors.InvariantViolation)
    assert mapped.run_id == "r1"
    assert rows(admin_conn, "SELECT count(*) AS n FROM runledger.run_events")[0]["n"] == 2


async def test_store_renewal_of_a_lost_lease_returns_nothing(
    store: Any, admin_conn: Conn, db_clock: DbClock
) -> None:
    await store.worker.submit_run("r1", "demo", "1", {})
    [(c, _)] = await store.worker.claim_runs("w1", ["demo@1"], LEASE, 1)
    db_clock.advance(31)

    assert await store.worker.renew_leases("w1", ["r1"], [c.lease_id], LEASE) == []
    assert [e.kind for e in await store.operator.list_events("r1")][-1] == "renewal_failed"


async def test_release_lease_hands_the_run_back(store: Any, admin_conn: Conn) -> None:
    await store.worker.submit_run("r1", "demo", "1", {})
    [(c, _)] = await store.worker.claim_runs("w1", ["demo@1"], LEASE, 1)
    assert await store.worker.release_lease("r1", c.lease_id, c.fencing_token) is None
    run = run_row(admin_conn, "r1")
    assert (run["status"], run["lease_id"]) == ("queued", None)
    [released] = events(admin_conn, "r1", "lease_released")
    assert (released["fencing_token"], released["detail"]) == (c.fencing_token, {})


async def test_release_lease_with_a_reason_keeps_the_stall_count_and_says_why(
    store: Any, admin_conn: Conn
) -> None:
    await store.worker.submit_run("r1", "demo", "1", {})
    [(c, _)] = await store.worker.claim_runs("w1", ["demo@1"], LEASE, 1)
    error = {"type": "RuntimeError", "message": "boom"}
    await store.worker.release_lease(
        "r1", c.lease_id, c.fencing_token, reason="worker_error", error=error
    )
    run = run_row(admin_conn, "r1")
    assert (run["status"], run["lease_id"], run["stalled_claims"]) == ("queued", None, 1)
    [released] = events(admin_conn, "r1", "lease_released")
    assert released["detail"] == {"reason": "worker_error", "error": error}
    with unchanged(admin_conn), pytest.raises(errors.LeaseLost):  # the lease is gone now
        await store.worker.release_lease("r1", c.lease_id, c.fencing_token, reason="again")


@pytest.mark.parametrize(
    ("reason", "error", "message"),
    [
        ("", None, "reason must be 1-200 characters, got 0"),
        ("x" * 201, None, "reason must be 1-200 characters, got 201"),
        ("a\x00b", None, "reason contains a NUL character"),
        (7, None, "reason must be a string, got int"),
        ("draining", ["not", "an", "object"], "error must be a JSON object, got list"),
        ("draining", {"bad": "\x00"}, "error contains a NUL character at .bad"),
        (None, {"type": "Boom"}, "a release with an error needs a reason"),
    ],
)
async def test_release_lease_checks_reason_and_error_before_sending(
    store: Any, admin_conn: Conn, reason: Any, error: Any, message: str
) -> None:
    await store.worker.submit_run("r1", "demo", "1", {})
    [(c, _)] = await store.worker.claim_runs("w1", ["demo@1"], LEASE, 1)
    with unchanged(admin_conn), pytest.raises(errors.InvalidInput) as info:
        await store.worker.release_lease(
            "r1", c.lease_id, c.fencing_token, reason=reason, error=error
        )
    assert info.value.message == message
