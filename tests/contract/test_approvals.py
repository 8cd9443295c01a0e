"""Human approval: record_turn_v2's "approval", dispatch_call's refusal, approve_call and
deny_call, the requeue they share with resolve_call, and the wall around a decision.

Called as a worker (``runledger_worker``) and an operator (``runledger_operator``) would;
the direct writes of the wall run as the superuser the tests connect as (the triggers
fire for every role).
"""

from __future__ import annotations

from typing import Any

import psycopg
import pytest

from .helpers import approve as approve_call
from .helpers import (
    call,
    call_row,
    claim,
    complete,
    dispatch,
    events,
    finish,
    key,
    paused_awaiting_approval,
    paused_on_unknown,
    record_v2,
    refused,
    resolve,
    retry,
    run_row,
    submit_and_claim,
)
from .helpers import cancel as cancel_run
from .helpers import deny as deny_call

Conn = psycopg.Connection[Any]


# -- record_turn_v2 and dispatch_call ----------------------------------------------------


def test_a_call_recorded_with_approval_is_pending_and_the_others_are_not(worker: Conn) -> None:
    lease = submit_and_claim(worker)
    calls = [
        {**call("c1"), "approval": True},
        {**call("c2"), "approval": False},
        call("c3"),
    ]
    record_v2(worker, lease, 0, calls)
    got = [call_row(worker, key("r1", 0, c))["approval"] for c in ("c1", "c2", "c3")]
    assert got == ["pending", None, None]
    row = call_row(worker, key("r1", 0, "c1"))
    assert (row["status"], row["approval_by"], row["approval_at"], row["approval_note"]) == (
        "planned",
        None,
        None,
        None,
    )
    # the turn's calls are kept as sent; the same decision again is a no-op
    record_v2(worker, lease, 0, calls)
    assert len(events(worker, "r1", "turn_recorded")) == 1


@pytest.mark.parametrize("value", ["yes", 1, None, {}, [True], "true"])
def test_approval_must_be_a_json_boolean(worker: Conn, admin_conn: Conn, value: Any) -> None:
    lease = submit_and_claim(worker)
    with refused(admin_conn, "RL006", value) as caught:
        record_v2(worker, lease, 0, [call("c0"), {**call("c1"), "approval": value}])
    assert "approval of call c1" in str(caught.value)


def test_dispatch_refuses_a_call_awaiting_approval(worker: Conn, admin_conn: Conn) -> None:
    lease = submit_and_claim(worker)
    record_v2(worker, lease, 0, [{**call("c1"), "approval": True}])
    k = key("r1", 0, "c1")
    with refused(admin_conn, "RL004") as caught:
        dispatch(worker, lease, k)
    assert caught.value.diag.message_primary == f"call {k} awaits approval and cannot be dispatched"
    assert f"runledger approve {k}" in (caught.value.diag.message_hint or "")
    assert f"runledger deny {k}" in (caught.value.diag.message_hint or "")
    # nor can the run succeed or the next turn be recorded past it
    with refused(admin_conn, "RL004"):
        finish(worker, lease, "succeeded")
    with refused(admin_conn, "RL004"):
        record_v2(worker, lease, 1, [])


# -- approve_call -----------------------------------------------------------------------


def test_approve_lets_the_call_be_dispatched_and_requeues_the_paused_run(
    worker: Conn, operator: Conn
) -> None:
    lease = submit_and_claim(worker)
    [k] = paused_awaiting_approval(worker, lease)
    approve_call(operator, k, actor="alice", note="checked the amount")

    row = call_row(worker, k)
    assert (row["status"], row["approval"], row["approval_by"], row["approval_note"]) == (
        "planned",
        "approved",
        "alice",
        "checked the amount",
    )
    assert row["approval_at"] is not None and row["attempts"] == 0
    [approved] = events(worker, "r1", "call_approved")
    assert approved["actor"] == "alice" and approved["fencing_token"] is None
    assert approved["detail"] == {
        "idempotency_key": k,
        "tool": "create_ticket",
        "note": "checked the amount",
    }
    run = run_row(worker, "r1")
    assert (run["status"], run["pause_reason"]) == ("queued", None)
    [requeued] = events(worker, "r1", "run_requeued")
    assert requeued["actor"] == "alice" and requeued["detail"] == {"after": "approve_call"}
    assert requeued["event_id"] > approved["event_id"]

    # the next holder dispatches it like any call
    [again] = claim(worker)
    assert dispatch(worker, again, k) == 1
    complete(worker, again, k, "succeeded", {"ok": True})
    finish(worker, again, "succeeded")
    assert call_row(worker, k)["approval"] == "approved"


