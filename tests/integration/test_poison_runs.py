"""Poison runs never jam a worker: a run whose JSON Python cannot decode is dealt with
alone, and the other runs of its claim batch go on.

Such rows cannot be written any more once the database enforces its nesting limit; an
old release could write them. :func:`plant` writes them as that release would have
left them: directly, as superuser, with the tables' own triggers off for that one
transaction (restored to their exact mode, ``ENABLE ALWAYS`` included).
"""

from __future__ import annotations

import datetime as dt
from typing import Any, LiteralString

import psycopg
import pytest
import pytest_asyncio
from psycopg import sql

from runledger.db import decode
from runledger.flows import Flow, ToolCall
from runledger.worker.executor import Limits
from runledger.worker.runs import MAX_PAUSE_REASON, in_flight_reason, unknown_call_reason
from tests.integration.conftest import Db, Recorder, StartWorker

DEPTH = 2000  # far past Python's recursion limit; PostgreSQL stores it
DEEP = '{"a":' * DEPTH + "1" + "}" * DEPTH
TOO_DEEP = "nested too deeply for Python to decode"
LIMITS = Limits(backoff=0.01, max_backoff=0.05, max_stalled_claims=2)

_MODE = {"A": "ENABLE ALWAYS TRIGGER", "O": "ENABLE TRIGGER", "R": "ENABLE REPLICA TRIGGER"}


def plant(url: str, statement: LiteralString, *params: Any) -> None:
    """Run ``statement`` as superuser with the user triggers of the run tables disabled
    for this one transaction, then restore each trigger's mode."""
    with psycopg.connect(url) as conn:  # one transaction, committed on exit
        triggers = conn.execute(
            "SELECT c.relname, t.tgname, t.tgenabled FROM pg_trigger t"
            " JOIN pg_class c ON c.oid = t.tgrelid"
            " JOIN pg_namespace n ON n.oid = c.relnamespace"
            " WHERE n.nspname = 'runledger' AND NOT t.tgisinternal"
            " AND c.relname IN ('runs', 'run_turns', 'run_calls')"
        ).fetchall()
        for table, name, _ in triggers:
            conn.execute(
                sql.SQL("ALTER TABLE runledger.{} DISABLE TRIGGER {}").format(
                    sql.Identifier(table), sql.Identifier(name)
                )
            )
        conn.execute(statement, params)
        for table, name, mode in triggers:
            conn.execute(
                sql.SQL("ALTER TABLE runledger.{} {} {}").format(
                    sql.Identifier(table), sql.SQL(_MODE[mode]), sql.Identifier(name)
                )
            )


def plant_run(
    url: str, run_id: str, flow: str, *, input: str = "{}", state: str | None = None
) -> None:
    """A queued run row as ``submit_run`` (and, for ``state``, a checkpoint) left it."""
    plant(
        url,
        "INSERT INTO runledger.runs (run_id, flow, flow_version, input, state, state_version,"
        " available_at, created_at, updated_at)"
        " VALUES (%s, %s, '1', %s::jsonb, %s::jsonb, %s, runledger.now(), runledger.now(),"
        " runledger.now())",
        run_id,
        flow,
        input,
        state,
        0 if state is None else 1,
    )
    plant(
        url,
        "INSERT INTO runledger.run_events (run_id, at, kind, detail)"
        " VALUES (%s, runledger.now(), 'submitted', '{}')",
        run_id,
    )


