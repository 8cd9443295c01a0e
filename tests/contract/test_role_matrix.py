"""Every table x role x statement, the pruning bypasses, and EXECUTE on every function.

Roles: the three runledger roles; a "DBA" role granted every table privilege of the
schema (``GRANT SELECT, INSERT, UPDATE, DELETE, TRUNCATE ON ALL TABLES IN SCHEMA``, as a
DBA would); the owner of the schema, its tables and functions (a non-superuser role here,
as the migrating role is in production: ownership is handed to it in the test database);
and a role with no grant at all (what PUBLIC may do). Each statement runs as that role
(``SET ROLE``): a refusal runs in autocommit, so a write that got through would commit,
and every row of every table is compared before and after; an allowed statement runs in a
transaction that is rolled back. Roles are cluster-wide: their names carry a random
suffix and they are dropped at the end of the test.
"""

from __future__ import annotations

import uuid
from collections.abc import Iterator
from contextlib import ExitStack
from dataclasses import dataclass
from typing import Any

import psycopg
import pytest
from psycopg.rows import dict_row

from .helpers import dispatched_call, finish, rows, submit, submit_and_claim

Conn = psycopg.Connection[Any]

WORKER, OPERATOR, AUDITOR = "runledger_worker", "runledger_operator", "runledger_auditor"
DBA, OWNER, NOBODY, SUPERUSER = "dba", "owner", "nobody", "superuser"
ROLES = (WORKER, OPERATOR, AUDITOR, DBA, OWNER, NOBODY)

TABLES = (
    "runs",
    "run_turns",
    "run_calls",
    "run_events",
    "workers",
    "settings",
    "alembic_version",
    "prune_authorizations",
    "timelines",
    "failover_runs",
)
JOURNAL = ("runs", "run_turns", "run_calls", "run_events")
FAILOVER_RECORD = ("timelines", "failover_runs")  # revision 0010: append-only, owner-written

# One statement of each kind per table; the writes are ones the wall lets through where
# it can (an UPDATE of a run's priority), so that what is refused is refused by privilege
# or by the invariant the wall names, never by a malformed statement.
STATEMENTS: dict[str, dict[str, str]] = {
    "runs": {
        "INSERT": "INSERT INTO runledger.runs (run_id, flow, flow_version, input, available_at, "
        "created_at, updated_at) VALUES ('m1', 'demo', '1', '{}', now(), now(), now())",
        "UPDATE": "UPDATE runledger.runs SET priority = priority + 1",
        "DELETE": "DELETE FROM runledger.runs",
        "TRUNCATE": "TRUNCATE runledger.runs CASCADE",
    },
    "run_turns": {
        "INSERT": "INSERT INTO runledger.run_turns (run_id, turn, calls, fencing_token, "
        "created_at) VALUES ('live', 1, '[]', 1, now())",
        "UPDATE": "UPDATE runledger.run_turns SET created_at = created_at",
        "DELETE": "DELETE FROM runledger.run_turns",
        "TRUNCATE": "TRUNCATE runledger.run_turns CASCADE",
    },
    "run_calls": {
        "INSERT": "INSERT INTO runledger.run_calls (run_id, turn, call_id, position, tool, "
        "args, idempotency_key) VALUES ('live', 0, 'm1', 1, 't', '{}', 'live:0:m1')",
        "UPDATE": "UPDATE runledger.run_calls SET resolution_note = 'checked'",
        "DELETE": "DELETE FROM runledger.run_calls",
        "TRUNCATE": "TRUNCATE runledger.run_calls",
    },
    "run_events": {
        "INSERT": "INSERT INTO runledger.run_events (run_id, at, kind) "
        "VALUES ('live', now(), 'forged')",
        "UPDATE": "UPDATE runledger.run_events SET kind = kind",
        "DELETE": "DELETE FROM runledger.run_events",
        "TRUNCATE": "TRUNCATE runledger.run_events",
    },
    "workers": {
        "INSERT": "INSERT INTO runledger.workers (worker_id, hostname, pid, flows, started_at, "
        "heartbeat_at) VALUES ('m1', 'h', 1, '{demo@1}', now(), now())",
        "UPDATE": "UPDATE runledger.workers SET heartbeat_at = heartbeat_at",
        "DELETE": "DELETE FROM runledger.workers",
        "TRUNCATE": "TRUNCATE runledger.workers",
    },
    "settings": {
        "INSERT": "INSERT INTO runledger.settings DEFAULT VALUES",
        "UPDATE": "UPDATE runledger.settings SET clock_offset = clock_offset + '1 hour'",
        "DELETE": "DELETE FROM runledger.settings",
        "TRUNCATE": "TRUNCATE runledger.settings",
    },
    "alembic_version": {
        "INSERT": "INSERT INTO runledger.alembic_version VALUES ('m1')",
        "UPDATE": "UPDATE runledger.alembic_version SET version_num = version_num",
        "DELETE": "DELETE FROM runledger.alembic_version",
        "TRUNCATE": "TRUNCATE runledger.alembic_version",
    },
    "prune_authorizations": {
        "INSERT": "INSERT INTO runledger.prune_authorizations VALUES (txid_current())",
        "UPDATE": "UPDATE runledger.prune_authorizations SET txid = txid",
        "DELETE": "DELETE FROM runledger.prune_authorizations",
        "TRUNCATE": "TRUNCATE runledger.prune_authorizations",
    },
    "timelines": {
        "INSERT": "INSERT INTO runledger.timelines (position, timeline, seen_at) "
        "VALUES (99, 1, now())",
        "UPDATE": "UPDATE runledger.timelines SET seen_by = seen_by",
        "DELETE": "DELETE FROM runledger.timelines",
        "TRUNCATE": "TRUNCATE runledger.timelines CASCADE",
    },
    "failover_runs": {
        "INSERT": "INSERT INTO runledger.failover_runs (run_id, position, status, "
        "fencing_token, turn, marked_calls) VALUES ('done', 1, 'queued', 0, 0, '{}')",
        "UPDATE": "UPDATE runledger.failover_runs SET turn = turn",
        "DELETE": "DELETE FROM runledger.failover_runs",
        "TRUNCATE": "TRUNCATE runledger.failover_runs",
    },
}
for _table, _statements in STATEMENTS.items():
    _statements["SELECT"] = f"SELECT * FROM runledger.{_table}"
