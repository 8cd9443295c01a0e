"""The hot path's statements sent without a cursor (runledger.db.wire): the values they
carry arrive as through psycopg's cursor, refusals come back typed, and a session that
lost its prepared statements or its connection recovers."""

from __future__ import annotations

import datetime as dt
import uuid
from typing import Any

import psycopg
import pytest

from runledger import errors
from runledger.db import wire
from runledger.db.rows import as_stored
from runledger.db.statements import COMPLETE_AND_DISPATCH, RECORD_TURN
from runledger.db.store import Store

from .helpers import rows

Conn = psycopg.Connection[Any]
LEASE = dt.timedelta(seconds=30)


async def _claimed(store: Any, run_id: str) -> Any:
    await store.worker.submit_run(run_id, "demo", "1", {})
    [(c, _)] = await store.worker.claim_runs("w1", ["demo@1"], LEASE, 1)
    return c


async def test_values_arrive_as_sent(store: Any, admin_conn: Conn) -> None:
    c = await _claimed(store, "w-vals")
    # quotes, braces, backslashes, commas, non-ASCII and a NUL-free control character in
    # JSON; keys that need escaping; a float jsonb keeps as an integer
    args = {'q"u\\o,te{}': 'é\t"x"', "n": [1.5, 1e100, None, True]}
    calls = [
        {"call_id": "c1", "tool": "create_ticket", "args": args},
        {"call_id": "c2", "tool": "create_ticket", "args": {}},
    ]
    version, attempts = await store.worker.record_turn(
        "w-vals", c.lease_id, c.fencing_token, 0, calls, expected_version=0, dispatch=["c1"]
    )
    assert (version, attempts) == (0, (1,))
    [turn] = rows(admin_conn, "SELECT calls FROM runledger.run_turns WHERE run_id = 'w-vals'")
    assert turn["calls"][0]["args"] == as_stored(args)
    attempt = await store.worker.complete_and_dispatch(
        "w-vals",
        c.lease_id,
        c.fencing_token,
        "w-vals:0:c1",
        "succeeded",
        {"text": "ünïcødé 🎉", "list": [{}, []]},
        {"receipt": 'x"y'},
        next_key="w-vals:0:c2",
        next_attempts_seen=0,
    )
    assert attempt == 1
    [call] = rows(
        admin_conn,
        "SELECT result, receipt FROM runledger.run_calls WHERE idempotency_key = 'w-vals:0:c1'",
    )
    assert call["result"] == {"text": "ünïcødé 🎉", "list": [{}, []]}
    assert call["receipt"] == {"receipt": 'x"y'}


@pytest.mark.parametrize("bad", ['a"b', "x}y", "p,q", "back\\slash", "NULL", ""])
async def test_a_hostile_array_element_is_one_element(store: Any, bad: str) -> None:
    """The text[] of call ids to dispatch is quoted element by element: an id with the
    array syntax in it is refused by name, not split or read as NULL."""
    c = await _claimed(store, "w-arr")
    calls = [{"call_id": "c1", "tool": "create_ticket", "args": {}}]
    with pytest.raises(errors.InvalidInput) as refused:
        await store.worker.record_turn(
            "w-arr", c.lease_id, c.fencing_token, 0, calls, expected_version=0, dispatch=[bad]
        )
    assert f"call {bad} to dispatch is not a call of turn 0" in str(refused.value)


async def test_a_refusal_is_typed_with_its_sqlstate(store: Any) -> None:
    c = await _claimed(store, "w-stale")
    calls = [{"call_id": "c1", "tool": "create_ticket", "args": {}}]
    with pytest.raises(errors.LeaseLost) as lost:
        await store.worker.record_turn(
            "w-stale", uuid.uuid4(), c.fencing_token, 0, calls, expected_version=0
        )
    assert lost.value.sqlstate == "RL001"
    assert "is not the current lease" in str(lost.value)


