"""prune_records: the retention of what runs leave behind. The checkpoints of the event
chains older than the cutoff go with their heads (a head still pinning a chain left in
run_events carried into a new checkpoint), and so do the records of pruned chains no head
needs, workers gone long ago and old commit guarantees: the tables stay within a bound
over hundreds of checkpoints, and the chains still verify (docs/audit.md)."""

from __future__ import annotations

import datetime as dt
from typing import Any

import psycopg
import pytest

from runledger.audit import Anchor, audit
from runledger.testing import DbClock

from .conftest import Connect
from .helpers import (
    claim,
    complete,
    dispatched_call,
    finish,
    one,
    refused,
    rows,
    scalar,
    sqlstate,
    submit,
    submit_and_claim,
)

Conn = psycopg.Connection[Any]
HOUR = 3600
CHAIN_TABLES = (
    "event_checkpoints",
    "event_checkpoint_heads",
    "event_chain_prunes",
    "event_checkpoint_prunes",
)


def _short_run(worker: Conn, run_id: str, *, synchronous_commit: str | None = None) -> None:
    submit(worker, run_id)
    if synchronous_commit is not None:  # the claim records how this session commits
        worker.execute(f"SET synchronous_commit = {synchronous_commit}")  # type: ignore[arg-type]
    (lease,) = claim(worker, "w1", max_runs=1)
    assert lease.run_id == run_id
    if synchronous_commit is not None:
        worker.execute("RESET synchronous_commit")
    k = dispatched_call(worker, lease)
    complete(worker, lease, k, "succeeded", {"ok": True}, {"id": run_id})
    finish(worker, lease, "succeeded", None, reason="done")


def _checkpoint(conn: Conn) -> dict[str, Any]:
    made = one(conn, "SELECT * FROM runledger.checkpoint_events('test', interval '0')")
    assert made is not None and made["created"]
    return made


def _prune_records(
    operator: Conn, before: dt.datetime, limit: int, *, keep_events: bool = True
) -> list[dict[str, Any]]:
    """Batches until one says nothing is left, as `runledger prune` calls them."""
    batches = []
    while True:
        got = one(
            operator,
            "SELECT * FROM runledger.prune_records(%s, %s, %s)",
            (before, keep_events, limit),
        )
        assert got is not None
        batches.append(got)
        if not got["more"]:
            return batches


def _sizes(admin: Conn) -> dict[str, int]:
    tables = (*CHAIN_TABLES, "workers", "commit_guarantees")
    return {t: int(scalar(admin, f"SELECT count(*) FROM runledger.{t}")) for t in tables}


def _broken(url: str, *anchors: Anchor) -> dict[str, list[dict[str, Any]]]:
    return {f.check.name: f.rows for f in audit(url, expect=anchors).findings if not f.ok}


def _carried(admin: Conn, since: int) -> set[str]:
    """The runs whose heads sit in the checkpoints the prunes made (after ``since``)."""
    return {
        r["run_id"]
        for r in rows(
            admin,
            "SELECT h.run_id FROM runledger.event_checkpoint_heads h"
            " JOIN runledger.event_checkpoints k USING (checkpoint_id)"
            " WHERE k.actor = 'runledger prune' AND k.checkpoint_id > %s",
            (since,),
        )
    }


def _window(admin: Conn, before: dt.datetime) -> tuple[int, int]:
    """The checkpoints made (by checkpoint_events) at or after ``before``, and their heads."""
    row = one(
        admin,
        "SELECT count(DISTINCT k.checkpoint_id) AS checkpoints, count(h.run_id) AS heads"
        " FROM runledger.event_checkpoints k"
        " LEFT JOIN runledger.event_checkpoint_heads h USING (checkpoint_id)"
        " WHERE k.at >= %s AND k.actor = 'test'",
        (before,),
    )
    assert row is not None
    return int(row["checkpoints"]), int(row["heads"])