KINDS = ("SELECT", "INSERT", "UPDATE", "DELETE", "TRUNCATE")

OK = "ok"
DENIED = "42501"  # insufficient_privilege
WALL = "RL007"
DUPLICATE = "23505"  # settings has one row: a second INSERT breaks settings_pkey


def expected(role: str, table: str, kind: str) -> str:
    """What ``role`` gets for ``kind`` on ``table``: the grants, then the wall."""
    if role == NOBODY:
        return DENIED
    if role in (WORKER, OPERATOR, AUDITOR):
        if kind != "SELECT":
            return DENIED
        # A worker reads alembic_version too (revision 0013): it checks the revision.
        readable = set(TABLES) - {"prune_authorizations"}
        return OK if table in readable else DENIED
    # DBA and owner hold every table privilege; the wall decides.
    if table in FAILOVER_RECORD and kind != "SELECT":
        return OK if (role, kind) == (OWNER, "INSERT") else WALL
    if table in JOURNAL and kind in ("DELETE", "TRUNCATE"):
        return WALL
    if table in ("run_turns", "run_events") and kind == "UPDATE":
        return WALL
    if table == "settings" and kind == "INSERT":
        return DUPLICATE
    if table == "prune_authorizations" and kind == "INSERT" and role == DBA:
        return WALL  # granted, yet refused: only the owner writes authorizations
    return OK


# -- the world: data and roles --------------------------------------------------------------


@dataclass
class World:
    admin: Conn
    names: dict[str, str]  # matrix role -> database role
    conns: dict[str, Conn]  # matrix role -> a session under that role (autocommit)


def snapshot(admin: Conn) -> dict[str, list[dict[str, Any]]]:
    return {t: rows(admin, f"SELECT * FROM runledger.{t} ORDER BY 1") for t in TABLES}