async def test_statements_are_prepared_again_after_discard_all(database_url: str) -> None:
    async with await psycopg.AsyncConnection.connect(database_url, autocommit=True) as conn:
        probe = wire.Prepared("test_probe", "SELECT $1::text || '!' AS x, $2::int[] AS a", 2)
        assert await wire.execute(conn, probe, ["hi", [1, 2]]) == [{"x": "hi!", "a": [1, 2]}]
        await conn.execute("DISCARD ALL")
        assert await wire.execute(conn, probe, ["again", []]) == [{"x": "again!", "a": []}]
        with pytest.raises(TypeError):
            await wire.execute(conn, probe, ["one"])


async def test_a_connection_that_never_prepares_sends_each_statement_unnamed(
    database_url: str,
) -> None:
    """psycopg's ``prepare_threshold=None`` (a transaction pooler's connection: a named
    statement would be another client's server session's next time) holds for the hot
    path's statements too: the same rows and refusals, nothing left prepared."""
    async with await psycopg.AsyncConnection.connect(
        database_url, autocommit=True, prepare_threshold=None
    ) as conn:
        probe = wire.Prepared("test_unnamed", "SELECT $1::text || '!' AS x, $2::int[] AS a", 2)
        for _ in range(3):
            assert await wire.execute(conn, probe, ["hi", [1, 2]]) == [{"x": "hi!", "a": [1, 2]}]
        bad = wire.Prepared("test_unnamed_bad", "SELECT 1 / $1::int AS n", 1)
        with pytest.raises(psycopg.errors.DivisionByZero):
            await wire.execute(conn, bad, [0])
        assert await wire.execute(conn, bad, [1]) == [{"n": 1}]
        cur = await conn.execute("SELECT count(*) FROM pg_prepared_statements")
        assert await cur.fetchone() == (0,)


async def test_a_store_told_of_a_transaction_pooler_prepares_nothing(database_url: str) -> None:
    """``Store.connect(pooler="transaction")``: its pool's connections never prepare, by
    psycopg or by the hot path; said, not probed (``reach_why`` empty). Found out
    (``auto``) on a direct connection: ``direct``, and prepared as before."""
    told = await Store.connect(database_url, max_size=1, pooler="transaction")
    try:
        assert (told.executor.reach, told.executor.reach_why) == ("transaction", "")
        for n in range(7):  # past psycopg's prepare_threshold (5)
            await told.worker.submit_run(f"tx-{n}", "demo", "1", {})
        await told.worker.claim_runs("w1", ["demo@1"], LEASE, 0)
        # the one connection of the pool, the session every statement above went through
        assert await told.executor.read("SELECT name FROM pg_prepared_statements", ()) == []
    finally:
        await told.close()
    found = await Store.connect(database_url, max_size=1)
    try:
        assert found.executor.reach == "direct" and "client port" in found.executor.reach_why
        await found.worker.claim_runs("w1", ["demo@1"], LEASE, 0)
        prepared = await found.executor.read("SELECT name FROM pg_prepared_statements", ())
        assert {"name": "rl_claim_runs_v4"} in prepared
    finally:
        await found.close()


async def test_a_dropped_connection_is_a_connection_error(database_url: str) -> None:
    admin = await psycopg.AsyncConnection.connect(database_url, autocommit=True)
    async with admin, await psycopg.AsyncConnection.connect(database_url, autocommit=True) as conn:
        probe = wire.Prepared("test_gone", "SELECT $1::int + 1 AS n", 1)
        assert await wire.execute(conn, probe, [1]) == [{"n": 2}]
        await admin.execute("SELECT pg_terminate_backend(%s)", (conn.info.backend_pid,))
        with pytest.raises(psycopg.OperationalError):
            await wire.execute(conn, probe, [1])


async def test_the_hot_statements_name_their_parameters() -> None:
    assert RECORD_TURN.nparams == 11 and RECORD_TURN.sql.count("$") == 11
    assert COMPLETE_AND_DISPATCH.nparams == 8 and COMPLETE_AND_DISPATCH.sql.count("$") == 8