def plant_call(
    url: str,
    run_id: str,
    *,
    status: str,
    args: str = "{}",
    result: str | None = None,
    turn_calls: str | None = None,
    token: int = 0,
) -> str:
    """Turn 0 with one call ``c0`` of tool ``act``, as ``record_turn`` (and
    ``dispatch_call``/``complete_call`` under ``token``) left it; returns its key."""
    key = f"{run_id}:0:c0"
    calls = turn_calls or '[{"call_id": "c0", "tool": "act", "args": ' + args + "}]"
    plant(
        url,
        "INSERT INTO runledger.run_turns (run_id, turn, calls, fencing_token, created_at)"
        " VALUES (%s, 0, %s::jsonb, %s, runledger.now())",
        run_id,
        calls,
        token,
    )
    if turn_calls is not None:
        return key  # a turn without its call rows
    sent = status != "planned"
    plant(
        url,
        "INSERT INTO runledger.run_calls (run_id, turn, call_id, position, tool, args,"
        " idempotency_key, status, attempts, result, dispatched_token, dispatched_by,"
        " dispatched_at, completed_token, completed_by, completed_at)"
        " VALUES (%s, 0, 'c0', 0, 'act', %s::jsonb, %s, %s, %s, %s::jsonb,"
        " %s, %s, CASE WHEN %s THEN runledger.now() END,"
        " %s, %s, CASE WHEN %s THEN runledger.now() END)",
        run_id,
        args,
        key,
        status,
        1 if sent else 0,
        result,
        token if sent else None,
        "ghost" if sent else None,
        sent,
        token if status in ("succeeded", "failed") else None,
        "ghost" if status in ("succeeded", "failed") else None,
        status in ("succeeded", "failed"),
    )
    return key


@pytest_asyncio.fixture
async def db(db: Db) -> Db:
    """The test's reads decode JSON as the store does: ``SELECT *`` of a poison run."""
    await decode.configure(db.conn)
    return db


def _flow(rec: Recorder, name: str = "poison") -> Flow:
    flow = Flow(name, "1")

    @flow.tool(safety="idempotent")
    def act(ctx: Any, **args: Any) -> dict[str, Any]:
        rec.tool(ctx)
        return {"ok": True}

    @flow.policy
    def decide(ctx: Any, history: list[Any]) -> list[ToolCall]:
        rec.policy(ctx, history)
        return [] if history else [ToolCall("act", {})]

    return flow


def _policy_runs(rec: Recorder) -> set[str]:
    return {key.rsplit(":", 2)[0] for _, key, _, _ in rec.tool_calls}


async def _ghost_claim(store: Any, run_id: str, flow: Flow) -> int:
    """A previous holder (that later died) claimed the run; returns its token."""
    ((ghost, _),) = await store.worker.claim_runs("ghost", [flow.ref], dt.timedelta(seconds=5), 1)
    assert ghost.run_id == run_id
    return int(ghost.fencing_token)


@pytest.mark.parametrize("what", ["input", "state"])
async def test_an_undecodable_input_or_state_fails_that_run_alone(
    what: str, db: Db, database_url: str, start_worker: StartWorker
) -> None:
    rec = Recorder()
    flow = _flow(rec)
    if what == "input":
        plant_run(database_url, "bad", flow.name, input=DEEP)
    else:
        plant_run(database_url, "bad", flow.name, state=DEEP)
    await db.submit("good-1", flow)
    await db.submit("good-2", flow)

    await start_worker(flow, concurrency=4)
    bad = await db.wait_status("bad", "succeeded", "failed", "paused")
    for good in ("good-1", "good-2"):
        assert (await db.wait_status(good, "succeeded", "failed", "paused"))["status"] == (
            "succeeded"
        )

    assert bad["status"] == "failed"
    [found] = bad["error"].pop("found")
    assert bad["error"] == {"reason": "undecodable_run", "what": what}
    assert (found["at"], found["error"]) == (what, TOO_DEEP)
    assert found["bytes"] > 5 * DEPTH
    assert await db.kinds("bad") == ["submitted", "claimed", "run_failed"]
    [failed] = await db.events("bad", "run_failed")
    assert failed["detail"] == {"reason": "undecodable_run"}
    assert sorted(_policy_runs(rec)) == ["good-1", "good-2"]  # nothing of "bad" was sent
    # the three were claimed in one batch (one claim_runs statement: one expiry)
    claimed = [(await db.events(r, "claimed"))[0] for r in ("bad", "good-1", "good-2")]
    assert len({e["detail"]["lease_expires_at"] for e in claimed}) == 1


