"""The second wall: triggers that hold even for the table owner's direct writes."""

from __future__ import annotations

import datetime as dt
from typing import Any

import psycopg
import pytest

from runledger.testing import DbClock

from .helpers import (
    call_row,
    checkpoint,
    complete,
    count,
    dispatched_call,
    events,
    finish,
    refused,
    rows,
    run_row,
    scalar,
    submit,
    submit_and_claim,
)

Conn = psycopg.Connection[Any]

# Direct writes the owner (here: the superuser) must not get through; run r1 has
# fencing_token 1, state_version 1 and a succeeded call r1:0:c1 with a receipt.
FORBIDDEN = {
    "fencing_token decrease": "UPDATE runledger.runs SET fencing_token = fencing_token - 1",
    "fencing_token to zero": "UPDATE runledger.runs SET fencing_token = 0, lease_id = NULL, "
    "lease_expires_at = NULL, lease_owner = NULL, status = 'queued'",
    "state_version decrease": "UPDATE runledger.runs SET state_version = state_version - 1",
    "state change without a version bump": "UPDATE runledger.runs SET state = '{\"forged\": 1}'",
    "state change with a bump of two": "UPDATE runledger.runs SET state = '{\"forged\": 1}', "
    "state_version = state_version + 2",
    "state change with a version decrease": "UPDATE runledger.runs SET state = '{\"forged\": 1}', "
    "state_version = state_version - 1",
    "version jump": "UPDATE runledger.runs SET state_version = state_version + 5",
    "pinned input": "UPDATE runledger.runs SET input = '{\"other\": true}'",
    "pinned flow version": "UPDATE runledger.runs SET flow_version = '2'",
    "run id changed": "UPDATE runledger.runs SET run_id = 'r2'",
    "run deleted": "DELETE FROM runledger.runs",
    "succeeded receipt overwritten": "UPDATE runledger.run_calls SET receipt = '{\"forged\": 1}'",
    "succeeded receipt erased": "UPDATE runledger.run_calls SET receipt = NULL",
    "succeeded result overwritten": "UPDATE runledger.run_calls SET result = '{\"forged\": 1}'",
    "succeeded call reopened": "UPDATE runledger.run_calls SET status = 'planned'",
    "call args changed": "UPDATE runledger.run_calls SET args = '{\"forged\": 1}'",
    "call tool changed": "UPDATE runledger.run_calls SET tool = 'other_tool'",
    "call attempts decrease": "UPDATE runledger.run_calls SET attempts = 0",
    "call deleted": "DELETE FROM runledger.run_calls",
    "turn rewritten": "UPDATE runledger.run_turns SET calls = '[]'",
    "turn deleted": "DELETE FROM runledger.run_turns",
    "event rewritten": "UPDATE runledger.run_events SET kind = 'forged'",
    "event deleted": "DELETE FROM runledger.run_events",
    "events truncated": "TRUNCATE runledger.run_events",
    "runs truncated": "TRUNCATE runledger.runs CASCADE",
    "calls truncated": "TRUNCATE runledger.run_calls",
    "turns truncated": "TRUNCATE runledger.run_turns CASCADE",
}


def _journal(worker: Conn) -> None:
    lease = submit_and_claim(worker)
    checkpoint(worker, lease, 0, {"step": 1})
    k = dispatched_call(worker, lease)
    complete(worker, lease, k, "succeeded", {"ticket": 1}, {"provider_id": "T-1"})


@pytest.mark.parametrize("replica", [False, True], ids=["origin", "session_replication_role"])
def test_direct_writes_that_break_an_invariant_are_refused(
    replica: bool, worker: Conn, admin_conn: Conn
) -> None:
    _journal(worker)
    if replica:
        admin_conn.execute("SET session_replication_role = replica")
        assert scalar(admin_conn, "SHOW session_replication_role") == "replica"

    for case, statement in FORBIDDEN.items():
        with refused(admin_conn, "RL007", case) as info:
            admin_conn.execute(statement)  # type: ignore[arg-type]
        assert info.value.diag.message_primary, case

    assert run_row(admin_conn, "r1")["state"] == {"step": 1}
    assert call_row(admin_conn, "r1:0:c1")["receipt"] == {"provider_id": "T-1"}


