"""release_lease(p_run_id, p_lease_id, p_fencing_token, p_reason, p_error): a hand-back
after a worker error. Back to queued without a lease like the 3-argument release, but the
claim's stalled count stays (so a run that keeps hitting a worker bug still ends up as a
crash loop), and the event says why."""

from __future__ import annotations

import select
import uuid
from dataclasses import replace
from typing import Any

import psycopg
import pytest
from psycopg.types.json import Jsonb

from runledger.testing import DbClock

from .helpers import (
    LEASE_SECONDS,
    Conn,
    Lease,
    claim,
    events,
    refused,
    release,
    run_row,
    sqlstate,
    submit_and_claim,
)


def release_with(conn: Conn, lease: Lease, reason: Any, error: Any = None) -> None:
    conn.execute(
        "SELECT runledger.release_lease(%s, %s, %s, %s, %s)",
        (
            lease.run_id,
            lease.lease_id,
            lease.token,
            reason,
            None if error is None else Jsonb(error),
        ),
    )


def test_a_live_lease_goes_back_to_queued_with_the_reason_in_its_event(
    worker: Conn, worker2: Conn, admin_conn: Conn
) -> None:
    lease = submit_and_claim(worker)
    before = run_row(admin_conn, "r1")

    release_with(worker, lease, "executor crashed", {"type": "KeyError", "message": "'x'"})

    run = run_row(admin_conn, "r1")
    assert run["status"] == "queued"
    assert (run["lease_id"], run["lease_expires_at"], run["lease_owner"]) == (None, None, None)
    assert run["fencing_token"] == lease.token
    assert run["available_at"] <= run["updated_at"]
    assert run["claims"] == before["claims"] == 1
    [ev] = events(admin_conn, "r1", "lease_released")
    assert ev["detail"] == {
        "reason": "executor crashed",
        "error": {"type": "KeyError", "message": "'x'"},
    }
    assert (ev["actor"], ev["fencing_token"]) == ("w1", lease.token)
    assert ev["state_version"] == before["state_version"]

    [again] = claim(worker2, "w2")
    assert (again.run_id, again.token, again.takeover) == ("r1", lease.token + 1, False)


def test_a_null_error_is_recorded_as_null(worker: Conn, admin_conn: Conn) -> None:
    lease = submit_and_claim(worker)
    release_with(worker, lease, "shutting down after an error")
    [ev] = events(admin_conn, "r1", "lease_released")
    assert ev["detail"] == {"reason": "shutting down after an error", "error": None}


def test_stalled_claims_are_kept_claim_after_claim(worker: Conn, admin_conn: Conn) -> None:
    lease = submit_and_claim(worker)
    assert run_row(admin_conn, "r1")["stalled_claims"] == 1

    release_with(worker, lease, "worker error", {"message": "boom"})
    assert run_row(admin_conn, "r1")["stalled_claims"] == 1

    # Claimed and released with an error again: the count grows toward crash_loop.
    [again] = claim(worker, "w1")
    release_with(worker, again, "worker error", {"message": "boom"})
    run = run_row(admin_conn, "r1")
    assert (run["stalled_claims"], run["claims"]) == (2, 2)


def test_the_3_argument_release_still_undoes_its_stalled_claim(
    worker: Conn, admin_conn: Conn
) -> None:
    lease = submit_and_claim(worker)
    release(worker, lease)
    run = run_row(admin_conn, "r1")
    assert (run["status"], run["stalled_claims"]) == ("queued", 0)
    [ev] = events(admin_conn, "r1", "lease_released")
    assert ev["detail"] == {}


def test_it_notifies_the_claimers(worker: Conn, database_url: str) -> None:
    lease = submit_and_claim(worker)
    with psycopg.connect(database_url, autocommit=True) as listener:
        listener.execute("LISTEN runledger_runs")
        release_with(worker, lease, "worker error")
        ready, _, _ = select.select([listener.fileno()], [], [], 10)
        assert ready, "no notification within 10 s"
        got = [(n.channel, n.payload) for n in listener.notifies(timeout=1, stop_after=1)]
    assert got == [("runledger_runs", "demo@1")]


# -- refusals ---------------------------------------------------------------------------------


def test_a_stale_token_is_refused_with_rl001_and_nothing_written(
    worker: Conn, worker2: Conn, admin_conn: Conn
) -> None:
    lease = submit_and_claim(worker)
    release_with(worker, lease, "first")
    [newer] = claim(worker2, "w2")

    with refused(admin_conn, "RL001"):
        release_with(worker, lease, "stale worker error")
    with refused(admin_conn, "RL001"):
        release_with(worker, replace(newer, lease_id=uuid.uuid4()), "right token, wrong lease")
    with refused(admin_conn, "RL003"):
        release_with(worker, replace(newer, run_id="missing"), "no such run")
    assert run_row(admin_conn, "r1")["lease_owner"] == "w2"


def test_an_expired_lease_is_refused_with_rl001(
    worker: Conn, admin_conn: Conn, db_clock: DbClock
) -> None:
    lease = submit_and_claim(worker)
    db_clock.advance(LEASE_SECONDS + 1)
    with refused(admin_conn, "RL001") as info:
        release_with(worker, lease, "too late")
    assert "expired" in (info.value.diag.message_primary or "")


@pytest.mark.parametrize(
    ("reason", "error"),
    [
        (None, None),
        ("", None),
        ("x" * 201, None),
        ("ok", ["not", "an", "object"]),
        ("ok", "a string"),
        ("ok", 42),
    ],
    ids=["null reason", "empty reason", "201 chars", "error array", "error string", "error number"],
)
def test_bad_reason_or_error_is_rl006_and_nothing_written(
    worker: Conn, admin_conn: Conn, reason: Any, error: Any
) -> None:
    lease = submit_and_claim(worker)
    with refused(admin_conn, "RL006", (reason, error)):
        release_with(worker, lease, reason, error)
    assert run_row(admin_conn, "r1")["status"] == "running"


def test_reason_of_200_characters_is_accepted(worker: Conn, admin_conn: Conn) -> None:
    lease = submit_and_claim(worker)
    release_with(worker, lease, "x" * 200)
    assert run_row(admin_conn, "r1")["status"] == "queued"


def test_an_oversized_error_is_rl006(worker: Conn, admin_conn: Conn) -> None:
    admin_conn.execute("UPDATE runledger.settings SET max_payload_bytes = 1024")
    lease = submit_and_claim(worker)
    with refused(admin_conn, "RL006") as info:
        release_with(worker, lease, "worker error", {"trace": "x" * 2000})
    assert "over the cap" in (info.value.diag.message_primary or "")


def test_granted_like_the_3_argument_release(
    worker: Conn, operator: Conn, auditor: Conn, admin_conn: Conn
) -> None:
    """Granted like the 3-argument release: to the worker role (and so to the operator,
    a member of it), never to the auditor."""
    lease = submit_and_claim(worker)
    with sqlstate("42501"):
        release_with(auditor, lease, "not mine")
    assert run_row(admin_conn, "r1")["status"] == "running"
    release_with(operator, lease, "operator hand-back")
    assert run_row(admin_conn, "r1")["status"] == "queued"