@pytest.mark.parametrize(
    ("status", "deep"),
    [("succeeded", "result"), ("planned", "args"), ("failed", "args")],
)
async def test_an_undecodable_journal_fails_the_run(
    status: str, deep: str, db: Db, database_url: str, start_worker: StartWorker
) -> None:
    rec = Recorder()
    flow = _flow(rec)
    await db.submit("bad-j", flow)
    key = plant_call(
        database_url,
        "bad-j",
        status=status,
        args=DEEP if deep == "args" else "{}",
        result=DEEP if deep == "result" else None,
    )
    await db.submit("good-j", flow)

    await start_worker(flow, concurrency=2)
    bad = await db.wait_status("bad-j", "succeeded", "failed", "paused")
    assert (await db.wait_status("good-j", "succeeded", "failed"))["status"] == "succeeded"

    assert bad["status"] == "failed", bad
    found = bad["error"].pop("found")
    assert bad["error"] == {"reason": "undecodable_run", "what": "journal"}
    assert f"call {key} {deep}" in {f["at"] for f in found}
    assert {f["error"] for f in found} == {TOO_DEEP}
    assert rec.tool_calls == [("act", "good-j:0:c0", 1, 1)]  # nothing of bad-j was sent
    [call] = await db.calls("bad-j")
    assert call["status"] == status  # the journal is left as it was


async def test_an_undecodable_journal_with_a_call_in_flight_pauses_the_run(
    db: Db, database_url: str, store: Any, db_clock: Any, start_worker: StartWorker
) -> None:
    rec = Recorder()
    flow = _flow(rec)
    await db.submit("bad-f", flow)
    token = await _ghost_claim(store, "bad-f", flow)
    key = plant_call(database_url, "bad-f", status="dispatched", args=DEEP, token=token)
    db_clock.advance(6)  # the ghost's lease is over

    await start_worker(flow)
    paused = await db.wait_status("bad-f", "succeeded", "failed", "paused")

    # the call may have taken effect: never written off; unknown, and a person decides
    assert paused["status"] == "paused"
    why = "undecodable_run: the run's journal holds JSON this worker cannot decode"
    assert paused["pause_reason"] == in_flight_reason(why, "bad-f", [key])
    assert f"`runledger resolve {key} applied|not_applied|abandoned`" in paused["pause_reason"]
    [call] = await db.calls("bad-f")
    assert call["status"] == "unknown"
    assert call["error"]["reason"] == "undecodable_run"
    assert call["error"]["what"] == "journal"
    assert rec.tool_calls == [] and rec.policy_turns == []

    # resolved, the run is requeued; with nothing in flight any more it fails
    await db.rows("SELECT runledger.resolve_call(%s, 'applied', NULL, 'ops', 'checked')", key)
    failed = await db.wait_status("bad-f", "failed")
    assert failed["error"]["reason"] == "undecodable_run"
    assert rec.tool_calls == []


async def test_a_journal_that_breaks_loading_on_every_claim_becomes_a_crash_loop(
    db: Db, database_url: str, start_worker: StartWorker
) -> None:
    rec = Recorder()
    flow = _flow(rec)
    await db.submit("stuck", flow)
    # a turn whose calls Python cannot decode, and no call rows to find it by: the load
    # raises; the catch-all hands the run back, and it is claimed again at once
    plant_call(
        database_url,
        "stuck",
        status="planned",
        turn_calls='[{"call_id": "c0", "tool": "act", "args": ' + DEEP + "}]",
    )
    await db.submit("fine", flow)

    await start_worker(flow, limits=LIMITS, concurrency=2)
    stuck = await db.wait_status("stuck", "succeeded", "failed", "paused")
    assert (await db.wait_status("fine", "succeeded", "failed"))["status"] == "succeeded"

    # claimed max_stalled_claims + 1 times: the last claim gives up before loading
    assert stuck["status"] == "failed"
    assert stuck["error"] == {"reason": "crash_loop", "claims_without_progress": 3}
    assert stuck["claims"] == 3
    released = await db.events("stuck", "lease_released")
    assert [e["detail"]["reason"] for e in released] == ["worker_error", "worker_error"]
    assert rec.policy_turns == [0, 1]  # "fine"'s two turns: "stuck" never reached its policy
    assert rec.tool_calls == [("act", "fine:0:c0", 1, 1)]