def test_hundreds_of_checkpoints_shrink_to_a_bound_and_the_chains_still_verify(
    worker: Conn, operator: Conn, admin_conn: Conn, database_url: str, db_clock: DbClock
) -> None:
    # Runs that outlive any horizon: paused early, never written again.
    for i in range(3):
        finish(worker, submit_and_claim(worker, f"live-{i}"), "paused", reason="waits")
    # A worker that stopped, and one that died holding a run with a call in flight.
    worker.execute("SELECT runledger.register_worker_v2('w-old', 'h', 1, ARRAY['demo@1'], false)")
    worker.execute("SELECT runledger.heartbeat_worker('w-old', true)")
    worker.execute("SELECT runledger.register_worker_v2('w-crash', 'h', 2, ARRAY['x@1'], false)")
    submit(worker, "stuck", flow="x")
    (stuck,) = claim(worker, "w-crash", ["x@1"], max_runs=1)
    dispatched_call(worker, stuck)
    hour: list[dt.datetime] = []  # the database clock when run r-i finished

    def history(first: int, last: int, prune_at: dict[int, tuple[int, bool]]) -> None:
        """Runs r-first..r-last, an hour apart, each checkpointed; at ``prune_at`` the
        runs finished before run r-N are pruned (events kept or not), as a daily
        `runledger prune` would."""
        for i in range(first, last + 1):
            db_clock.advance(HOUR)
            sync = {0: "off", 1: "on"}.get(i % 50)  # a guarantee row each time it changes
            _short_run(worker, f"r-{i}", synchronous_commit=sync)
            hour.append(db_clock.now())
            _checkpoint(worker)
            if i in prune_at:
                upto, keep = prune_at[i]
                while scalar(
                    operator,
                    "SELECT runledger.prune_runs_v2(%s, %s, 40)",
                    (hour[upto] - dt.timedelta(minutes=30), keep),
                ):
                    pass

    # Round 1: 150 runs and checkpoints; r-0..r-49 pruned with their events, r-50..r-99
    # pruned with theirs kept (the audit trail outlives the runs).
    history(0, 149, {100: (50, False), 130: (100, True)})
    before = _sizes(admin_conn)
    assert before["event_checkpoints"] == 151
    assert before["event_checkpoint_heads"] == 150 + 4  # and live-0..2, stuck
    assert before["event_chain_prunes"] == 50
    assert before["workers"] == 2
    assert before["commit_guarantees"] >= 6
    kept = one(
        worker,
        "SELECT checkpoint_id, digest FROM runledger.event_checkpoints WHERE checkpoint_id = 140",
    )
    gone = one(
        worker,
        "SELECT checkpoint_id, digest FROM runledger.event_checkpoints WHERE checkpoint_id = 60",
    )
    assert kept is not None and gone is not None
    newest = scalar(admin_conn, "SELECT max(checkpoint_id) FROM runledger.event_checkpoints")

    cutoff = hour[120] - dt.timedelta(minutes=30)  # keep the checkpoints of r-120 on
    batches = _prune_records(operator, cutoff, 40)
    assert len(batches) == 4  # 120 old checkpoints, 40 a call, and a last short call
    after = _sizes(admin_conn)
    window, window_heads = _window(admin_conn, cutoff)
    assert window == 30
    # what still pins a chain in run_events and has no head in the window: carried
    carried = {"live-0", "live-1", "live-2", "stuck"} | {f"r-{i}" for i in range(50, 120)}
    assert _carried(admin_conn, newest) == carried
    assert sum(b["carried"] for b in batches) == len(carried)
    carries = sum(1 for b in batches if b["carried"])
    assert after["event_checkpoints"] == 1 + window + carries
    assert after["event_checkpoint_heads"] == window_heads + len(carried)
    assert sum(b["checkpoints"] for b in batches) == 120
    assert sum(b["heads"] for b in batches) == before["event_checkpoint_heads"] - window_heads
    # r-0..r-49's records went with the last heads that needed them
    assert after["event_chain_prunes"] == 0
    assert sum(b["chain_prunes"] for b in batches) == 50
    # the stopped worker went; the dead one still names a call in flight of its run
    assert [
        r["worker_id"] for r in rows(admin_conn, "SELECT worker_id FROM runledger.workers")
    ] == ["w-crash"]
    newest_guarantee = scalar(admin_conn, "SELECT max(position) FROM runledger.commit_guarantees")
    assert (
        scalar(
            admin_conn,
            "SELECT count(*) FROM runledger.commit_guarantees WHERE seen_at < %s AND position < %s",
            (cutoff, newest_guarantee),
        )
        == 0
    )
    assert after["commit_guarantees"] < before["commit_guarantees"]
    record = one(
        admin_conn,
        "SELECT * FROM runledger.event_checkpoint_prunes ORDER BY through_checkpoint_id DESC"
        " LIMIT 1",
    )
    assert record is not None and record["through_checkpoint_id"] == 120
    assert record["pruned_by"] == scalar(operator, "SELECT session_user")
    assert scalar(admin_conn, "SELECT count(*) FROM runledger.prune_authorizations") == 0

    # The chains verify; an anchor kept outside still holds, one pruned cannot be checked.
    assert _broken(database_url) == {}
    assert _broken(database_url, Anchor(140, kept["digest"].hex())) == {}
    (problem,) = _broken(database_url, Anchor(60, gone["digest"].hex()))["checkpoint_anchor"]
    assert problem["problem"].startswith(
        "the checkpoint was pruned by retention (checkpoints 1-120"
    )

    # Round 2: 150 more, and the same prune, with events this time: the tables come back
    # to the same bound, and r-50..r-99's kept chains go once their carrier is old.
    history(150, 299, {250: (200, False)})
    grown = _sizes(admin_conn)
    assert grown["event_checkpoints"] == after["event_checkpoints"] + 150
    newest = scalar(admin_conn, "SELECT max(checkpoint_id) FROM runledger.event_checkpoints")
    cutoff = hour[270] - dt.timedelta(minutes=30)
    batches = _prune_records(operator, cutoff, 40, keep_events=False)
    again = _sizes(admin_conn)
    window, window_heads = _window(admin_conn, cutoff)
    assert window == 30
    carried = {"live-0", "live-1", "live-2", "stuck"}
    carried |= {f"r-{i}" for i in range(200, 270)}  # finished, not pruned yet
    assert _carried(admin_conn, newest) == carried
    carries = sum(1 for b in batches if b["carried"])
    assert again["event_checkpoints"] == 1 + window + carries
    assert again["event_checkpoint_heads"] == window_heads + len(carried)
    assert sum(b["chains"] for b in batches) == 50
    kept_chains = [f"r-{i}" for i in range(50, 100)]
    assert (
        scalar(
            admin_conn,
            "SELECT count(*) FROM runledger.run_events WHERE run_id = ANY(%s)",
            (kept_chains,),
        )
        == 0
    )
    # r-100..r-199's records went with their heads; r-50..r-99's are new: kept for now
    assert sorted(
        r["run_id"] for r in rows(admin_conn, "SELECT run_id FROM runledger.event_chain_prunes")
    ) == sorted(kept_chains)
    # one record per call that pruned checkpoints; round 1's, older than the cutoff, gone
    assert again["event_checkpoint_prunes"] == sum(1 for b in batches if b["checkpoints"])
    assert again["workers"] == 1
    assert _broken(database_url) == {}

    # The chains go on: the next checkpoint chains after the carried ones.
    _short_run(worker, "r-next")
    _checkpoint(worker)
    assert _broken(database_url) == {}
    # A carried head still pins its chain: the tail of live-0 cut by hand is caught.
    last = scalar(
        admin_conn, "SELECT max(event_id) FROM runledger.run_events WHERE run_id = 'live-0'"
    )
    admin_conn.execute("ALTER TABLE runledger.run_events DISABLE TRIGGER tg_run_events_guard")
    admin_conn.execute("DELETE FROM runledger.run_events WHERE event_id = %s", (last,))
    admin_conn.execute("ALTER TABLE runledger.run_events ENABLE ALWAYS TRIGGER tg_run_events_guard")
    broken = _broken(database_url)
    assert set(broken) == {"checkpoint_head_changed"}
    assert [(r["run_id"], r["event_id"]) for r in broken["checkpoint_head_changed"]] == [
        ("live-0", last)
    ]


