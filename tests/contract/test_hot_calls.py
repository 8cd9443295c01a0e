"""Revision 0019, the per-call SQL made cheaper with the same contract, called as a worker
would: one clock reading per write (the lease check's), a call's dispatch and completion
as one UPDATE (the checks of _lock_call only to refuse), and the JSON depth walk skipped
only where it cannot refuse."""

from __future__ import annotations

from typing import Any

import pytest
from psycopg.types.json import Jsonb

from .helpers import (
    Lease,
    call,
    call_row,
    checkpoint,
    complete,
    dispatch,
    events,
    finish,
    key,
    record_turn,
    refused,
    run_row,
    scalar,
    submit,
    submit_and_claim,
)
from .test_fast_path import complete_v2, two_calls

Conn = Any


def _planned(worker: Conn, *call_ids: str) -> tuple[Lease, list[str]]:
    lease = submit_and_claim(worker)
    record_turn(worker, lease, 0, [call(c) for c in call_ids])
    return lease, [key("r1", 0, c) for c in call_ids]


# -- one clock reading per write -------------------------------------------------------------


def test_a_completion_and_its_event_carry_the_lease_checks_clock(
    worker: Conn, admin_conn: Conn
) -> None:
    lease, (first,) = _planned(worker, "c1")
    dispatch(worker, lease, first)
    complete(worker, lease, first, "succeeded", {"ok": 1}, {"id": 1})
    [done] = events(admin_conn, "r1", "call_succeeded")
    assert done["at"] == call_row(admin_conn, first)["completed_at"]


def test_a_checkpoint_and_its_event_carry_one_clock_reading(worker: Conn, admin_conn: Conn) -> None:
    lease = submit_and_claim(worker)
    assert checkpoint(worker, lease, 0, {"step": 1}) == 1
    [made] = events(admin_conn, "r1", "checkpoint")
    assert made["at"] == run_row(admin_conn, "r1")["updated_at"]


@pytest.mark.parametrize(
    ("status", "kind"), [("succeeded", "run_succeeded"), ("paused", "run_paused")]
)
def test_the_end_of_a_run_and_its_event_carry_one_clock_reading(
    worker: Conn, admin_conn: Conn, status: str, kind: str
) -> None:
    lease = submit_and_claim(worker)
    finish(worker, lease, status, None, reason="done")
    [ended] = events(admin_conn, "r1", kind)
    assert ended["at"] == run_row(admin_conn, "r1")["updated_at"]


# -- dispatch and completion in one UPDATE ---------------------------------------------------


def test_a_dispatch_names_the_status_before_it_and_counts_attempts(
    worker: Conn, admin_conn: Conn
) -> None:
    """The event's previous_status and attempt are those of the row before the UPDATE: a
    call sent again after not_applied comes from planned, one sent again while in flight
    (a worker that crashed after its dispatch) from dispatched."""
    lease, (first,) = _planned(worker, "c1")
    assert dispatch(worker, lease, first) == 1
    assert dispatch(worker, lease, first) == 2  # in flight: sent again
    complete(worker, lease, first, "not_applied", {"why": "refused"})
    assert call_row(admin_conn, first)["status"] == "planned"
    assert dispatch(worker, lease, first) == 3
    sent = events(admin_conn, "r1", "call_dispatched")
    assert [(e["detail"]["attempt"], e["detail"]["previous_status"]) for e in sent] == [
        (1, "planned"),
        (2, "dispatched"),
        (3, "planned"),
    ]
    assert all(e["detail"]["tool"] == "create_ticket" for e in sent)
    row = call_row(admin_conn, first)
    assert (row["status"], row["attempts"], row["dispatched_token"]) == ("dispatched", 3, 1)
    assert row["dispatched_at"] == sent[-1]["at"]
    [gone] = events(admin_conn, "r1", "call_not_applied")
    assert gone["detail"] == {"idempotency_key": first, "tool": "create_ticket", "attempt": 2}