@pytest.fixture
def world(database_url: str, admin_conn: Conn, worker: Conn) -> Iterator[World]:
    # A running run with a turn, a dispatched call and events; a finished run; a worker.
    lease = submit_and_claim(worker, "live")
    dispatched_call(worker, lease)
    done = submit_and_claim(worker, "done")
    finish(worker, done, "succeeded")
    submit(worker, "waiting", flow="other")
    worker.execute("SELECT runledger.register_worker_v2('w1', 'host', 42, ARRAY['demo@1'], false)")
    # a failover's row for 'waiting' (as the superuser: past the owner-only check)
    admin_conn.execute(
        "INSERT INTO runledger.failover_runs (run_id, position, status, fencing_token, turn, "
        "marked_calls) VALUES ('waiting', 1, 'queued', 0, 0, '{}')"
    )

    suffix = uuid.uuid4().hex[:10]
    names = {r: r for r in (WORKER, OPERATOR, AUDITOR)}
    names |= {r: f"rl_{r}_{suffix}" for r in (DBA, OWNER, NOBODY)}
    admin = admin_conn
    for role in (DBA, OWNER, NOBODY):
        admin.execute(f"CREATE ROLE {names[role]} NOLOGIN")  # type: ignore[arg-type]
    dba, owner = names[DBA], names[OWNER]
    admin.execute(f"GRANT USAGE ON SCHEMA runledger TO {dba}")  # type: ignore[arg-type]
    admin.execute(
        "GRANT SELECT, INSERT, UPDATE, DELETE, TRUNCATE ON ALL TABLES IN SCHEMA runledger "  # type: ignore[arg-type]
        f"TO {dba}"
    )
    admin.execute(f"GRANT USAGE ON ALL SEQUENCES IN SCHEMA runledger TO {dba}")  # type: ignore[arg-type]
    # Hand the schema and everything in it to a role that is not a superuser.
    admin.execute(f"ALTER SCHEMA runledger OWNER TO {owner}")  # type: ignore[arg-type]
    for r in rows(
        admin,
        "SELECT c.oid::regclass::text AS name, c.relkind FROM pg_class c "
        "WHERE c.relnamespace = 'runledger'::regnamespace AND c.relkind IN ('r', 'v')",
    ):
        what = "VIEW" if r["relkind"] == "v" else "TABLE"
        admin.execute(f"ALTER {what} {r['name']} OWNER TO {owner}")  # type: ignore[arg-type]
    for r in rows(
        admin,
        "SELECT p.oid::regprocedure::text AS fn FROM pg_proc p "
        "WHERE p.pronamespace = 'runledger'::regnamespace",
    ):
        admin.execute(f"ALTER FUNCTION {r['fn']} OWNER TO {owner}")  # type: ignore[arg-type]
    assert not rows(admin, "SELECT 1 FROM pg_roles WHERE rolname = %s AND rolsuper", (owner,))

    with ExitStack() as stack:
        conns: dict[str, Conn] = {}
        for role in (*ROLES, SUPERUSER):
            conn = stack.enter_context(
                psycopg.connect(database_url, autocommit=True, row_factory=dict_row)
            )
            if role != SUPERUSER:
                conn.execute(f"SET ROLE {names[role]}")  # type: ignore[arg-type]
            conns[role] = conn
        names[SUPERUSER] = str(rows(admin, "SELECT current_user AS u")[0]["u"])
        try:
            yield World(admin, names, conns)
        finally:
            stack.close()
            admin.execute(f"REASSIGN OWNED BY {owner} TO CURRENT_USER")  # type: ignore[arg-type]
            for role in (DBA, OWNER, NOBODY):
                admin.execute(f"DROP OWNED BY {names[role]}")  # type: ignore[arg-type]
                admin.execute(f"DROP ROLE {names[role]}")  # type: ignore[arg-type]


def _attempt(w: World, role: str, statement: str, expect: str) -> str:
    """Run ``statement`` as ``role``; return 'ok' or the SQLSTATE, checking nothing changed."""
    conn = w.conns[role]
    before = snapshot(w.admin)
    try:
        if expect == OK:
            with conn.transaction(force_rollback=True):
                conn.execute(statement)  # type: ignore[arg-type]
        else:
            conn.execute(statement)  # type: ignore[arg-type]  # autocommit: would stay
        outcome = OK
    except psycopg.Error as exc:
        outcome = str(exc.sqlstate)
    assert snapshot(w.admin) == before, f"{role}: {statement} changed a row ({outcome})"
    return outcome


def test_every_table_role_and_statement(world: World) -> None:
    cases = [(role, table, kind) for role in ROLES for table in TABLES for kind in KINDS]
    assert len(cases) == 6 * 10 * 5
    got: dict[tuple[str, str, str], str] = {}
    for role, table, kind in cases:
        got[(role, table, kind)] = _attempt(
            world, role, STATEMENTS[table][kind], expected(role, table, kind)
        )
    wrong = {case: (outcome, expected(*case)) for case, outcome in got.items()}
    wrong = {case: pair for case, pair in wrong.items() if pair[0] != pair[1]}
    assert wrong == {}, "\n".join(f"{c}: got {g}, expected {e}" for c, (g, e) in wrong.items())
    # Not vacuous: each outcome occurs.
    assert set(got.values()) == {OK, DENIED, WALL, DUPLICATE}