def test_checkpoint_0_and_the_newest_stay_whatever_the_cutoff(
    worker: Conn, operator: Conn, admin_conn: Conn, database_url: str, db_clock: DbClock
) -> None:
    for i in range(5):
        _short_run(worker, f"r-{i}")
        _checkpoint(worker)
        db_clock.advance(60)
    scalar(operator, "SELECT runledger.prune_runs_v2('infinity', false, 100)")
    batches = _prune_records(operator, dt.datetime.max.replace(tzinfo=dt.UTC), 100)
    assert sum(b["checkpoints"] for b in batches) == 4  # 1-4: not 0, not 5
    assert sum(b["carried"] for b in batches) == 0  # every chain was pruned
    left = [
        r["checkpoint_id"]
        for r in rows(
            admin_conn, "SELECT checkpoint_id FROM runledger.event_checkpoints ORDER BY 1"
        )
    ]
    assert left == [0, 5]
    # the chain records that checkpoint 5's heads need stay (r-4 was pruned)
    assert [
        r["run_id"] for r in rows(admin_conn, "SELECT run_id FROM runledger.event_chain_prunes")
    ] == ["r-4"]
    assert _broken(database_url) == {}
    # checkpoint_events starts after the newest, not again from checkpoint 0
    _short_run(worker, "r-5")
    made = _checkpoint(worker)
    assert made["checkpoint_id"] == 6 and made["runs"] == 1
    assert _broken(database_url) == {}