async def test_a_crash_loop_whose_calls_cannot_be_read_pauses(
    db: Db, store: Any, db_clock: Any, start_worker: StartWorker
) -> None:
    """Not even the calls can be read: whether one was sent cannot be known, so the run
    is paused for a person, never failed."""
    rec = Recorder()
    flow = _flow(rec)
    await db.submit("blind", flow)
    claims = await store.worker.claim_runs("ghost", [flow.ref], dt.timedelta(seconds=5), 1)
    lease = [run for run, _ in claims]
    await store.worker.record_turn(
        "blind", lease[0].lease_id, lease[0].fencing_token, 0, [{"call_id": "c0", "tool": "act"}]
    )
    await store.worker.dispatch_call(
        "blind", lease[0].lease_id, lease[0].fencing_token, "blind:0:c0"
    )
    await db.rows("UPDATE runledger.runs SET stalled_claims = 5 WHERE run_id = 'blind'")

    worker = await start_worker(flow, limits=LIMITS)
    assert worker.worker.store is not None
    # a read of the calls that fails with something other than the database (as one
    # too large or too deep for this process would): a stand-in, like test_supervisor's
    wstore = worker.worker.store
    real = wstore.list_calls

    async def unreadable(run_id: str) -> Any:
        raise RecursionError("maximum recursion depth exceeded")

    wstore.list_calls = unreadable  # type: ignore[method-assign]
    try:
        db_clock.advance(6)  # only now may the worker take the run over
        paused = await db.wait_status("blind", "succeeded", "failed", "paused")
    finally:
        wstore.list_calls = real  # type: ignore[method-assign]
    assert paused["status"] == "paused"
    assert paused["pause_reason"] == (
        "crash_loop: 6 claims without progress, and its calls cannot be read "
        "(RecursionError): inspect them with `runledger status blind`, then "
        "`runledger retry blind` or `runledger cancel blind`"
    )
    [call] = await db.calls("blind")
    assert call["status"] == "dispatched"  # left as it was: a possible effect
    assert rec.tool_calls == []


def test_pause_reasons_name_every_key_whole_and_the_command() -> None:
    key = "r" * 128 + ":12:" + "c" * 60
    assert unknown_call_reason(key) == (
        f"call {key} is unknown: reconcile it with "
        f"`runledger resolve {key} applied|not_applied|abandoned`"
    )
    one = in_flight_reason("crash_loop: 6 claims without progress", "r", [key])
    assert one == (
        f"crash_loop: 6 claims without progress; call {key} may have taken effect and is "
        f"unknown: reconcile it with `runledger resolve {key} applied|not_applied|abandoned`"
    )
    keys = [f"run:0:c{i}" for i in range(3)]
    assert in_flight_reason("x", "run", keys) == (
        "x; calls run:0:c0, run:0:c1, run:0:c2 may have taken effect and are unknown: "
        "reconcile each with `runledger resolve <key> applied|not_applied|abandoned`"
    )
    many = [f"{'r' * 120}:0:c{i}" for i in range(40)]
    text = in_flight_reason("x", "rr", many)
    named = [k for k in many if k in text]
    assert named == many[: len(named)] and 5 < len(named) < 40  # whole keys, in order
    assert f"and {40 - len(named)} more (`runledger status rr` lists them)" in text
    assert len(text) <= MAX_PAUSE_REASON  # what finish_run stores (it refuses longer)
