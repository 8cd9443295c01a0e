"""Roles: workers write only through the functions; auditors only read."""

from __future__ import annotations

from typing import Any

import psycopg

from .helpers import (
    checkpoint,
    claim,
    complete,
    count,
    dispatched_call,
    finish,
    paused_on_unknown,
    refused,
    rows,
    run_row,
    submit,
    submit_and_claim,
)

Conn = psycopg.Connection[Any]

TABLE_WRITES = {
    "insert run": "INSERT INTO runledger.runs (run_id, flow, flow_version, input, available_at, "
    "created_at, updated_at) VALUES ('x', 'demo', '1', '{}', now(), now(), now())",
    "update run": "UPDATE runledger.runs SET fencing_token = fencing_token + 100",
    "steal lease": "UPDATE runledger.runs SET lease_expires_at = lease_expires_at + '1 day'",
    "delete run": "DELETE FROM runledger.runs",
    "insert event": "INSERT INTO runledger.run_events (run_id, at, kind) VALUES ('r1', now(), 'x')",
    "update call": "UPDATE runledger.run_calls SET status = 'succeeded'",
    "delete turn": "DELETE FROM runledger.run_turns",
    "move the clock": "UPDATE runledger.settings SET clock_offset = '1 hour'",
    "raise the cap": "UPDATE runledger.settings SET max_payload_bytes = 268435456",
    "truncate events": "TRUNCATE runledger.run_events",
}

OPERATOR_CALLS = {
    "resolve_call": "SELECT runledger.resolve_call('r1:0:c1', 'applied', '{}', 'me', NULL)",
    "approve_call": "SELECT runledger.approve_call('r1:0:c1', 'me', NULL)",
    "deny_call": "SELECT runledger.deny_call('r1:0:c1', 'me', 'no')",
    "cancel_run": "SELECT runledger.cancel_run('r1', 'me', NULL)",
    "retry_run": "SELECT runledger.retry_run('r1', 'me')",
    "prune_runs": "SELECT runledger.prune_runs(now(), false)",
}

HELPERS = {
    "_raise": "SELECT runledger._raise('RL001', 'x', NULL, NULL)",
    "_lock_run": "SELECT runledger._lock_run('r1')",
    "_event": "SELECT runledger._event('r1', 'forged', NULL, NULL, NULL, '{}')",
}

READS = [
    "runs",
    "run_turns",
    "run_calls",
    "run_events",
    "workers",
    "settings",
    "run_timeline",
    "effect_ledger",
    "lease_history",
]


def _setup(worker: Conn) -> None:
    lease = submit_and_claim(worker)
    paused_on_unknown(worker, lease)


def test_the_worker_role_cannot_write_any_table(worker: Conn, admin_conn: Conn) -> None:
    _setup(worker)
    for case, statement in TABLE_WRITES.items():
        with refused(admin_conn, "42501", case):
            worker.execute(statement)  # type: ignore[arg-type]


def test_the_worker_role_reads_and_calls_the_worker_functions(
    worker: Conn, admin_conn: Conn
) -> None:
    assert worker.execute("SELECT current_user").fetchone() == {"current_user": "runledger_worker"}
    submit(worker, "r1")
    [lease] = claim(worker)
    assert checkpoint(worker, lease, 0, {"a": 1}) == 1
    k = dispatched_call(worker, lease)
    complete(worker, lease, k, "succeeded", {"ok": True})
    finish(worker, lease, "succeeded")
    worker.execute("SELECT runledger.register_worker_v2('w1', 'host', 42, ARRAY['demo@1'], false)")
    worker.execute("SELECT runledger.heartbeat_worker('w1', false)")
    for relation in READS:
        worker.execute(f"SELECT * FROM runledger.{relation}").fetchall()  # type: ignore[arg-type]
    assert run_row(admin_conn, "r1")["status"] == "succeeded"
    assert count(admin_conn, "workers") == 1


def test_the_worker_role_cannot_call_operator_functions_or_helpers(
    worker: Conn, admin_conn: Conn
) -> None:
    _setup(worker)
    for case, statement in {**OPERATOR_CALLS, **HELPERS}.items():
        with refused(admin_conn, "42501", case) as info:
            worker.execute(statement)  # type: ignore[arg-type]
        assert "permission denied for function" in str(info.value), case