def test_approve_without_a_note_leaves_it_out_of_the_event(worker: Conn, operator: Conn) -> None:
    lease = submit_and_claim(worker)
    [k] = paused_awaiting_approval(worker, lease)
    approve_call(operator, k, note=None)
    [approved] = events(worker, "r1", "call_approved")
    assert approved["detail"] == {"idempotency_key": k, "tool": "create_ticket"}
    assert call_row(worker, k)["approval_note"] is None


# -- deny_call -------------------------------------------------------------------------


def test_deny_fails_the_call_unsent_and_requeues_the_run(
    worker: Conn, operator: Conn, admin_conn: Conn
) -> None:
    lease = submit_and_claim(worker)
    [k] = paused_awaiting_approval(worker, lease)
    deny_call(operator, k, reason="not this customer", actor="bob")

    row = call_row(worker, k)
    assert (row["status"], row["approval"], row["approval_by"], row["approval_note"]) == (
        "failed",
        "denied",
        "bob",
        "not this customer",
    )
    assert row["error"] == {"reason": "denied", "note": "not this customer", "actor": "bob"}
    assert (row["attempts"], row["dispatched_at"], row["completed_at"]) == (0, None, None)
    [denied] = events(worker, "r1", "call_denied")
    assert denied["actor"] == "bob"
    assert denied["detail"] == {
        "idempotency_key": k,
        "tool": "create_ticket",
        "reason": "not this customer",
    }
    assert [e["detail"] for e in events(worker, "r1", "run_requeued")] == [{"after": "deny_call"}]
    assert not events(worker, "r1", "call_dispatched")

    # never sent: the next holder cannot dispatch it, and the policy decides the next turn
    [again] = claim(worker)
    with refused(admin_conn, "RL004"):
        dispatch(worker, again, k)
    record_v2(worker, again, 1, [])
    finish(worker, again, "succeeded")


# -- refusals --------------------------------------------------------------------------


def test_a_decision_is_made_once(worker: Conn, operator: Conn, admin_conn: Conn) -> None:
    lease = submit_and_claim(worker)
    k1, k2 = paused_awaiting_approval(worker, lease, ("c1", "c2"))
    approve_call(operator, k1)
    deny_call(operator, k2)
    for decide in (approve_call, deny_call):
        for k, was in ((k1, "approved"), (k2, "denied")):
            with refused(admin_conn, "RL004", (decide.__name__, k)) as caught:
                decide(operator, k)
            assert "does not await approval" in str(caught.value)
            assert f"{was} by alice" in (caught.value.diag.message_detail or "")


def test_calls_that_need_no_approval_are_not_decided(
    worker: Conn, operator: Conn, admin_conn: Conn
) -> None:
    lease = submit_and_claim(worker)
    [k] = paused_on_unknown(worker, lease)  # unknown, no approval
    for decide in (approve_call, deny_call):
        with refused(admin_conn, "RL004", decide.__name__) as caught:
            decide(operator, k)
        assert "it is unknown, approval not needed" in str(caught.value)


def test_unknown_keys_are_rl003(operator: Conn, admin_conn: Conn) -> None:
    for decide in (approve_call, deny_call):
        with refused(admin_conn, "RL003", decide.__name__):
            decide(operator, "nope:0:c1")


@pytest.mark.parametrize(
    "case,args",
    [
        ("actor NULL", {"actor": None}),
        ("actor empty", {"actor": ""}),
        ("actor over 200", {"actor": "a" * 201}),
        ("key empty", {"k": ""}),
        ("key NULL", {"k": None}),
        ("key over 300", {"k": "k" * 301}),
    ],
)
def test_bad_arguments_are_rl006(
    worker: Conn, operator: Conn, admin_conn: Conn, case: str, args: dict[str, Any]
) -> None:
    lease = submit_and_claim(worker)
    [k] = paused_awaiting_approval(worker, lease)
    target = args.get("k", k)
    actor = args.get("actor", "alice")
    with refused(admin_conn, "RL006", ("approve", case)):
        approve_call(operator, target, actor=actor)
    with refused(admin_conn, "RL006", ("deny", case)):
        deny_call(operator, target, actor=actor)


def test_a_note_and_a_reason_are_bounded_and_a_denial_needs_a_reason(
    worker: Conn, operator: Conn, admin_conn: Conn
) -> None:
    lease = submit_and_claim(worker)
    [k] = paused_awaiting_approval(worker, lease)
    with refused(admin_conn, "RL006", "note over 4000"):
        approve_call(operator, k, note="n" * 4001)
    for case, reason in (("NULL", None), ("empty", ""), ("over 1000", "r" * 1001)):
        with refused(admin_conn, "RL006", f"reason {case}"):
            deny_call(operator, k, reason=reason)
    approve_call(operator, k, note="n" * 4000)  # at the caps: accepted
    assert call_row(worker, k)["approval_note"] == "n" * 4000


