"""Revision 0029: the WHEN of each guard trigger that the contract functions' UPDATEs fire
calls a PL/pgSQL function whose body is the condition as before (``runledger._tw_*``). It
runs with the writer's search path, so every operator in it is schema-qualified: a writer
who puts its own ``<``, ``<>`` or ``=`` first on its path is still refused by the guard
(RL007), and the functions' own writes still pass."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import psycopg
import pytest

from .helpers import call, complete, dispatch, key, record_turn, scalar, submit_and_claim

Conn = psycopg.Connection[Any]

NEVER = {
    "<": ("bigint", "bigint"),
    ">": ("bigint", "bigint"),
    "<>": ("text", "text"),
    "=": ("jsonb", "jsonb"),
}


@pytest.fixture
def hostile(admin_conn: Conn) -> Iterator[Conn]:
    """A session whose search path starts with a schema where ``<`` and ``>`` on bigint
    and ``<>`` on text are never true and ``=`` on jsonb always is."""
    admin_conn.execute("CREATE SCHEMA evil")
    for op, (left, right) in NEVER.items():
        answer = "true" if op == "=" else "false"
        name = {"<": "lt", ">": "gt", "<>": "ne", "=": "eq"}[op]
        admin_conn.execute(
            f"CREATE FUNCTION evil.{name}({left}, {right}) RETURNS boolean LANGUAGE sql"
            f" IMMUTABLE AS 'SELECT {answer}'"
        )
        admin_conn.execute(
            f"CREATE OPERATOR evil.{op} (LEFTARG = {left}, RIGHTARG = {right},"
            f" FUNCTION = evil.{name})"
        )
    admin_conn.execute("SET search_path = evil, pg_catalog, runledger, public")
    assert scalar(admin_conn, "SELECT 1::bigint < 2::bigint") is False  # really hostile
    try:
        yield admin_conn
    finally:
        admin_conn.execute("RESET search_path")
        admin_conn.execute("DROP SCHEMA evil CASCADE")


def test_each_guard_trigger_the_hot_path_fires_calls_its_condition_function(
    admin_conn: Conn,
) -> None:
    defs = {
        r[0]: r[1]
        for r in admin_conn.execute(
            "SELECT tgname, pg_get_triggerdef(oid) FROM pg_trigger"
            " WHERE tgname IN ('tg_runs_guard', 'tg_runs_guard_columns', 'tg_run_calls_guard')"
        ).fetchall()
    }
    assert set(defs) == {"tg_runs_guard", "tg_runs_guard_columns", "tg_run_calls_guard"}
    for name, definition in defs.items():
        assert f"WHEN (runledger._tw_{name[3:]}(" in definition, definition


@pytest.mark.parametrize(
    ("statement", "message"),
    [
        (
            "UPDATE runledger.runs SET fencing_token = fencing_token - 1 WHERE run_id = 'r1'",
            "fencing_token of run r1 cannot decrease",
        ),
        (
            "UPDATE runledger.runs SET state_version = state_version + 2 WHERE run_id = 'r1'",
            "state_version of run r1 moves by one at a time",
        ),
        (
            "UPDATE runledger.runs SET run_id = 'r2' WHERE run_id = 'r1'",
            "run id r1 cannot change",
        ),
        (
            "UPDATE runledger.runs SET state = '{\"x\": 1}' WHERE run_id = 'r1'",
            "a change of state on run r1 must bump state_version by exactly one",
        ),
        (
            "UPDATE runledger.run_calls SET attempts = attempts - 1"
            " WHERE idempotency_key = 'r1:0:c1'",
            "attempts of call r1:0:c1 cannot decrease",
        ),
        (
            "UPDATE runledger.run_calls SET status = 'failed' WHERE idempotency_key = 'r1:0:c1'",
            "call r1:0:c1 succeeded; its result and receipt cannot be overwritten",
        ),
    ],
)
def test_a_guard_refuses_under_a_hostile_search_path(
    worker: Conn, admin_conn: Conn, hostile: Conn, statement: str, message: str
) -> None:
    lease = submit_and_claim(worker)
    record_turn(worker, lease, 0, [call("c1")])
    dispatch(worker, lease, key("r1", 0, "c1"))
    complete(worker, lease, key("r1", 0, "c1"), "succeeded", {"ok": True})
    with pytest.raises(psycopg.Error) as caught:
        hostile.execute(statement)
    assert caught.value.sqlstate == "RL007"
    assert caught.value.diag.message_primary == message


def test_the_functions_own_writes_pass_the_guards(worker: Conn, admin_conn: Conn) -> None:
    lease = submit_and_claim(worker)
    record_turn(worker, lease, 0, [call("c1")])
    dispatch(worker, lease, key("r1", 0, "c1"))
    complete(worker, lease, key("r1", 0, "c1"), "succeeded", {"ok": True})
    row = admin_conn.execute(
        "SELECT status FROM runledger.run_calls WHERE idempotency_key = 'r1:0:c1'"
    ).fetchone()
    assert row is not None and row[0] == "succeeded"