def test_the_wall_holds_for_a_role_granted_table_writes(
    worker: Conn, connect: Any, admin_conn: Conn
) -> None:
    """A non-owner role with UPDATE/DELETE (say, a DBA role) meets RL007, not a 42501."""
    _journal(worker)
    admin_conn.execute(
        "GRANT UPDATE, DELETE ON runledger.runs, runledger.run_calls, runledger.run_events "
        "TO runledger_auditor"
    )
    dba = connect("runledger_auditor")

    for case in ("fencing_token decrease", "succeeded receipt overwritten", "event deleted"):
        with refused(admin_conn, "RL007", case):
            dba.execute(FORBIDDEN[case])  # type: ignore[arg-type]
    dba.execute("UPDATE runledger.runs SET priority = 3")  # the grant itself works
    assert run_row(admin_conn, "r1")["priority"] == 3


def test_the_wall_names_the_broken_invariant(worker: Conn, admin_conn: Conn) -> None:
    _journal(worker)
    with refused(admin_conn, "RL007") as info:
        admin_conn.execute("UPDATE runledger.runs SET fencing_token = 0")
    assert info.value.diag.message_primary == "fencing_token of run r1 cannot decrease"
    assert info.value.diag.message_detail == "from 1 to 0"
    with refused(admin_conn, "RL007") as info:
        admin_conn.execute("UPDATE runledger.run_calls SET receipt = '{}'")
    assert "r1:0:c1 succeeded" in info.value.diag.message_primary


def test_the_wall_lets_consistent_direct_writes_through(worker: Conn, admin_conn: Conn) -> None:
    """The triggers refuse only what breaks an invariant, not every direct write."""
    _journal(worker)

    admin_conn.execute(
        "UPDATE runledger.runs SET state = '{\"step\": 2}', state_version = state_version + 1, "
        "fencing_token = fencing_token + 1, priority = 9"
    )
    admin_conn.execute("UPDATE runledger.run_calls SET resolution_note = 'checked'")

    run = run_row(admin_conn, "r1")
    assert (run["state"], run["state_version"], run["fencing_token"]) == ({"step": 2}, 2, 2)


def test_the_triggers_fire_always(admin_conn: Conn) -> None:
    found = rows(
        admin_conn,
        "SELECT c.relname, t.tgname, t.tgenabled FROM pg_trigger t "
        "JOIN pg_class c ON c.oid = t.tgrelid "
        "WHERE c.relnamespace = 'runledger'::regnamespace AND NOT t.tgisinternal",
    )
    assert {r["relname"] for r in found} >= {"runs", "run_calls", "run_turns", "run_events"}
    assert {r["tgenabled"] for r in found} == {"A"}, found


def test_idempotency_keys_are_unique(worker: Conn, admin_conn: Conn) -> None:
    _journal(worker)
    with refused(admin_conn, "23505"):
        admin_conn.execute(
            "INSERT INTO runledger.run_calls (run_id, turn, call_id, position, tool, args, "
            "idempotency_key) VALUES ('r1', 0, 'c1', 1, 't', '{}', 'r1:0:c1')"
        )
    with refused(admin_conn, "23514"):
        admin_conn.execute(
            "INSERT INTO runledger.run_calls (run_id, turn, call_id, position, tool, args, "
            "idempotency_key) VALUES ('r1', 0, 'c2', 1, 't', '{}', 'r1:0:c1x')"
        )


# -- retention --------------------------------------------------------------------------