def test_calls_of_a_running_run_are_not_decided(
    worker: Conn, operator: Conn, admin_conn: Conn
) -> None:
    """Its holder may be pausing on the call right now: an approval it did not see would
    leave the run paused with nothing to wait for."""
    lease = submit_and_claim(worker)
    record_v2(worker, lease, 0, [{**call("c1"), "approval": True}])
    k = key("r1", 0, "c1")
    for decide in (approve_call, deny_call):
        with refused(admin_conn, "RL004", decide.__name__) as caught:
            decide(operator, k)
        assert "is of a running run" in str(caught.value)
        assert "runledger status r1" in (caught.value.diag.message_hint or "")


def test_calls_of_queued_cancelled_and_failed_runs_are_decided_without_a_requeue(
    worker: Conn, operator: Conn
) -> None:
    # cancelled: the ledger is corrected, the run stays as it is
    lease = submit_and_claim(worker, "x")
    [kx] = paused_awaiting_approval(worker, lease)
    cancel_run(operator, "x")
    deny_call(operator, kx)
    # failed with a call that was never sent
    lease = submit_and_claim(worker, "f")
    record_v2(worker, lease, 0, [{**call("c1"), "approval": True}])
    finish(worker, lease, "failed", reason="policy_error")
    deny_call(operator, key("f", 0, "c1"))
    # queued (a paused run retried): the next holder sees the decision
    lease = submit_and_claim(worker, "q")
    [kq] = paused_awaiting_approval(worker, lease)
    retry(operator, "q")
    approve_call(operator, kq)

    assert [run_row(worker, r)["status"] for r in ("q", "x", "f")] == [
        "queued",
        "cancelled",
        "failed",
    ]
    assert call_row(worker, kq)["approval"] == "approved"
    assert call_row(worker, kx)["status"] == "failed"
    for run_id, after in (("q", ["retry_run"]), ("x", []), ("f", [])):
        got = [e["detail"]["after"] for e in events(worker, run_id, "run_requeued")]
        assert got == after, run_id


# -- the requeue waits for every call a person must settle -------------------------------


def test_a_paused_run_is_requeued_only_when_no_call_awaits_anyone(
    worker: Conn, operator: Conn
) -> None:
    lease = submit_and_claim(worker)
    k1, k2, k3 = paused_awaiting_approval(worker, lease, ("c1", "c2", "c3"))
    approve_call(operator, k1)
    assert run_row(worker, "r1")["status"] == "paused"
    deny_call(operator, k2)
    assert run_row(worker, "r1")["status"] == "paused"
    assert not events(worker, "r1", "run_requeued")
    approve_call(operator, k3, actor="carol")
    assert run_row(worker, "r1")["status"] == "queued"
    [requeued] = events(worker, "r1", "run_requeued")
    assert (requeued["actor"], requeued["detail"]) == ("carol", {"after": "approve_call"})


def _unknown_beside_pending(worker: Conn) -> tuple[str, str]:
    """A paused run whose turn has an unknown call and a call awaiting approval (a
    parallel group: the sibling ran, then the run paused)."""
    lease = submit_and_claim(worker)
    record_v2(worker, lease, 0, [call("c1"), {**call("c2"), "approval": True}])
    unknown, pending = key("r1", 0, "c1"), key("r1", 0, "c2")
    dispatch(worker, lease, unknown)
    complete(worker, lease, unknown, "unknown", {"error": "timeout"})
    finish(worker, lease, "paused", reason="unknown and awaiting approval")
    return unknown, pending


def test_resolving_the_last_unknown_call_waits_for_the_approval(
    worker: Conn, operator: Conn
) -> None:
    unknown, pending = _unknown_beside_pending(worker)
    resolve(operator, unknown, "applied", {"id": 1})
    assert run_row(worker, "r1")["status"] == "paused"
    assert not events(worker, "r1", "run_requeued")
    approve_call(operator, pending)
    assert run_row(worker, "r1")["status"] == "queued"
    assert [e["detail"] for e in events(worker, "r1", "run_requeued")] == [
        {"after": "approve_call"}
    ]


def test_deciding_the_approval_waits_for_the_unknown_call(worker: Conn, operator: Conn) -> None:
    unknown, pending = _unknown_beside_pending(worker)
    deny_call(operator, pending)
    assert run_row(worker, "r1")["status"] == "paused"
    resolve(operator, unknown, "abandoned")
    assert run_row(worker, "r1")["status"] == "queued"
    assert [e["detail"] for e in events(worker, "r1", "run_requeued")] == [
        {"after": "resolve_call"}
    ]


