"""Revision 0029: the WHEN of each guard trigger that the contract functions' UPDATEs fire
calls a PL/pgSQL function whose body is the condition as before (``runledger._tw_*``): the
same answer for every combination of values, NULL included. Its body is parsed with the
writer's search path, so every operator in it is schema-qualified: a writer who puts its
own ``<``, ``<>``, ``=`` or ``+`` first on its path is still refused by the guard (RL007)."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import psycopg
import pytest

from .helpers import call, complete, dispatch, key, record_turn, scalar, submit_and_claim
from .test_batched_events import checkpoint

Conn = psycopg.Connection[Any]

# (operator, left, right, what it answers): never true, or always (jsonb =: "no change")
HOSTILE = [
    ("<", "bigint", "bigint", "false"),
    ("<", "integer", "integer", "false"),
    (">", "bigint", "bigint", "false"),
    ("<>", "text", "text", "false"),
    ("=", "text", "text", "false"),
    ("=", "jsonb", "jsonb", "true"),
]


@pytest.fixture
def hostile(admin_conn: Conn) -> Iterator[Conn]:
    """A session whose search path starts with a schema where the comparisons the guards'
    conditions make answer wrong (``HOSTILE``) and ``bigint + integer`` adds 100."""
    admin_conn.execute("CREATE SCHEMA evil")
    for i, (op, left, right, answer) in enumerate(HOSTILE):
        admin_conn.execute(
            f"CREATE FUNCTION evil.f{i}({left}, {right}) RETURNS boolean LANGUAGE sql"
            f" IMMUTABLE AS 'SELECT {answer}'"
        )
        admin_conn.execute(
            f"CREATE OPERATOR evil.{op} (LEFTARG = {left}, RIGHTARG = {right},"
            f" FUNCTION = evil.f{i})"
        )
    admin_conn.execute(
        "CREATE FUNCTION evil.plus(bigint, integer) RETURNS bigint LANGUAGE sql IMMUTABLE"
        " AS 'SELECT $1 OPERATOR(pg_catalog.+) $2 OPERATOR(pg_catalog.+) 100'"
    )
    admin_conn.execute(
        "CREATE OPERATOR evil.+ (LEFTARG = bigint, RIGHTARG = integer, FUNCTION = evil.plus)"
    )
    admin_conn.execute("SET search_path = evil, pg_catalog, runledger, public")
    assert scalar(admin_conn, "SELECT 1::bigint < 2::bigint") is False  # really hostile
    assert scalar(admin_conn, "SELECT 1::bigint + 1") == 102
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


RUN = "WHERE run_id OPERATOR(pg_catalog.=) 'r1'"
DONE = "WHERE idempotency_key OPERATOR(pg_catalog.=) 'r1:0:c1'"  # succeeded
SENT = "WHERE idempotency_key OPERATOR(pg_catalog.=) 'r1:1:c2'"  # dispatched, attempts 1


@pytest.mark.parametrize(
    ("statement", "message"),
    [
        (
            f"UPDATE runledger.runs SET fencing_token = fencing_token - 1 {RUN}",
            "fencing_token of run r1 cannot decrease",
        ),
        (
            f"UPDATE runledger.runs SET state_version = state_version"
            f" OPERATOR(pg_catalog.+) 2 {RUN}",
            "state_version of run r1 moves by one at a time",
        ),
        (f"UPDATE runledger.runs SET run_id = 'r2' {RUN}", "run id r1 cannot change"),
        (
            f"UPDATE runledger.runs SET state = '{{\"x\": 2}}' {RUN}",
            "a change of state on run r1 must bump state_version by exactly one",
        ),
        (
            f"UPDATE runledger.run_calls SET attempts = 0 {SENT}",
            "attempts of call r1:1:c2 cannot decrease",
        ),
        (
            f"UPDATE runledger.run_calls SET status = 'failed' {DONE}",
            "call r1:0:c1 succeeded; its result and receipt cannot be overwritten",
        ),
    ],
)
def test_a_guard_refuses_under_a_hostile_search_path(
    worker: Conn, admin_conn: Conn, hostile: Conn, statement: str, message: str
) -> None:
    """A run with a checkpointed state, a succeeded call and a dispatched one."""
    lease = submit_and_claim(worker)
    record_turn(worker, lease, 0, [call("c1")])
    dispatch(worker, lease, key("r1", 0, "c1"))
    complete(worker, lease, key("r1", 0, "c1"), "succeeded", {"ok": True})
    checkpoint(worker, lease, 0, {"x": 1})
    record_turn(worker, lease, 1, [call("c2")])
    dispatch(worker, lease, key("r1", 1, "c2"))
    with pytest.raises(psycopg.Error) as caught:
        hostile.execute(statement)
    assert caught.value.sqlstate == "RL007"
    assert caught.value.diag.message_primary == message


# -- the functions and the conditions they replace, over every case ---------------------

BIGINTS = ["NULL", "1", "2", "3", "4"]
TEXTS = ["NULL", "'succeeded'", "'failed'"]
JSONS = ["NULL", "'{}'::jsonb", "'{\"a\": 1}'::jsonb"]


def _same(admin: Conn, function: str, condition: str, columns: dict[str, list[str]]) -> int:
    """How many combinations of ``columns``' values were compared: each must give the
    function's answer IS NOT DISTINCT FROM the old inline condition's."""
    names = list(columns)
    values = " CROSS JOIN ".join(
        f"(VALUES {', '.join(f'({v})' for v in columns[n])}) AS t{i}({n})"
        for i, n in enumerate(names)
    )
    row = admin.execute(
        f"SELECT count(*), count(*) FILTER (WHERE {function} IS DISTINCT FROM ({condition}))"
        f" FROM {values}"
    ).fetchone()
    assert row is not None
    total, different = row
    assert different == 0, f"{function}: {different} of {total} cases differ"
    return int(total)


def test_the_runs_guard_condition_is_the_old_one(admin_conn: Conn) -> None:
    n = _same(
        admin_conn,
        "runledger._tw_runs_guard(ot, nt, ov, nv)",
        "nt < ot OR nv < ov OR nv > ov + 1",
        {f: [f"{v}::bigint" for v in BIGINTS] for f in ("ot", "nt", "ov", "nv")},
    )
    assert n == 5**4


def test_the_runs_columns_condition_is_the_old_one(admin_conn: Conn) -> None:
    n = _same(
        admin_conn,
        "runledger._tw_runs_guard_columns(orun, nrun, ov, nv, os, ns, 'f', 'f', '1', '1', oi, ni)",
        "nrun <> orun OR (nv <> ov + 1 AND ns IS DISTINCT FROM os) OR ni <> oi",
        {
            "orun": ["'r1'::text"],
            "nrun": ["NULL::text", "'r1'", "'r2'"],
            "ov": [f"{v}::bigint" for v in BIGINTS],
            "nv": [f"{v}::bigint" for v in BIGINTS],
            "os": JSONS,
            "ns": JSONS,
            "oi": ["'{}'::jsonb"],
            "ni": JSONS,
        },
    )
    assert n == 3 * 5 * 5 * 3 * 3 * 3
    _same(
        admin_conn,
        "runledger._tw_runs_guard_columns('r1', 'r1', 1, 2, NULL, NULL, of, nf, ofv, nfv,"
        " '{}', '{}')",
        "nf <> of OR nfv <> ofv",
        {f: ["NULL::text", "'a'", "'b'"] for f in ("of", "nf", "ofv", "nfv")},
    )


def test_the_run_calls_guard_condition_is_the_old_one(admin_conn: Conn) -> None:
    n = _same(
        admin_conn,
        "runledger._tw_run_calls_guard(os, oa, na, oapp, napp)",
        "os = 'succeeded' OR na < oa OR oapp IS NOT NULL OR napp IS NOT NULL",
        {
            "os": [f"{v}::text" for v in TEXTS],
            "oa": ["NULL::integer", "0", "1", "2"],
            "na": ["NULL::integer", "0", "1", "2"],
            "oapp": ["NULL::text", "'pending'"],
            "napp": ["NULL::text", "'approved'"],
        },
    )
    assert n == 3 * 4 * 4 * 2 * 2