def test_an_allowed_write_really_writes(world: World) -> None:
    """The rolled-back 'ok' cases above are real writes: inside their transaction the rows
    are there (a statement that silently did nothing would not show)."""
    conn = world.conns[DBA]
    for table, where, statement in (
        ("runs", "priority = 1", STATEMENTS["runs"]["UPDATE"]),
        ("run_events", "kind = 'forged'", STATEMENTS["run_events"]["INSERT"]),
        ("workers", "true", STATEMENTS["workers"]["DELETE"]),
    ):
        with conn.transaction(force_rollback=True):
            before = rows(conn, f"SELECT count(*) AS n FROM runledger.{table} WHERE {where}")
            cur = conn.execute(statement)  # type: ignore[arg-type]
            after = rows(conn, f"SELECT count(*) AS n FROM runledger.{table} WHERE {where}")
            assert cur.rowcount >= 1, statement
            assert before != after, statement
    owner = world.conns[OWNER]
    with owner.transaction(force_rollback=True):
        owner.execute(STATEMENTS["prune_authorizations"]["INSERT"])
        assert len(rows(owner, "SELECT * FROM runledger.prune_authorizations")) == 1


# -- the pruning bypasses -------------------------------------------------------------------

BYPASSES = {
    "SET LOCAL": "SET LOCAL runledger.pruning = 'on'",
    "SET": "SET runledger.pruning = 'on'",
    "set_config local": "SELECT set_config('runledger.pruning', 'on', true)",
    "set_config session": "SELECT set_config('runledger.pruning', 'on', false)",
    "forged authorization": "INSERT INTO runledger.prune_authorizations VALUES (txid_current())",
}
TARGETS = {
    "all events": "DELETE FROM runledger.run_events",
    "the running run": "DELETE FROM runledger.runs WHERE run_id = 'live'",
    "the finished run": "DELETE FROM runledger.runs WHERE run_id = 'done'",
    "calls": "DELETE FROM runledger.run_calls",
    "turns": "DELETE FROM runledger.run_turns",
}


def bypass_expected(role: str, bypass: str, target: str) -> str:
    if role in (WORKER, OPERATOR, AUDITOR, NOBODY):
        return DENIED  # no DELETE at all (and no INSERT on the authorization table)
    if bypass != "forged authorization":
        return WALL  # no setting opens the wall, for anyone
    if role == DBA:
        return WALL  # granted INSERT on the authorization table, refused by its guard
    # The owner and superusers can write an authorization (documented in docs/design.md,
    # "The pruning authorization"); even then a run that is not finished is not deleted.
    return WALL if target == "the running run" else OK


def test_no_session_setting_or_forged_authorization_opens_the_wall(world: World) -> None:
    got: dict[tuple[str, str, str], str] = {}
    for role in (*ROLES, SUPERUSER):
        conn = world.conns[role]
        for bypass, opener in BYPASSES.items():
            for target, statement in TARGETS.items():
                expect = bypass_expected(role, bypass, target)
                before = snapshot(world.admin)
                try:
                    # Committed if it gets through, unless it is the documented way in.
                    with conn.transaction(force_rollback=expect == OK):
                        conn.execute(opener)  # type: ignore[arg-type]
                        cur = conn.execute(statement)  # type: ignore[arg-type]
                        assert cur.rowcount >= 1, (role, bypass, target)
                    outcome = OK
                except psycopg.Error as exc:
                    outcome = str(exc.sqlstate)
                conn.execute("RESET runledger.pruning")
                assert snapshot(world.admin) == before, (role, bypass, target, outcome)
                got[(role, bypass, target)] = outcome
    assert len(got) == 7 * 5 * 5
    wrong = {c: (o, bypass_expected(*c)) for c, o in got.items() if o != bypass_expected(*c)}
    assert wrong == {}, "\n".join(f"{c}: got {g}, expected {e}" for c, (g, e) in wrong.items())
    running = rows(world.admin, "SELECT status FROM runledger.runs WHERE run_id = 'live'")
    assert running == [{"status": "running"}]