def test_a_refused_dispatch_or_completion_writes_nothing_and_says_why(
    worker: Conn, admin_conn: Conn
) -> None:
    """No row matched the one UPDATE: the slow path names the reason, as before."""
    lease, (first, second) = _planned(worker, "c1", "c2")
    other = submit_and_claim(worker, "r2")
    record_turn(worker, other, 0, [call("c1")])
    cases: list[tuple[str, str, Any]] = [
        ("RL006", "idempotency key", lambda: dispatch(worker, lease, "")),
        ("RL006", "idempotency key", lambda: complete(worker, lease, "k" * 301)),
        ("RL003", "not found in run r1", lambda: dispatch(worker, lease, key("r2", 0, "c1"))),
        ("RL003", "not found in run r1", lambda: complete(worker, lease, key("r2", 0, "c1"))),
        ("RL004", "is planned, not dispatched", lambda: complete(worker, lease, first)),
        ("RL004", "is planned, not dispatched", lambda: complete_v2(worker, lease, first)),
    ]
    for code, says, write in cases:
        with refused(admin_conn, code) as info:
            write()
        assert says in (info.value.diag.message_primary or ""), says
    dispatch(worker, lease, first)
    complete(worker, lease, first, "succeeded", {"ok": 1})
    with refused(admin_conn, "RL004") as info:
        dispatch(worker, lease, first)
    assert info.value.diag.message_primary == f"call {first} is succeeded and cannot be dispatched"
    assert info.value.diag.message_detail == "attempts 1, last token 1"
    with refused(admin_conn, "RL004"):
        complete_v2(worker, lease, first, next_key=second)  # the call's refusal comes first


def test_a_completion_refused_for_its_next_call_writes_nothing(
    worker: Conn, admin_conn: Conn
) -> None:
    lease, first, second = two_calls(worker)
    with refused(admin_conn, "RL006") as info:
        complete_v2(worker, lease, first, "unknown", next_key=second)
    assert "only after a final outcome, not unknown" in (info.value.diag.message_primary or "")
    with refused(admin_conn, "RL006") as info:
        complete_v2(worker, lease, first, next_key=first)
    assert info.value.diag.message_primary == f"call {first} cannot be its own next call"
    with refused(admin_conn, "RL003"):  # the call is written, then the next one refused
        complete_v2(worker, lease, first, next_key=key("r1", 0, "nope"))
    assert call_row(admin_conn, first)["status"] == "dispatched"


# -- the JSON depth check --------------------------------------------------------------------


def _nest(depth: int) -> Any:
    value: Any = "x"
    for _ in range(depth):
        value = {"k": value}
    return value


def test_the_depth_walk_is_skipped_only_where_it_cannot_refuse(
    worker: Conn, admin_conn: Conn
) -> None:
    """A text with at most max_json_depth opening brackets cannot be too deep, however
    long or however many brackets its strings have; one more level is still refused."""
    admin_conn.execute("UPDATE runledger.settings SET max_json_depth = 3")
    lease, keys = _planned(worker, "c1", "c2", "c3", "c4")
    long_flat = {"text": "y" * 500, "braces": "{[{[{[" * 20}
    for k, result in zip(
        keys[:3], (_nest(3), long_flat, {"a": _nest(2), "s": "{[" * 50}), strict=True
    ):
        dispatch(worker, lease, k)
        complete(worker, lease, k, "succeeded", result)
        assert call_row(admin_conn, k)["result"] == result
    dispatch(worker, lease, keys[3])
    for deep in (_nest(4), {"s": "{" * 100, "a": _nest(3)}):
        with refused(admin_conn, "RL006") as info:
            complete(worker, lease, keys[3], "succeeded", deep)
        assert info.value.diag.message_primary == "result nests deeper than 3 levels"
    with refused(admin_conn, "RL006") as info:
        submit(worker, "deep", {"a": [[[1]]]})
    assert info.value.diag.message_primary == "input nests deeper than 3 levels"
    assert scalar(admin_conn, "SELECT count(*) FROM runledger.runs WHERE run_id = 'deep'") == 0
    worker.execute(
        "SELECT runledger.complete_call_v2(%s, %s, %s, %s, 'succeeded', %s, %s, NULL)",
        (lease.run_id, lease.lease_id, lease.token, keys[3], Jsonb(_nest(1)), Jsonb({"id": 1})),
    )
    assert call_row(admin_conn, keys[3])["receipt"] == {"id": 1}
