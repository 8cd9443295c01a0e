"""Revision 0027: each CHECK constraint of runs, run_turns, run_calls and run_events calls a
PL/pgSQL function whose body is its expression. The function runs with the writer's
search path, so every name in it is schema-qualified: a writer who puts its own ``=``
or ``jsonb_typeof`` first on its path still gets the constraint's refusal, by name."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import psycopg
import pytest

from .helpers import submit

Conn = psycopg.Connection[Any]


@pytest.fixture
def hostile(admin_conn: Conn) -> Iterator[Conn]:
    """A session whose search path starts with a schema where ``=`` on text is always
    true and ``jsonb_typeof`` always says 'object'."""
    admin_conn.execute("CREATE SCHEMA evil")
    admin_conn.execute(
        "CREATE FUNCTION evil.yes(text, text) RETURNS boolean LANGUAGE sql IMMUTABLE"
        " AS 'SELECT true'"
    )
    admin_conn.execute(
        "CREATE OPERATOR evil.= (LEFTARG = text, RIGHTARG = text, FUNCTION = evil.yes)"
    )
    admin_conn.execute(
        "CREATE FUNCTION evil.jsonb_typeof(jsonb) RETURNS text LANGUAGE sql IMMUTABLE"
        " AS $$ SELECT 'object' $$"
    )
    admin_conn.execute("SET search_path = evil, pg_catalog, runledger, public")
    (same,) = admin_conn.execute("SELECT 'a'::text = 'b'::text").fetchone() or (None,)
    assert same is True  # the path really is hostile
    try:
        yield admin_conn
    finally:
        admin_conn.execute("RESET search_path")
        admin_conn.execute("DROP SCHEMA evil CASCADE")


@pytest.mark.parametrize(
    ("constraint", "statement"),
    [
        ("ck_runs_status", "UPDATE runledger.runs SET status = 'bogus' WHERE run_id = 'r1'"),
        (
            "ck_runs_running_has_lease",
            "UPDATE runledger.runs SET status = 'running' WHERE run_id = 'r1'",
        ),
        (
            "ck_run_turns_calls_array",
            "INSERT INTO runledger.run_turns (run_id, turn, calls, fencing_token, created_at)"
            " VALUES ('r1', 0, '{}'::jsonb, 1, now())",
        ),
    ],
)
def test_a_check_refuses_under_a_hostile_search_path(
    admin_conn: Conn, hostile: Conn, constraint: str, statement: str
) -> None:
    submit(admin_conn, "r1")  # queued: no lease
    with pytest.raises(psycopg.errors.CheckViolation) as caught:
        hostile.execute(statement)
    assert caught.value.diag.constraint_name == constraint