def test_prune_runs_is_the_way_for_the_roles_granted_it(world: World) -> None:
    """The door the matrix shows shut is open through prune_runs, for operator and owner."""
    for role in (OPERATOR, OWNER):
        conn = world.conns[role]
        with conn.transaction(force_rollback=True):
            pruned = rows(conn, "SELECT runledger.prune_runs('infinity', false) AS n")
            assert pruned == [{"n": 1}], role
            left = rows(conn, "SELECT run_id FROM runledger.runs ORDER BY 1")
            assert left == [{"run_id": "live"}, {"run_id": "waiting"}], role


# -- EXECUTE on every function ---------------------------------------------------------------

WORKER_FUNCTIONS = {
    "now",
    "submit_run",
    "submit_run_v2",
    "claim_runs_v4",
    "renew_leases",
    "checkpoint",
    "record_turn_v4",
    "finish_and_claim",  # revision 0026
    "dispatch_call",
    "complete_call",
    "complete_call_v2",
    "complete_calls",
    "finish_run",
    "release_lease",
    "release_stale_lease",  # revision 0.2
    "report_stale_write",
    "call_sender",  # revision 0031
    "release_call",  # revision 0031
    "register_worker_v2",
    "heartbeat_listener",
    "heartbeat_worker",
    "checkpoint_events",  # revision 0016
}
OPERATOR_FUNCTIONS = {
    "now",
    "submit_run",
    "submit_run_v2",
    "resolve_call",
    "approve_call",
    "deny_call",
    "cancel_run",
    "retry_run",
    "prune_runs",
    "prune_runs_v2",
    "prune_records",
}


def may_execute(role: str, name: str) -> bool:
    """The grants of 08_roles.sql; helpers and trigger functions belong to the owner only,
    but for the functions the CHECK constraints and the guard triggers' WHEN clauses call
    (every writer needs them)."""
    if role == OWNER:
        return True
    if name.startswith("_ck_"):  # revision 0027: what the CHECKs call, PUBLIC's (pure)
        return True
    if name.startswith("_tw_"):  # revision 0029: what the guard triggers' WHEN calls, as well
        return True
    if role == AUDITOR:
        return name == "now"  # revision 0012: the clock, and no other function
    if name.startswith("_") or role in (DBA, NOBODY):
        return False
    if role == WORKER:
        return name in WORKER_FUNCTIONS
    return name in WORKER_FUNCTIONS | OPERATOR_FUNCTIONS  # the operator is a worker too


def test_execute_on_every_function_for_every_role(world: World) -> None:
    functions = rows(
        world.admin,
        "SELECT p.oid::int AS oid, p.proname, p.oid::regprocedure::text AS signature, "
        "       p.prorettype = 'trigger'::regtype AS is_trigger, p.pronargs "
        "FROM pg_proc p WHERE p.pronamespace = 'runledger'::regnamespace ORDER BY 3",
    )
    public = {f["proname"] for f in functions if not f["proname"].startswith("_")}
    assert public == WORKER_FUNCTIONS | OPERATOR_FUNCTIONS, "a public function is not listed"
    assert any(f["is_trigger"] for f in functions) and len(functions) > len(public)

    wrong: list[str] = []
    calls = 0
    for role in ROLES:
        for f in functions:
            may = may_execute(role, f["proname"])
            has = rows(
                world.admin,
                "SELECT has_function_privilege(%s, %s::oid, 'EXECUTE') AS ok",
                (world.names[role], f["oid"]),
            )[0]["ok"]
            if has != may:
                wrong.append(f"{role} {f['signature']}: may execute {has}, expected {may}")
            if may:
                continue
            # Refused before the body runs (NULL arguments: nothing could be written).
            nulls = ", ".join(f"NULL::{a}" for a in _arg_types(world.admin, f["oid"]))
            before = snapshot(world.admin)
            try:
                world.conns[role].execute(f"SELECT runledger.{f['proname']}({nulls})")  # type: ignore[arg-type]
                wrong.append(f"{role} {f['signature']}: the call was accepted")
            except psycopg.Error as exc:
                if exc.sqlstate != DENIED:
                    wrong.append(f"{role} {f['signature']}: {exc.sqlstate} {exc}")
            calls += 1
            assert snapshot(world.admin) == before, (role, f["signature"])
    assert wrong == [], "\n".join(wrong)
    assert calls > 100


def _arg_types(admin: Conn, oid: int) -> list[str]:
    found = rows(
        admin,
        "SELECT format_type(t, NULL) AS t FROM pg_proc p, unnest(p.proargtypes::oid[]) "
        "WITH ORDINALITY AS a(t, n) WHERE p.oid = %s ORDER BY n",
        (oid,),
    )
    return [str(r["t"]) for r in found]