def test_even_under_an_authorization_checkpoint_0_and_the_newest_guarantee_stay(
    worker: Conn, operator: Conn, admin_conn: Conn, db_clock: DbClock
) -> None:
    """The owner can write an authorization for its own transaction: the guards still
    refuse what audit depends on."""
    for i, sync in enumerate(("off", "on", None)):
        _short_run(worker, f"r-{i}", synchronous_commit=sync)
        _checkpoint(worker)
    db_clock.advance(60)
    scalar(operator, "SELECT runledger.prune_runs_v2(runledger.now(), false, 10)")
    _prune_records(operator, db_clock.now(), 10)
    worker.execute("SELECT runledger.register_worker_v2('w-now', 'h', 1, ARRAY['demo@1'], false)")
    sizes = _sizes(admin_conn)
    assert all(n > 0 for n in sizes.values()), sizes  # r-2's chain record is needed
    for sql in (
        "DELETE FROM runledger.event_checkpoints WHERE checkpoint_id = 0",
        "DELETE FROM runledger.commit_guarantees WHERE position ="
        " (SELECT max(position) FROM runledger.commit_guarantees)",
    ):
        with refused(admin_conn, "RL007", sql), admin_conn.transaction():
            admin_conn.execute("INSERT INTO runledger.prune_authorizations VALUES (txid_current())")
            admin_conn.execute(sql)  # type: ignore[arg-type]
    # and without one, nothing of the chain tables is deleted
    for table in CHAIN_TABLES:
        with refused(admin_conn, "RL007", table):
            admin_conn.execute(f"DELETE FROM runledger.{table}")  # type: ignore[arg-type]
    with refused(admin_conn, "RL007"):
        admin_conn.execute(
            "INSERT INTO runledger.event_checkpoint_prunes VALUES (1, '\\x00', now(), 1, 1, 0,"
            " NULL, now(), 'forger')"
        )


def test_a_checkpoint_skips_while_a_prune_holds_the_checkpoints(
    worker: Conn, connect: Connect, db_clock: DbClock
) -> None:
    """The prune holds the checkpointer's lock for its batch: a worker's checkpoint skips
    (the next one makes it) instead of waiting."""
    _short_run(worker, "r-0")
    _checkpoint(worker)
    _short_run(worker, "r-1")
    pruner = connect("runledger_operator")
    with pruner.transaction():
        pruner.execute("SELECT * FROM runledger.prune_records(runledger.now(), true, 10)")
        worker.execute("SET statement_timeout = '5s'")  # a wait would fail the test
        made = one(worker, "SELECT * FROM runledger.checkpoint_events('w1', interval '0')")
        assert made is not None and not made["created"]
    assert _checkpoint(worker)["created"]


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
    _short_run(worker, "r-0")
    _checkpoint(worker)
    _short_run(worker, "r-1")
    _checkpoint(worker)
    db_clock.advance(HOUR)
    sizes = _sizes(admin_conn)
    with sqlstate("RL006"):
        operator.execute(
            f"SELECT * FROM runledger.prune_records({before}, {keep}::boolean, {limit}::integer)"  # type: ignore[arg-type]
        )
    assert _sizes(admin_conn) == sizes


def test_a_worker_may_not_prune_records(worker: Conn) -> None:
    with sqlstate("42501"):
        worker.execute("SELECT * FROM runledger.prune_records(now(), true, 10)")


def test_the_gap_after_checkpoint_0_passes_only_as_recorded(
    worker: Conn, operator: Conn, admin_conn: Conn, database_url: str, db_clock: DbClock
) -> None:
    """audit accepts the checkpoints retention deleted by its record alone: a record
    changed, or removed, and the first checkpoint kept is named."""
    for i in range(4):
        _short_run(worker, f"r-{i}")
        _checkpoint(worker)
        db_clock.advance(HOUR)
    _prune_records(operator, db_clock.now() - dt.timedelta(minutes=150), 10)
    first = scalar(
        admin_conn,
        "SELECT min(checkpoint_id) FROM runledger.event_checkpoints WHERE checkpoint_id > 0",
    )
    assert first == 3  # 1 and 2 went (r-0's and r-1's heads carried into checkpoint 5)
    assert _broken(database_url) == {}
    admin_conn.execute(
        "ALTER TABLE runledger.event_checkpoint_prunes"
        " DISABLE TRIGGER tg_event_checkpoint_prunes_guard"
    )
    try:
        admin_conn.execute("UPDATE runledger.event_checkpoint_prunes SET digest = '\\x00'")
        (row,) = _broken(database_url)["checkpoint_chain_broken"]
        assert (row["checkpoint_id"], row["problem"]) == (
            3,
            "its previous digest is not the digest of the last checkpoint pruned before it "
            "(event_checkpoint_prunes)",
        )
        admin_conn.execute("DELETE FROM runledger.event_checkpoint_prunes")
        (row,) = _broken(database_url)["checkpoint_chain_broken"]
        assert (row["checkpoint_id"], row["problem"]) == (
            3,
            "the checkpoints before it are missing",
        )
    finally:
        admin_conn.execute(
            "ALTER TABLE runledger.event_checkpoint_prunes"
            " ENABLE ALWAYS TRIGGER tg_event_checkpoint_prunes_guard"
        )
