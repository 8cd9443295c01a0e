"""The stored functions are the contract (docs/design.md, "Functions"): names, argument order
and types, results, SECURITY DEFINER, a pinned search_path, and no EXECUTE for PUBLIC.

Types are written here as docs/design.md spells them and resolved by PostgreSQL
(``to_regtype``/``to_regprocedure``), so ``int`` and ``integer`` are the same type.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any, NamedTuple

import psycopg
import pytest
from psycopg.rows import dict_row

from runledger.testing.postgres import Databases

Conn = psycopg.Connection[dict[str, Any]]

PINNED_SEARCH_PATH = "search_path=pg_catalog, runledger, pg_temp"


class Fn(NamedTuple):
    name: str
    args: list[tuple[str, str]]
    returns: str | list[tuple[str, str]] | None  # None: docs/design.md does not say
    defaults: int = 0
    role: str = "runledger_worker"


WORKER = "runledger_worker"
OPERATOR = "runledger_operator"
AUDITOR = "runledger_auditor"

CONTRACT: list[Fn] = [
    Fn(
        "submit_run",
        [
            ("p_run_id", "text"),
            ("p_flow", "text"),
            ("p_flow_version", "text"),
            ("p_input", "jsonb"),
            ("p_priority", "int"),
            ("p_available_at", "timestamptz"),
        ],
        [("run_id", "text"), ("created", "boolean")],
        defaults=2,
    ),
    Fn(
        "submit_run_v2",
        [
            ("p_run_id", "text"),
            ("p_flow", "text"),
            ("p_flow_version", "text"),
            ("p_input", "jsonb"),
            ("p_priority", "int"),
            ("p_available_at", "timestamptz"),
            ("p_traceparent", "text"),
        ],
        [("run_id", "text"), ("created", "boolean")],
        defaults=3,
    ),
    Fn(
        "claim_runs_v4",
        [
            ("p_worker_id", "text"),
            ("p_flows", "text[]"),
            ("p_lease", "interval"),
            ("p_max_runs", "int"),
        ],
        [
            ("run_id", "text"),
            ("flow", "text"),
            ("flow_version", "text"),
            ("input", "jsonb"),
            ("state", "jsonb"),
            ("state_version", "bigint"),
            ("fencing_token", "bigint"),
            ("lease_id", "uuid"),
            ("lease_expires_at", "timestamptz"),
            ("takeover", "boolean"),
            ("stalled_claims", "integer"),
            ("turns", "json"),
            ("calls", "json"),
            ("failover_turn", "integer"),
            ("traceparent", "text"),
        ],
    ),
    Fn(
        "renew_leases",
        [
            ("p_worker_id", "text"),
            ("p_run_ids", "text[]"),
            ("p_lease_ids", "uuid[]"),
            ("p_lease", "interval"),
        ],
        [("run_id", "text"), ("lease_expires_at", "timestamptz")],
    ),
    Fn(
        "checkpoint",
        [
            ("p_run_id", "text"),
            ("p_lease_id", "uuid"),
            ("p_fencing_token", "bigint"),
            ("p_expected_version", "bigint"),
            ("p_state", "jsonb"),
        ],
        "bigint",
    ),
    Fn(
        "record_turn_v4",
        [
            ("p_run_id", "text"),
            ("p_lease_id", "uuid"),
            ("p_fencing_token", "bigint"),
            ("p_turn", "int"),
            ("p_calls", "jsonb"),
            ("p_record", "jsonb"),
            ("p_output", "jsonb"),
            ("p_expected_version", "bigint"),
            ("p_state", "jsonb"),
            ("p_finish", "boolean"),
            ("p_dispatch", "text[]"),
        ],
        [("state_version", "bigint"), ("attempts", "integer[]")],
    ),
    Fn(
        "finish_and_claim",
        [
            ("p_run_id", "text"),
            ("p_lease_id", "uuid"),
            ("p_fencing_token", "bigint"),
            ("p_turn", "int"),
            ("p_record", "jsonb"),
            ("p_output", "jsonb"),
            ("p_expected_version", "bigint"),
            ("p_state", "jsonb"),
            ("p_worker_id", "text"),
            ("p_flows", "text[]"),
            ("p_lease", "interval"),
            ("p_max_runs", "int"),
        ],
        [
            ("finished_version", "bigint"),
            ("run_id", "text"),
            ("flow", "text"),
            ("flow_version", "text"),
            ("input", "jsonb"),
            ("state", "jsonb"),
            ("state_version", "bigint"),
            ("fencing_token", "bigint"),
            ("lease_id", "uuid"),
            ("lease_expires_at", "timestamptz"),
            ("takeover", "boolean"),
            ("stalled_claims", "integer"),
            ("turns", "json"),
            ("calls", "json"),
            ("failover_turn", "integer"),
            ("traceparent", "text"),
        ],
    ),
    Fn(
        "dispatch_call",
        [
            ("p_run_id", "text"),
            ("p_lease_id", "uuid"),
            ("p_fencing_token", "bigint"),
            ("p_idempotency_key", "text"),
        ],
        "int",
    ),
    Fn(
        "complete_call",
        [
            ("p_run_id", "text"),
            ("p_lease_id", "uuid"),
            ("p_fencing_token", "bigint"),
            ("p_idempotency_key", "text"),
            ("p_outcome", "text"),
            ("p_result", "jsonb"),
            ("p_receipt", "jsonb"),
        ],
        "void",
    ),
    Fn(
        "complete_call_v2",
        [
            ("p_run_id", "text"),
            ("p_lease_id", "uuid"),
            ("p_fencing_token", "bigint"),
            ("p_idempotency_key", "text"),
            ("p_outcome", "text"),
            ("p_result", "jsonb"),
            ("p_receipt", "jsonb"),
            ("p_next_key", "text"),
        ],
        "int",
        defaults=1,
    ),
    Fn(
        "complete_calls",
        [
            ("p_run_id", "text"),
            ("p_lease_id", "uuid"),
            ("p_fencing_token", "bigint"),
            ("p_keys", "text[]"),
            ("p_outcomes", "text[]"),
            ("p_results", "jsonb[]"),
            ("p_receipts", "jsonb[]"),
            ("p_next_key", "text"),
        ],
        "int",
        defaults=1,
    ),
    Fn(
        "finish_run",
        [
            ("p_run_id", "text"),
            ("p_lease_id", "uuid"),
            ("p_fencing_token", "bigint"),
            ("p_status", "text"),
            ("p_result", "jsonb"),
            ("p_reason", "text"),
        ],
        "void",
    ),
    Fn(
        "release_lease",
        [("p_run_id", "text"), ("p_lease_id", "uuid"), ("p_fencing_token", "bigint")],
        "void",
    ),
    Fn(
        "release_lease",
        [
            ("p_run_id", "text"),
            ("p_lease_id", "uuid"),
            ("p_fencing_token", "bigint"),
            ("p_reason", "text"),
            ("p_error", "jsonb"),
        ],
        "void",
    ),
    Fn(  # revision 0.2: a fenced holder hands back a lease a failover made stale
        "release_stale_lease",
        [
            ("p_run_id", "text"),
            ("p_lease_id", "uuid"),
            ("p_fencing_token", "bigint"),
            ("p_worker_id", "text"),
        ],
        "boolean",
    ),
    Fn(  # register, holding a session lock under a fresh key
        "register_worker_v2",
        [
            ("p_worker_id", "text"),
            ("p_hostname", "text"),
            ("p_pid", "integer"),
            ("p_flows", "text[]"),
            ("p_session_lock", "boolean"),
            ("p_process", "text"),  # the worker's process, for its peers
            # registered without a session of its own (through a pooler)
            ("p_incarnation", "uuid"),
            ("p_session", "boolean"),
            ("p_silent_after", "interval"),
            ("p_gone_process", "text"),
        ],
        [("session_lock", "bigint"), ("session_pid", "integer")],
        defaults=5,
    ),
    Fn(  # who sent a call in flight, until when it may be sending it
        "call_sender",
        [
            ("p_run_id", "text"),
            ("p_lease_id", "uuid"),
            ("p_fencing_token", "bigint"),
            ("p_idempotency_key", "text"),
        ],
        [
            ("sender", "text"),
            ("sender_token", "bigint"),
            ("attempt", "integer"),
            ("dispatched_at", "timestamptz"),
            ("until", "timestamptz"),
            ("released", "jsonb"),
            ("process", "text"),
            ("registered_at", "timestamptz"),
            ("now", "timestamptz"),
        ],
    ),
    Fn(  # the end of a send, by its sender or (process gone) the holder
        "release_call",
        [
            ("p_run_id", "text"),
            ("p_lease_id", "uuid"),
            ("p_fencing_token", "bigint"),
            ("p_idempotency_key", "text"),
            ("p_worker_id", "text"),
            ("p_detail", "jsonb"),
        ],
        "boolean",
    ),
    Fn(  # with p_incarnation, only the process holding the id
        "heartbeat_worker",
        [
            ("p_worker_id", "text"),
            ("p_stopped", "boolean"),
            ("p_incarnation", "uuid"),
            ("p_clock_offset", "interval"),
        ],
        "void",
        defaults=3,
    ),
    Fn(  # the listener's heartbeat
        "heartbeat_listener",
        [("p_worker_id", "text")],
        [("session_pid", "integer"), ("takeover_due", "boolean")],
    ),
    Fn(
        "resolve_call",
        [
            ("p_idempotency_key", "text"),
            ("p_resolution", "text"),
            ("p_receipt", "jsonb"),
            ("p_actor", "text"),
            ("p_note", "text"),
        ],
        "void",
        role=OPERATOR,
    ),
    Fn(
        "approve_call",
        [("p_idempotency_key", "text"), ("p_actor", "text"), ("p_note", "text")],
        "void",
        role=OPERATOR,
    ),
    Fn(
        "deny_call",
        [("p_idempotency_key", "text"), ("p_actor", "text"), ("p_reason", "text")],
        "void",
        role=OPERATOR,
    ),
    Fn(
        "cancel_run",
        [("p_run_id", "text"), ("p_actor", "text"), ("p_reason", "text")],
        "void",
        role=OPERATOR,
    ),
    Fn("retry_run", [("p_run_id", "text"), ("p_actor", "text")], "void", role=OPERATOR),
    Fn(
        "prune_runs",
        [("p_before", "timestamptz"), ("p_keep_events", "boolean")],
        None,
        role=OPERATOR,
    ),
    Fn(
        "prune_runs_v2",
        [("p_before", "timestamptz"), ("p_keep_events", "boolean"), ("p_limit", "integer")],
        "integer",
        role=OPERATOR,
    ),
    Fn(
        "prune_records",
        [("p_before", "timestamptz"), ("p_keep_events", "boolean"), ("p_limit", "integer")],
        [
            ("checkpoints", "integer"),
            ("heads", "integer"),
            ("carried", "integer"),
            ("chains", "integer"),
            ("checkpoint_prunes", "integer"),
            ("chain_prunes", "integer"),
            ("workers", "integer"),
            ("commit_guarantees", "integer"),
            ("more", "boolean"),
        ],
        role=OPERATOR,
    ),
    Fn(
        "checkpoint_events",
        [("p_actor", "text"), ("p_min_age", "interval")],
        [
            ("checkpoint_id", "bigint"),
            ("at", "timestamptz"),
            ("through_event_id", "bigint"),
            ("runs", "integer"),
            ("digest", "text"),
            ("created", "boolean"),
        ],
    ),
]


# An overload after the first of its name is named by its argument count: release_lease/5.
IDS = [
    f.name if f.name not in [g.name for g in CONTRACT[:i]] else f"{f.name}/{len(f.args)}"
    for i, f in enumerate(CONTRACT)
]


def _oid_of_type(conn: Conn, name: str) -> int:
    row = conn.execute("SELECT to_regtype(%s)::int AS oid", (name,)).fetchone()
    assert row is not None and row["oid"] is not None, f"unknown type {name}"
    return int(row["oid"])


def _proc(conn: Conn, fn: Fn) -> dict[str, Any]:
    """The function of this name, among overloads the one with as many arguments as ``fn``."""
    rows = conn.execute(
        """
        SELECT p.oid::int AS oid, p.prosecdef, p.proconfig, p.proretset,
               p.prorettype::int AS prorettype, p.proargnames,
               p.proargtypes::oid[]::int[] AS in_types,
               p.proallargtypes::int[] AS all_types, p.proargmodes::text[] AS modes,
               p.pronargdefaults, p.proowner = n.nspowner AS owned_by_schema_owner,
               p.proacl IS NOT NULL AS has_acl,
               pg_get_function_identity_arguments(p.oid) AS identity
        FROM pg_proc p JOIN pg_namespace n ON n.oid = p.pronamespace
        WHERE n.nspname = 'runledger' AND p.proname = %s AND p.pronargs = %s
        """,
        (fn.name, len(fn.args)),
    ).fetchall()
    assert len(rows) == 1, (
        f"runledger.{fn.name} with {len(fn.args)} arguments: expected exactly one function, "
        f"found {len(rows)}"
    )
    return rows[0]


@pytest.fixture(scope="module")
def conn(runledger_databases: Databases) -> Iterator[Conn]:
    """One migrated database for the module: these tests only read the catalog."""
    url = runledger_databases.create("rl_fn")
    try:
        with psycopg.connect(url, autocommit=True, row_factory=dict_row) as c:
            yield c
    finally:
        runledger_databases.drop(url)


@pytest.mark.parametrize("fn", CONTRACT, ids=IDS)
def test_signature_matches_design(conn: Conn, fn: Fn) -> None:
    proc = _proc(conn, fn)
    signature = f"runledger.{fn.name}({', '.join(t for _, t in fn.args)})"
    row = conn.execute("SELECT to_regprocedure(%s)::int AS oid", (signature,)).fetchone()
    assert row is not None and row["oid"] == proc["oid"], (
        f"{signature} does not exist; the database has runledger.{fn.name}({proc['identity']})"
    )

    modes: list[str] = proc["modes"] or ["i"] * len(proc["in_types"])
    names: list[str] = proc["proargnames"] or []
    in_names = [n for n, m in zip(names, modes, strict=True) if m in ("i", "b", "v")]
    assert in_names == [n for n, _ in fn.args], proc["identity"]
    assert proc["in_types"] == [_oid_of_type(conn, t) for _, t in fn.args], proc["identity"]
    assert proc["pronargdefaults"] == fn.defaults

    if isinstance(fn.returns, list):
        assert proc["proretset"], f"{fn.name} must return a set (RETURNS TABLE)"
        out = [
            (n, t)
            for n, t, m in zip(names, proc["all_types"], modes, strict=True)
            if m in ("t", "o")
        ]
        assert out == [(n, _oid_of_type(conn, t)) for n, t in fn.returns]
    elif fn.returns is not None:
        assert not proc["proretset"]
        assert proc["prorettype"] == _oid_of_type(conn, fn.returns)


@pytest.mark.parametrize("fn", CONTRACT, ids=IDS)
def test_security_definer_pinned_and_not_public(conn: Conn, fn: Fn) -> None:
    proc = _proc(conn, fn)
    assert proc["prosecdef"], f"{fn.name} is not SECURITY DEFINER"
    assert PINNED_SEARCH_PATH in (proc["proconfig"] or []), proc["proconfig"]
    assert proc["owned_by_schema_owner"], f"{fn.name} is not owned by the schema owner"
    # proacl NULL means the default privileges, which include EXECUTE for PUBLIC.
    assert proc["has_acl"], f"{fn.name} has default privileges (PUBLIC may execute it)"
    row = conn.execute(
        "SELECT count(*) AS n FROM pg_proc p, aclexplode(p.proacl) a "
        "WHERE p.oid = %s AND a.grantee = 0 AND a.privilege_type = 'EXECUTE'",
        (proc["oid"],),
    ).fetchone()
    assert row is not None and row["n"] == 0, f"PUBLIC can execute runledger.{fn.name}"
    row = conn.execute(
        "SELECT has_function_privilege(%s, %s::oid, 'EXECUTE') AS ok", (fn.role, proc["oid"])
    ).fetchone()
    assert row is not None and row["ok"], f"{fn.role} cannot execute {fn.name}"


# runledger.now() and the internal helpers have no SET search_path (a SET
# costs on every call and keeps a SQL function from being inlined). That is safe only while
# each of them runs as its caller (not SECURITY DEFINER), is no trigger function, and but
# for now() (fully schema-qualified, it runs with its caller's rights) can be executed by
# the owner alone: then it runs only under the pinned path of a SECURITY DEFINER caller.
UNPINNED = {
    "runledger.now()",
    "runledger._raise(text,text,text,text)",
    "runledger._check_run_id(text)",
    "runledger._cap(text)",
    "runledger._check_text(text,text,integer,integer)",
    "runledger._check_worker_id(text)",
    "runledger._check_lease(interval)",
    "runledger._check_flow(text,text)",
    "runledger._check_json_depth(text,jsonb,integer)",
    "runledger._check_json_value_or_null(text,jsonb,integer)",
    "runledger._check_json_value(text,jsonb,integer)",
    "runledger._check_json_object_or_null(text,jsonb)",
    "runledger._check_json_object(text,jsonb)",
    "runledger._check_word(text,text,text[])",
    "runledger._parse_flows(text[])",
    "runledger._event(text,text,text,bigint,bigint,jsonb,timestamp with time zone)",
    "runledger._notify_queued(text,text)",
    "runledger._lock_run(text)",
    "runledger._lock_leased_run(text,uuid,bigint)",
    "runledger._lock_leased_run_at(text,uuid,bigint)",
    "runledger._lock_call(text,text)",
    "runledger._dispatch(text,text,text,bigint,bigint,timestamp with time zone)",
    "runledger._dispatch_each(runledger.runs,integer,text[],timestamp with time zone,bigint)",
    "runledger._timeline()",
    "runledger._token_floor()",
    "runledger._synchronous(text,text)",
    "runledger._note_commit_guarantee(text,timestamp with time zone,integer)",
    "runledger._note_timeline(text,timestamp with time zone)",
    "runledger._requeue_if_settled(runledger.runs,text,text,timestamp with time zone)",
    "runledger._lock_awaiting_call(text)",
    "runledger._prune_authorized()",
    "runledger._gone_sessions()",
    "runledger._claim(text,text[],interval,integer,boolean)",
    "runledger._register_worker(text,text,integer,text[],bigint,text,uuid,boolean,interval,text)",
    "runledger._sender_until(text,text,bigint,integer,timestamp with time zone)",
    "runledger._event_hash(bytea,bigint,text,timestamp with time zone,text,text,bigint,bigint,"
    "jsonb)",
    "runledger._checkpoint_digest(bytea,bigint,bigint,text)",
    # the events of one write in one INSERT
    "runledger._refuse_event_isolation(text)",
    "runledger._events(text,text,bigint,timestamp with time zone,text[],bigint[],jsonb[])",
    "runledger._event_rows(bytea,text,text,bigint,timestamp with time zone,text[],bigint[],"
    "jsonb[])",
    # the functions the CHECK constraints call, executable by PUBLIC (a
    # CHECK's function runs with the writer's rights); pure, every name schema-qualified
    "runledger._ck_runs_run_id(text)",
    "runledger._ck_runs_status(text)",
    "runledger._ck_runs_input_object(jsonb)",
    "runledger._ck_runs_state_object(jsonb)",
    "runledger._ck_runs_lease_complete(uuid,timestamp with time zone)",
    "runledger._ck_runs_running_has_lease(text,uuid)",
    "runledger._ck_runs_finished_at(text,timestamp with time zone)",
    "runledger._ck_runs_traceparent(text)",
    "runledger._ck_run_turns_turn(integer)",
    "runledger._ck_run_turns_calls_array(jsonb)",
    "runledger._ck_run_turns_record_object(jsonb)",
    "runledger._ck_run_turns_output_final(jsonb,jsonb)",
    "runledger._ck_run_calls_status(text)",
    "runledger._ck_run_calls_args_object(jsonb)",
    "runledger._ck_run_calls_attempts(integer)",
    "runledger._ck_run_calls_key(text,text,integer,text)",
    "runledger._ck_run_calls_approval(text)",
    "runledger._ck_run_calls_approval_status(text,text)",
    "runledger._ck_run_calls_approval_decided(text,text,timestamp with time zone,text)",
    "runledger._ck_run_events_hash(bytea)",
    # the functions the guard triggers' WHEN clauses call, the same way
    "runledger._tw_runs_guard(bigint,bigint,bigint,bigint)",
    "runledger._tw_runs_guard_columns(text,text,bigint,bigint,jsonb,jsonb,text,text,text,text,"
    "jsonb,jsonb)",
    "runledger._tw_run_calls_guard(text,integer,integer,text,text)",
}


def test_every_function_is_pinned_or_a_helper_only_pinned_code_reaches(
    conn: Conn,
) -> None:
    """Contract and trigger functions pin the path; the unpinned ones are the listed
    helpers, none SECURITY DEFINER, none a trigger, none granted (now() to the roles that
    had it); and nothing of the schema is executable by PUBLIC."""
    rows = conn.execute(
        """
        SELECT p.oid::regprocedure::text AS fn, p.proconfig, p.prosecdef,
               p.prorettype = 'trigger'::regtype AS is_trigger,
               p.proacl IS NULL OR EXISTS (
                   SELECT 1 FROM aclexplode(p.proacl) a
                   WHERE a.grantee = 0 AND a.privilege_type = 'EXECUTE') AS public_exec,
               ARRAY(SELECT a.grantee::regrole::text FROM aclexplode(p.proacl) a
                     WHERE a.grantee <> p.proowner ORDER BY 1) AS grantees
        FROM pg_proc p WHERE p.pronamespace = 'runledger'::regnamespace
        """
    ).fetchall()
    assert len(rows) >= len(CONTRACT)
    loose = {r["fn"]: r for r in rows if PINNED_SEARCH_PATH not in (r["proconfig"] or [])}
    assert set(loose) == UNPINNED
    assert [f for f, r in loose.items() if r["prosecdef"] or r["is_trigger"]] == []
    checks = {f for f in loose if f.startswith("runledger._ck_")}
    assert len(checks) == 20
    conditions = {f for f in loose if f.startswith("runledger._tw_")}
    assert len(conditions) == 3
    checks |= conditions
    granted = {f: r["grantees"] for f, r in loose.items() if r["grantees"] and f not in checks}
    assert granted == {"runledger.now()": [AUDITOR, OPERATOR, WORKER]}
    assert {r["fn"] for r in rows if r["public_exec"]} == checks


def test_worker_role_cannot_run_operator_functions(conn: Conn) -> None:
    for fn in CONTRACT:
        if fn.role != OPERATOR:
            continue
        oid = _proc(conn, fn)["oid"]
        row = conn.execute(
            "SELECT has_function_privilege('runledger_worker', %s::oid, 'EXECUTE') AS ok",
            (oid,),
        ).fetchone()
        assert row is not None and not row["ok"], f"runledger_worker can execute {fn.name}"
