"""A call that may have taken effect always stays reconcilable, and a certain "no" is
never left looking like "maybe"."""

from __future__ import annotations

from typing import Any

import psycopg

from .helpers import (
    call_row,
    cancel,
    claim,
    complete,
    dispatch,
    dispatched_call,
    events,
    finish,
    refused,
    release,
    resolve,
    run_row,
    submit_and_claim,
)

Conn = psycopg.Connection[Any]


def test_not_applied_puts_the_call_back_to_planned(worker: Conn, admin_conn: Conn) -> None:
    lease = submit_and_claim(worker)
    k = dispatched_call(worker, lease)

    complete(worker, lease, k, "not_applied", {"reason": "rate limited"})

    row = call_row(admin_conn, k)
    assert (row["status"], row["attempts"], row["completed_token"]) == ("planned", 1, None)
    assert row["error"] == {"reason": "rate limited"}
    assert [e["kind"] for e in events(admin_conn, "r1")][-1] == "call_not_applied"
    assert dispatch(worker, lease, k) == 2  # sent again with the same key
    complete(worker, lease, k, "succeeded", {"ok": True})
    assert call_row(admin_conn, k)["error"] is None


def test_cancel_turns_a_call_in_flight_into_unknown_and_it_can_be_resolved(
    worker: Conn, operator: Conn, admin_conn: Conn
) -> None:
    lease = submit_and_claim(worker)
    k = dispatched_call(worker, lease)

    cancel(operator, "r1", reason="customer withdrew")

    row = call_row(admin_conn, k)
    assert (row["status"], row["error"]) == ("unknown", {"reason": "cancelled while in flight"})
    resolve(operator, k, "not_applied", note="provider has no record")
    assert call_row(admin_conn, k)["status"] == "planned"
    run = run_row(admin_conn, "r1")
    assert run["status"] == "cancelled"  # resolving a cancelled run's call does not revive it
    assert [e["kind"] for e in events(admin_conn, "r1")][-1] == "call_resolved"


def test_a_run_with_a_call_in_flight_cannot_fail(worker: Conn, admin_conn: Conn) -> None:
    lease = submit_and_claim(worker)
    k = dispatched_call(worker, lease)
    complete(worker, lease, k, "unknown", {"error": "timeout"})

    with refused(admin_conn, "RL004") as info:
        finish(worker, lease, "failed", reason="giving up")
    assert "in flight or unknown" in info.value.diag.message_primary


def test_releasing_a_run_does_not_count_as_a_stalled_claim(worker: Conn, admin_conn: Conn) -> None:
    lease = submit_and_claim(worker)
    assert run_row(admin_conn, "r1")["stalled_claims"] == 1
    release(worker, lease)
    assert run_row(admin_conn, "r1")["stalled_claims"] == 0
    [again] = claim(worker, "w2")
    assert (again.token, run_row(admin_conn, "r1")["claims"]) == (2, 2)