def _finished(worker: Conn, run_id: str, status: str = "succeeded") -> None:
    lease = submit_and_claim(worker, run_id)
    k = dispatched_call(worker, lease)
    complete(worker, lease, k, "succeeded", {"ok": True}, {"id": run_id})
    finish(worker, lease, status, None, reason="done")


@pytest.mark.parametrize("keep_events", [True, False])
def test_prune_runs_deletes_finished_runs_only(
    keep_events: bool, worker: Conn, operator: Conn, admin_conn: Conn, db_clock: DbClock
) -> None:
    _finished(worker, "old-ok")
    _finished(worker, "old-failed", "failed")
    paused = submit_and_claim(worker, "old-paused")
    finish(worker, paused, "paused", reason="check")
    submit(worker, "old-queued", flow="other")  # not claimed by the demo@1 claims below
    old_events = {r: len(events(admin_conn, r)) for r in ("old-ok", "old-failed")}
    db_clock.advance(7 * 86400)
    _finished(worker, "new-ok")
    cutoff = db_clock.now() - dt.timedelta(days=1)

    pruned = scalar(operator, "SELECT runledger.prune_runs(%s, %s)", (cutoff, keep_events))

    assert pruned == 2
    left = [r["run_id"] for r in rows(admin_conn, "SELECT run_id FROM runledger.runs ORDER BY 1")]
    assert left == ["new-ok", "old-paused", "old-queued"]
    keys = [r["idempotency_key"] for r in rows(admin_conn, "SELECT * FROM runledger.run_calls")]
    assert keys == ["new-ok:0:c1"]
    assert count(admin_conn, "run_turns") == 1
    for run_id, n in old_events.items():
        assert len(events(admin_conn, run_id)) == (n if keep_events else 0), run_id
    assert len(events(admin_conn, "old-paused")) > 0
    assert len(events(admin_conn, "new-ok")) > 0


def test_prune_runs_leaves_no_open_door_behind(
    worker: Conn, admin_conn: Conn, db_clock: DbClock
) -> None:
    """The authorization lives only while prune_runs runs: later deletes of the same
    transaction meet the wall again."""
    _finished(worker, "old")
    db_clock.advance(86400)
    with admin_conn.transaction():
        admin_conn.execute("SELECT runledger.prune_runs(runledger.now(), true)")
        assert count(admin_conn, "prune_authorizations") == 0
        # A savepoint: the refusal rolls back only the DELETE.
        with refused(admin_conn, "RL007"), admin_conn.transaction():
            admin_conn.execute("DELETE FROM runledger.run_events")
    assert count(admin_conn, "runs") == 0
    assert len(events(admin_conn, "old")) > 0


def test_prune_runs_twice_in_one_transaction_and_in_a_savepoint(
    worker: Conn, admin_conn: Conn, db_clock: DbClock
) -> None:
    _finished(worker, "a")
    _finished(worker, "b")
    db_clock.advance(86400)
    cutoff = db_clock.now()
    with admin_conn.transaction():
        with admin_conn.transaction():  # a savepoint
            assert scalar(admin_conn, "SELECT runledger.prune_runs(%s, false)", (cutoff,)) == 2
        assert scalar(admin_conn, "SELECT runledger.prune_runs(%s, false)", (cutoff,)) == 0
    assert (count(admin_conn, "runs"), count(admin_conn, "run_events")) == (0, 0)
    assert count(admin_conn, "prune_authorizations") == 0


# The reproduction of issue 7, item 9: a session setting switched the delete guards off.
BYPASSES = {
    "SET LOCAL": "SET LOCAL runledger.pruning = 'on'",
    "SET": "SET runledger.pruning = 'on'",
    "set_config local": "SELECT set_config('runledger.pruning', 'on', true)",
    "set_config session": "SELECT set_config('runledger.pruning', 'on', false)",
}