# -- the wall ---------------------------------------------------------------------------

WALL_CASES = {
    "pending to none": ("pending", "approval = NULL"),
    "none to pending": (None, "approval = 'pending'"),
    "approved back to pending": (
        "approved",
        "approval = 'pending', approval_by = NULL, approval_at = NULL, approval_note = NULL",
    ),
    "approved to denied": ("approved", "approval = 'denied', status = 'failed'"),
    "denied to approved": ("denied", "approval = 'approved', status = 'planned'"),
    "who approved": ("approved", "approval_by = 'mallory'"),
    "when it was approved": ("approved", "approval_at = approval_at - interval '1 day'"),
    "why it was denied": ("denied", "approval_note = 'fine after all'"),
    "why it was approved": ("approved", "approval_note = NULL"),
}


@pytest.fixture
def three_calls(worker: Conn, operator: Conn) -> dict[str | None, str]:
    """Paused run r1 with a call of each approval: none (unknown), approved, denied; and
    run r2 with a pending call."""
    lease = submit_and_claim(worker)
    record_v2(
        worker,
        lease,
        0,
        [call("c0"), {**call("c1"), "approval": True}, {**call("c2"), "approval": True}],
    )
    dispatch(worker, lease, key("r1", 0, "c0"))
    complete(worker, lease, key("r1", 0, "c0"), "unknown", {"error": "timeout"})
    finish(worker, lease, "paused", reason="x")
    approve_call(operator, key("r1", 0, "c1"), note="ok")
    deny_call(operator, key("r1", 0, "c2"))
    other = submit_and_claim(worker, "r2")
    [pending] = paused_awaiting_approval(worker, other)
    return {
        None: key("r1", 0, "c0"),
        "approved": key("r1", 0, "c1"),
        "denied": key("r1", 0, "c2"),
        "pending": pending,
    }


@pytest.mark.parametrize("case", list(WALL_CASES))
def test_the_wall_keeps_a_decision_from_moving_or_changing(
    admin_conn: Conn, three_calls: dict[str | None, str], case: str
) -> None:
    approval, assignment = WALL_CASES[case]
    target = three_calls[approval]
    with refused(admin_conn, "RL007", case) as caught:
        admin_conn.execute(
            f"UPDATE runledger.run_calls SET {assignment} WHERE idempotency_key = %s",  # type: ignore[arg-type]
            (target,),
        )
    assert target in str(caught.value)


def test_the_constraints_tie_an_approval_to_its_call(
    admin_conn: Conn, three_calls: dict[str | None, str]
) -> None:
    """What the wall lets through (a pending call decided by hand) still has to be a
    whole decision, and a pending call is never in flight."""
    pending = three_calls["pending"]
    for case, assignment, constraint in (
        ("approved by nobody", "approval = 'approved'", "ck_run_calls_approval_decided"),
        ("pending and dispatched", "status = 'dispatched'", "ck_run_calls_approval_status"),
        (
            "denied yet planned",
            "approval = 'denied', approval_by = 'x', approval_at = now()",
            "ck_run_calls_approval_status",
        ),
    ):
        with refused(admin_conn, "23514", case) as caught:
            admin_conn.execute(
                f"UPDATE runledger.run_calls SET {assignment} WHERE idempotency_key = %s",  # type: ignore[arg-type]
                (pending,),
            )
        assert constraint in str(caught.value), case
    with refused(admin_conn, "23514", "a word outside the list") as caught:
        admin_conn.execute(
            "INSERT INTO runledger.run_calls (run_id, turn, call_id, position, tool, args, "
            "idempotency_key, approval) VALUES ('r2', 0, 'm1', 5, 't', '{}', 'r2:0:m1', 'maybe')"
        )
    assert "ck_run_calls_approval" in str(caught.value)
    # the whole decision, written by hand, is what approve_call would write
    admin_conn.execute(
        "UPDATE runledger.run_calls SET approval = 'approved', approval_by = 'dba', "
        "approval_at = now() WHERE idempotency_key = %s",
        (pending,),
    )
    assert call_row(admin_conn, pending)["approval"] == "approved"


def test_worker_role_cannot_approve_or_deny(worker: Conn, admin_conn: Conn) -> None:
    lease = submit_and_claim(worker)
    [k] = paused_awaiting_approval(worker, lease)
    for decide in (approve_call, deny_call):
        with refused(admin_conn, "42501", decide.__name__) as caught:
            decide(worker, k)
        assert "permission denied for function" in str(caught.value)