def test_the_operator_role_calls_operator_functions_but_writes_no_table(
    worker: Conn, operator: Conn, admin_conn: Conn
) -> None:
    _setup(worker)
    for case, statement in TABLE_WRITES.items():
        with refused(admin_conn, "42501", case):
            operator.execute(statement)  # type: ignore[arg-type]
    for case, statement in HELPERS.items():
        with refused(admin_conn, "42501", case):
            operator.execute(statement)  # type: ignore[arg-type]

    operator.execute(OPERATOR_CALLS["resolve_call"])
    assert run_row(admin_conn, "r1")["status"] == "queued"
    operator.execute(OPERATOR_CALLS["cancel_run"])
    assert run_row(admin_conn, "r1")["status"] == "cancelled"
    submit(worker, "f")
    [lease] = claim(worker, "w1")
    finish(worker, lease, "failed", None, reason="x")
    operator.execute("SELECT runledger.retry_run('f', 'me')")
    assert run_row(admin_conn, "f")["status"] == "queued"


def test_the_auditor_role_only_reads(worker: Conn, auditor: Conn, admin_conn: Conn) -> None:
    _setup(worker)
    for relation in READS:
        assert auditor.execute(f"SELECT * FROM runledger.{relation}").fetchall() is not None  # type: ignore[arg-type]
    assert len(auditor.execute("SELECT * FROM runledger.effect_ledger").fetchall()) == 1

    for case, statement in TABLE_WRITES.items():
        with refused(admin_conn, "42501", case):
            auditor.execute(statement)  # type: ignore[arg-type]
    worker_calls = {
        "submit_run": "SELECT * FROM runledger.submit_run('a1', 'demo', '1', '{}')",
        "claim_runs_v4": "SELECT * FROM runledger.claim_runs_v4('a', ARRAY['demo@1'], '1 min', 1)",
        "report_stale_write": "SELECT runledger.report_stale_write('r1', 'a', NULL, 1, 'x', 'y')",
    }
    for case, statement in {**worker_calls, **OPERATOR_CALLS}.items():
        with refused(admin_conn, "42501", case):
            auditor.execute(statement)  # type: ignore[arg-type]


def test_public_cannot_execute_any_function(admin_conn: Conn) -> None:
    found = rows(
        admin_conn,
        "SELECT p.oid::regprocedure::text AS fn, p.proacl IS NULL AS default_acl, "
        "EXISTS (SELECT 1 FROM aclexplode(p.proacl) a "
        "        WHERE a.grantee = 0 AND a.privilege_type = 'EXECUTE') AS public_exec "
        "FROM pg_proc p WHERE p.pronamespace = 'runledger'::regnamespace",
    )
    assert len(found) >= 20
    for row in found:
        assert not row["default_acl"], f"{row['fn']} keeps the default ACL (PUBLIC may execute)"
        # revision 0027: but the pure functions the CHECK constraints call (a CHECK's
        # function runs with the writer's rights)
        # revision 0029: and those the guard triggers' WHEN clauses call, the same way
        if row["fn"].startswith(("runledger._ck_", "runledger._tw_")):
            assert row["public_exec"], f"PUBLIC may not execute {row['fn']}"
            continue
        assert not row["public_exec"], f"PUBLIC may execute {row['fn']}"


CONTRACT_FUNCTIONS = [
    "submit_run",
    "submit_run_v2",
    "claim_runs_v4",
    "renew_leases",
    "checkpoint",
    "record_turn_v4",
    "finish_and_claim",
    "dispatch_call",
    "complete_call",
    "complete_call_v2",
    "complete_calls",
    "finish_run",
    "release_lease",
    "report_stale_write",
    "register_worker_v2",
    "heartbeat_worker",
    "resolve_call",
    "approve_call",
    "deny_call",
    "cancel_run",
    "retry_run",
    "prune_runs",
]


def test_contract_functions_are_security_definer_with_a_pinned_search_path(
    admin_conn: Conn,
) -> None:
    found = {
        r["proname"]: r
        for r in rows(
            admin_conn,
            "SELECT proname, prosecdef, proconfig FROM pg_proc "
            "WHERE pronamespace = 'runledger'::regnamespace",
        )
    }
    for name in CONTRACT_FUNCTIONS:
        assert name in found, name
        assert found[name]["prosecdef"], f"{name} is not SECURITY DEFINER"
        assert found[name]["proconfig"] == ["search_path=pg_catalog, runledger, pg_temp"], name
