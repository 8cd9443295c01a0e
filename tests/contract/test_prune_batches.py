"""prune_runs_v2 (revision 0014): retention in batches, the oldest finished runs first,
never a queued, running or paused run, never waiting on a lock."""

from __future__ import annotations

import datetime as dt
import uuid
from typing import Any

import psycopg
import pytest
from psycopg.conninfo import make_conninfo

from runledger.testing import DbClock

from .conftest import Connect
from .helpers import (
    call_row,
    complete,
    count,
    dispatched_call,
    events,
    finish,
    refused,
    rows,
    scalar,
    submit,
    submit_and_claim,
)

Conn = psycopg.Connection[Any]


def _finished(worker: Conn, run_id: str, status: str = "succeeded") -> None:
    lease = submit_and_claim(worker, run_id)
    k = dispatched_call(worker, lease)
    complete(worker, lease, k, "succeeded", {"ok": True}, {"id": run_id})
    finish(worker, lease, status, None, reason="done")


def _left(admin: Conn) -> list[str]:
    return [r["run_id"] for r in rows(admin, "SELECT run_id FROM runledger.runs ORDER BY 1")]


def test_batches_take_the_oldest_finished_runs_first(
    worker: Conn, operator: Conn, admin_conn: Conn, db_clock: DbClock
) -> None:
    for i in range(5):
        _finished(worker, f"old-{i}", "failed" if i == 2 else "succeeded")
        db_clock.advance(60)
    paused = submit_and_claim(worker, "paused")
    finish(worker, paused, "paused", reason="check")
    submit(worker, "queued", flow="other")
    db_clock.advance(86400)
    _finished(worker, "new")
    running = submit_and_claim(worker, "running")  # its lease is live
    dispatched_call(worker, running)
    cutoff = db_clock.now() - dt.timedelta(hours=1)
    sql = "SELECT runledger.prune_runs_v2(%s, true, %s)"

    assert scalar(operator, sql, (cutoff, 2)) == 2
    assert _left(admin_conn)[:3] == ["new", "old-2", "old-3"]  # old-0 and old-1 went first
    assert scalar(operator, sql, (cutoff, 2)) == 2
    assert scalar(operator, sql, (cutoff, 2)) == 1  # fewer than the limit: done
    assert scalar(operator, sql, (cutoff, 2)) == 0
    assert _left(admin_conn) == ["new", "paused", "queued", "running"]
    assert call_row(admin_conn, "running:0:c1")["status"] == "dispatched"
    # events kept (the default of the CLI), turns and calls gone with their runs
    assert len(events(admin_conn, "old-0")) > 0
    assert count(admin_conn, "run_turns") == 2  # those of "new" and "running"
    assert count(admin_conn, "prune_authorizations") == 0


def test_events_go_with_their_runs_when_asked(
    worker: Conn, operator: Conn, admin_conn: Conn, db_clock: DbClock
) -> None:
    _finished(worker, "a")
    _finished(worker, "b")
    db_clock.advance(60)
    assert scalar(operator, "SELECT runledger.prune_runs_v2(runledger.now(), false, 10)") == 2
    assert (events(admin_conn, "a"), events(admin_conn, "b")) == ([], [])
    assert count(admin_conn, "runs") == 0


def test_a_run_locked_by_someone_else_is_skipped_not_waited_for(
    worker: Conn, operator: Conn, connect: Connect, admin_conn: Conn, db_clock: DbClock
) -> None:
    _finished(worker, "held")
    _finished(worker, "free")
    db_clock.advance(60)
    with admin_conn.transaction():
        admin_conn.execute("SELECT 1 FROM runledger.runs WHERE run_id = 'held' FOR UPDATE")
        operator.execute("SET statement_timeout = '5s'")  # a wait would fail the test
        assert scalar(operator, "SELECT runledger.prune_runs_v2(runledger.now(), true, 10)") == 1
    assert _left(admin_conn) == ["held"]
    assert scalar(operator, "SELECT runledger.prune_runs_v2(runledger.now(), true, 10)") == 1
    assert _left(admin_conn) == []


@pytest.mark.parametrize(
    ("before", "keep", "limit"),
    [
        ("NULL", "true", "10"),
        ("now()", "NULL", "10"),
        ("now()", "true", "0"),
        ("now()", "true", "10001"),
        ("now()", "true", "NULL"),
    ],
)
def test_bad_arguments_are_refused_and_nothing_is_deleted(
    before: str,
    keep: str,
    limit: str,
    worker: Conn,
    operator: Conn,
    admin_conn: Conn,
    db_clock: DbClock,
) -> None:
    _finished(worker, "done")
    db_clock.advance(60)
    with refused(admin_conn, "RL006"):
        operator.execute(
            f"SELECT runledger.prune_runs_v2({before}, {keep}::boolean, {limit}::integer)"  # type: ignore[arg-type]
        )
    assert _left(admin_conn) == ["done"]


def test_a_worker_may_not_prune(worker: Conn, admin_conn: Conn) -> None:
    with refused(admin_conn, "42501"):
        worker.execute("SELECT runledger.prune_runs_v2(now(), true, 10)")


def test_a_pruned_chain_records_the_login_that_pruned_it(
    worker: Conn, admin_conn: Conn, database_url: str, db_clock: DbClock
) -> None:
    _finished(worker, "a")
    _finished(worker, "b")
    db_clock.advance(60)
    login = f"rl_pruner_{uuid.uuid4().hex[:8]}"  # roles are the cluster's: a name of its own
    admin_conn.execute(f"CREATE ROLE {login} LOGIN IN ROLE runledger_operator")
    try:
        with psycopg.connect(make_conninfo(database_url, user=login), autocommit=True) as op:
            op.execute("SET ROLE runledger_operator")  # the role taken; the login stays hers
            assert scalar(op, "SELECT runledger.prune_runs_v2(runledger.now(), false, 1)") == 1
    finally:
        admin_conn.execute(f"DROP ROLE {login}")
    assert scalar(admin_conn, "SELECT runledger.prune_runs(runledger.now(), false)") == 1
    me = scalar(admin_conn, "SELECT session_user")
    pruned = rows(
        admin_conn,
        "SELECT run_id, events, pruned_by FROM runledger.event_chain_prunes ORDER BY run_id",
    )
    assert [(r["run_id"], r["pruned_by"]) for r in pruned] == [("a", login), ("b", me)]
    assert all(r["events"] > 0 for r in pruned)