@pytest.mark.parametrize("bypass", sorted(BYPASSES))
def test_a_session_setting_does_not_switch_the_wall_off(
    bypass: str, worker: Conn, admin_conn: Conn
) -> None:
    """Not for the owner (here: a superuser) nor for anyone: the guards do not read it."""
    lease = submit_and_claim(worker, "live")
    dispatched_call(worker, lease)
    for statement in (
        "DELETE FROM runledger.run_events",
        "DELETE FROM runledger.runs WHERE run_id = 'live'",
        "DELETE FROM runledger.run_calls",
        "DELETE FROM runledger.run_turns",
    ):
        with refused(admin_conn, "RL007", (bypass, statement)), admin_conn.transaction():
            admin_conn.execute(BYPASSES[bypass])  # type: ignore[arg-type]
            admin_conn.execute(statement)  # type: ignore[arg-type]
        admin_conn.execute("RESET runledger.pruning")
    assert run_row(admin_conn, "live")["status"] == "running"


def test_an_authorization_is_for_the_current_transaction_only(admin_conn: Conn) -> None:
    """Even the owner cannot leave one behind for a later transaction."""
    with refused(admin_conn, "RL007") as info:
        admin_conn.execute("INSERT INTO runledger.prune_authorizations VALUES (txid_current() + 1)")
    assert "current transaction only" in str(info.value.diag.message_primary)
    with refused(admin_conn, "RL007"), admin_conn.transaction():
        admin_conn.execute("INSERT INTO runledger.prune_authorizations VALUES (txid_current())")
        admin_conn.execute("UPDATE runledger.prune_authorizations SET txid = txid + 1")


def test_even_an_authorized_delete_takes_only_finished_runs(worker: Conn, admin_conn: Conn) -> None:
    """The owner can forge an authorization (documented); the guard of runs still keeps
    queued, running and paused runs."""
    submit(worker, "queued", flow="other")
    submit_and_claim(worker, "running")
    paused = submit_and_claim(worker, "paused")
    finish(worker, paused, "paused", reason="check")
    for run_id in ("queued", "running", "paused"):
        with refused(admin_conn, "RL007", run_id) as info, admin_conn.transaction():
            admin_conn.execute("INSERT INTO runledger.prune_authorizations VALUES (txid_current())")
            admin_conn.execute("DELETE FROM runledger.runs WHERE run_id = %s", (run_id,))
        assert info.value.diag.message_primary == (
            f"run {run_id} is {run_id}: only finished runs are pruned"
        )


@pytest.mark.parametrize("cutoff", ["infinity", "now"])
def test_prune_runs_never_deletes_queued_running_or_paused_runs(
    cutoff: str, worker: Conn, operator: Conn, admin_conn: Conn, db_clock: DbClock
) -> None:
    submit(worker, "queued", flow="other")
    running = submit_and_claim(worker, "running")
    dispatched_call(worker, running)
    paused = submit_and_claim(worker, "paused")
    finish(worker, paused, "paused", reason="check")
    _finished(worker, "done")
    db_clock.advance(30 * 86400)  # every lease has long expired: still not finished
    before = {r: len(events(admin_conn, r)) for r in ("queued", "running", "paused")}

    pruned = scalar(
        operator,
        "SELECT runledger.prune_runs(CASE WHEN %s = 'now' THEN runledger.now() "
        "ELSE 'infinity'::timestamptz END, false)",
        (cutoff,),
    )

    assert pruned == 1
    left = {r["run_id"]: r["status"] for r in rows(admin_conn, "SELECT * FROM runledger.runs")}
    assert left == {"queued": "queued", "running": "running", "paused": "paused"}
    assert call_row(admin_conn, "running:0:c1")["status"] == "dispatched"
    assert {r: len(events(admin_conn, r)) for r in before} == before
    assert events(admin_conn, "done") == []


def test_prune_runs_refuses_a_null_cutoff(operator: Conn, admin_conn: Conn) -> None:
    with refused(admin_conn, "RL006"):
        operator.execute("SELECT runledger.prune_runs(NULL, true)")
