"""Revision 0021, fewer statements per tool call with the same contract: a completion and
the next call's dispatch are one UPDATE, and a decision's calls to dispatch are inserted
dispatched; the events and their hash chain are as before.

A row's ``cmin`` is the command (statement) of its transaction that wrote it: rows with
the same one were written by one statement. Before 0021 each of these pairs had two."""

from __future__ import annotations

from typing import Any

import psycopg
import pytest

from .helpers import call, call_row, chain_links, events, key, refused, rows, submit_and_claim
from .test_fast_path import complete_v2, kinds, two_calls
from .test_record_turn_v4 import v4

Conn = psycopg.Connection[Any]


def _call_commands(admin: Conn, *keys: str) -> list[int]:
    found = rows(
        admin,
        "SELECT idempotency_key, cmin::text::int AS cmin, xmin::text AS xmin"
        " FROM runledger.run_calls WHERE idempotency_key = ANY(%s)",
        (list(keys),),
    )
    by_key = {r["idempotency_key"]: r for r in found}
    assert len({by_key[k]["xmin"] for k in keys}) == 1, "written by one transaction"
    return [by_key[k]["cmin"] for k in keys]


def _chain_holds(admin: Conn, run_id: str) -> bool:
    links = chain_links(admin, run_id)
    return bool(links) and all(links)


@pytest.mark.parametrize("outcome", ["succeeded", "failed"])
def test_a_completion_and_the_next_dispatch_are_one_update_and_one_insert(
    worker: Conn, admin_conn: Conn, outcome: str
) -> None:
    lease, first, second = two_calls(worker)
    assert complete_v2(worker, lease, first, outcome, {"r": 1}, next_key=second) == 1
    done, sent = _call_commands(admin_conn, first, second)
    assert done == sent
    assert kinds(admin_conn, "r1")[-2:] == [f"call_{outcome}", "call_dispatched"]
    assert _chain_holds(admin_conn, "r1")


def test_a_decisions_calls_to_dispatch_are_inserted_dispatched_with_its_events(
    worker: Conn, admin_conn: Conn
) -> None:
    lease = submit_and_claim(worker)
    calls = [call("c1"), call("c2"), call("c3")]
    assert v4(worker, lease, 0, calls, ["c3", "c1"], expected=0, state={"s": 1}) == (1, [1, 1])
    keys = [key("r1", 0, c) for c in ("c1", "c2", "c3")]
    assert len(set(_call_commands(admin_conn, *keys))) == 1
    assert [call_row(admin_conn, k)["status"] for k in keys] == [
        "dispatched",
        "planned",
        "dispatched",
    ]
    assert kinds(admin_conn, "r1")[-4:] == [
        "checkpoint",
        "turn_recorded",
        "call_dispatched",
        "call_dispatched",
    ]
    sent = events(admin_conn, "r1", "call_dispatched")
    assert [e["detail"]["idempotency_key"] for e in sent] == [keys[2], keys[0]]
    assert all(e["detail"]["previous_status"] == "planned" for e in sent)
    assert _chain_holds(admin_conn, "r1")


def test_a_decision_with_a_call_awaiting_approval_dispatches_as_before(
    worker: Conn, admin_conn: Conn
) -> None:
    """A pending approval anywhere in the decision takes _dispatch's path: its call stays
    planned, the other is updated by a statement of its own."""
    lease = submit_and_claim(worker)
    calls = [call("c1"), {**call("c2"), "approval": True}]
    assert v4(worker, lease, 0, calls, ["c1"]) == (0, [1])
    first, second = key("r1", 0, "c1"), key("r1", 0, "c2")
    sent, waiting = _call_commands(admin_conn, first, second)
    assert sent != waiting
    assert call_row(admin_conn, first)["status"] == "dispatched"
    assert call_row(admin_conn, second)["approval"] == "pending"
    with refused(admin_conn, "RL004"):
        v4(worker, lease, 0, calls, ["c2"])
    assert _chain_holds(admin_conn, "r1")


def test_a_next_call_that_cannot_be_dispatched_leaves_the_completion_unwritten(
    worker: Conn, admin_conn: Conn
) -> None:
    lease, first, second = two_calls(worker, approval=True)
    with refused(admin_conn, "RL004") as caught:
        complete_v2(worker, lease, first, "succeeded", {"r": 1}, next_key=second)
    assert "awaits approval" in str(caught.value)
    assert call_row(admin_conn, first)["status"] == "dispatched"


def test_a_completion_whose_rows_moved_under_the_lock_is_refused_whole(
    worker: Conn, admin_conn: Conn
) -> None:
    """The read finds both rows, then a write that ignores the run's lock (a superuser's,
    here a BEFORE trigger of the test's own) changes the next call: nothing is written."""
    lease, first, second = two_calls(worker)
    admin_conn.execute(
        "CREATE FUNCTION runledger.test_move() RETURNS trigger LANGUAGE plpgsql AS $$"
        " BEGIN IF NEW.status = 'dispatched' AND OLD.status = 'planned' THEN"
        " RETURN NULL; END IF; RETURN NEW; END $$"
    )
    admin_conn.execute(
        "CREATE TRIGGER test_move BEFORE UPDATE ON runledger.run_calls"
        " FOR EACH ROW EXECUTE FUNCTION runledger.test_move()"
    )
    try:
        with refused(admin_conn, "RL004") as caught:
            complete_v2(worker, lease, first, "succeeded", {"r": 1}, next_key=second)
        assert "changed while run r1 was locked" in str(caught.value)
    finally:
        admin_conn.execute("DROP TRIGGER test_move ON runledger.run_calls")
        admin_conn.execute("DROP FUNCTION runledger.test_move()")
    assert call_row(admin_conn, first)["status"] == "dispatched"
    assert call_row(admin_conn, second)["status"] == "planned"
