"""The guards of runs and run_calls since revision 0007: not called for the functions' own
writes (WHEN clauses, an UPDATE OF trigger, a DELETE trigger), and when called, the same
refusal as before.

test_wall.py holds the invariants; this file adds the checks it does not reach one by one,
the order of the checks when one UPDATE breaks several, and that the functions' own
writes no longer call the guards at all.
"""

from __future__ import annotations

from typing import Any

import psycopg
import pytest

from .helpers import (
    call_row,
    checkpoint,
    complete,
    dispatched_call,
    finish,
    refused,
    run_row,
    scalar,
    submit_and_claim,
)

Conn = psycopg.Connection[Any]


def _journal(worker: Conn) -> None:
    """Run r1 with fencing_token 1, state_version 1 and a succeeded call r1:0:c1."""
    lease = submit_and_claim(worker)
    checkpoint(worker, lease, 0, {"step": 1})
    k = dispatched_call(worker, lease)
    complete(worker, lease, k, "succeeded", {"ticket": 1}, {"provider_id": "T-1"})


IMMUTABLE = "call r1:0:c1: key, tool, args and provider id are immutable"
PINNED = "flow, version and input of run r1 are pinned"

# statement -> the message of the refusal: the guard's first failing check, in its order
REFUSED = {
    "pinned flow": ("UPDATE runledger.runs SET flow = 'other'", PINNED),
    "pinned input": (
        "UPDATE runledger.runs SET input = '{\"n\": 2}'",
        PINNED,
    ),
    "state without a bump": (
        "UPDATE runledger.runs SET state = '{\"forged\": 1}'",
        "a change of state on run r1 must bump state_version by exactly one",
    ),
    "token and input: the token comes first": (
        "UPDATE runledger.runs SET input = '{\"x\": 1}', fencing_token = 0",
        "fencing_token of run r1 cannot decrease",
    ),
    "flow and state: the state comes first": (
        "UPDATE runledger.runs SET flow = 'x', state = '{\"forged\": 1}'",
        "a change of state on run r1 must bump state_version by exactly one",
    ),
    "version jump and flow: the version comes first": (
        "UPDATE runledger.runs SET flow = 'x', state_version = state_version + 2",
        "state_version of run r1 moves by one at a time",
    ),
    "call id": (
        "UPDATE runledger.run_calls SET call_id = 'c2', idempotency_key = 'r1:0:c2'",
        IMMUTABLE,
    ),
    "call provider id": ("UPDATE runledger.run_calls SET provider_id = 'p-1'", IMMUTABLE),
    "call tool and attempts: the columns come first": (
        "UPDATE runledger.run_calls SET tool = 'other', attempts = 0",
        IMMUTABLE,
    ),
    "call attempts and receipt: the status rule comes first": (
        "UPDATE runledger.run_calls SET attempts = 0, receipt = NULL",
        "call r1:0:c1 succeeded; its result and receipt cannot be overwritten",
    ),
    "call approval from none to approved": (
        "UPDATE runledger.run_calls SET approval = 'approved', approval_by = 'dba', "
        "approval_at = now()",
        "approval of call r1:0:c1 cannot move from NULL to approved",
    ),
}


@pytest.mark.parametrize("case", sorted(REFUSED))
def test_a_refused_row_gets_the_guards_first_failing_check(
    case: str, worker: Conn, admin_conn: Conn
) -> None:
    _journal(worker)
    statement, message = REFUSED[case]
    with refused(admin_conn, "RL007", case) as info:
        admin_conn.execute(statement)  # type: ignore[arg-type]
    assert info.value.diag.message_primary == message
    assert run_row(admin_conn, "r1")["flow"] == "demo"
    assert call_row(admin_conn, "r1:0:c1")["tool"] == "create_ticket"


def test_a_write_that_keeps_every_invariant_still_passes(worker: Conn, admin_conn: Conn) -> None:
    _journal(worker)
    admin_conn.execute(
        "UPDATE runledger.runs SET input = input, flow = flow, state = state, "
        "fencing_token = fencing_token + 1"
    )
    admin_conn.execute("UPDATE runledger.run_calls SET args = args, tool = tool, attempts = 5")
    assert run_row(admin_conn, "r1")["fencing_token"] == 2
    assert call_row(admin_conn, "r1:0:c1")["attempts"] == 5


def _guard_calls(conn: Conn) -> dict[str, int]:
    return {
        name: int(
            scalar(
                conn,
                "SELECT coalesce(pg_stat_get_xact_function_calls(%s::regproc::oid), 0)",
                (f"runledger.{name}",),
            )
        )
        for name in ("_guard_runs", "_guard_run_calls")
    }


def test_the_functions_own_writes_do_not_call_the_guards(admin_conn: Conn) -> None:
    """A whole run through the functions (every UPDATE of runs and run_calls they make):
    no guard call. The control, a prune in the same transaction, counts both guards."""
    with admin_conn.transaction():
        admin_conn.execute("SET LOCAL track_functions = 'all'")
        lease = submit_and_claim(admin_conn)
        checkpoint(admin_conn, lease, 0, {"step": 1})
        k = dispatched_call(admin_conn, lease)
        complete(admin_conn, lease, k, "succeeded", {"ticket": 1}, None)
        finish(admin_conn, lease, "succeeded", {"done": True})
        assert _guard_calls(admin_conn) == {"_guard_runs": 0, "_guard_run_calls": 0}
        pruned = scalar(admin_conn, "SELECT runledger.prune_runs(now() + interval '1 day', false)")
        assert pruned == 1
        assert _guard_calls(admin_conn) == {"_guard_runs": 1, "_guard_run_calls": 1}
