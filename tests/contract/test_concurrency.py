"""Concurrent sessions: claims never overlap, and every write waits for the run row lock."""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any

import psycopg

from runledger.testing import DbClock

from .helpers import (
    LEASE_SECONDS,
    Lease,
    cancel,
    checkpoint,
    claim,
    rows,
    run_row,
    scalar,
    sqlstate,
    submit_and_claim,
)

Conn = psycopg.Connection[Any]
RUNS = 400
SESSIONS = 8


def _claim_all(conns: list[Conn], batch: int) -> dict[str, list[str]]:
    """Every session claims in batches until nothing claimable is left; run ids per worker."""
    barrier = threading.Barrier(len(conns))

    def work(i: int) -> list[str]:
        conn, got = conns[i], []
        barrier.wait(timeout=30)
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline:
            taken = claim(conn, f"w{i}", max_runs=batch)
            got.extend(c.run_id for c in taken)
            if not taken and not scalar(
                conn,
                "SELECT count(*) FROM runledger.runs WHERE status = 'queued' "
                "OR (status = 'running' AND lease_expires_at <= runledger.now())",
            ):
                return got
        raise AssertionError(f"w{i} still claiming after 60 s")

    with ThreadPoolExecutor(len(conns)) as pool:
        futures = {f"w{i}": pool.submit(work, i) for i in range(len(conns))}
        return {w: f.result(timeout=90) for w, f in futures.items()}


def test_concurrent_claimers_take_each_run_exactly_once(
    connect: Callable[[str], Conn], admin_conn: Conn, db_clock: DbClock
) -> None:
    admin_conn.execute(
        "SELECT runledger.submit_run('run-' || lpad(i::text, 3, '0'), 'demo', '1', "
        "jsonb_build_object('i', i)) FROM generate_series(1, %s) AS i",
        (RUNS,),
    )
    expected = {f"run-{i:03d}" for i in range(1, RUNS + 1)}
    conns = [connect("runledger_worker") for _ in range(SESSIONS)]

    per_worker = _claim_all(conns, batch=7)

    claimed = [r for got in per_worker.values() for r in got]
    assert len(claimed) == RUNS, f"{len(claimed) - len(set(claimed))} runs claimed twice"
    assert set(claimed) == expected
    assert sum(1 for got in per_worker.values() if got) >= 2, "no two sessions ever competed"
    assert (
        scalar(admin_conn, "SELECT count(*) FROM runledger.run_events WHERE kind = 'claimed'")
        == RUNS
    )
    assert (
        scalar(admin_conn, "SELECT count(*) FROM runledger.run_events WHERE kind = 'takeover'") == 0
    )
    owners = {
        r["run_id"]: r
        for r in rows(
            admin_conn,
            "SELECT run_id, lease_owner, fencing_token, claims, status FROM runledger.runs",
        )
    }
    for worker_id, got in per_worker.items():
        for run_id in got:
            row = owners[run_id]
            assert (row["lease_owner"], row["fencing_token"], row["claims"], row["status"]) == (
                worker_id,
                1,
                1,
                "running",
            ), run_id

    # Every lease expires; the same sessions race to take the runs over.
    db_clock.advance(LEASE_SECONDS + 1)
    per_worker = _claim_all(conns, batch=10)

    taken = [r for got in per_worker.values() for r in got]
    assert len(taken) == RUNS and set(taken) == expected
    assert (
        scalar(admin_conn, "SELECT count(*) FROM runledger.run_events WHERE kind = 'takeover'")
        == RUNS
    )
    assert (
        scalar(
            admin_conn, "SELECT count(*) FROM runledger.runs WHERE fencing_token = 2 AND claims = 2"
        )
        == RUNS
    )


def _wait_until_blocked(admin: Conn, pid: int, future: Future[Any]) -> None:
    """Wait (with a deadline) until backend ``pid`` waits on a lock."""
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline:
        assert not future.done(), f"the write did not wait for the lock: {future.result()}"
        waiting = scalar(
            admin, "SELECT wait_event_type = 'Lock' FROM pg_stat_activity WHERE pid = %s", (pid,)
        )
        if waiting:
            return
        time.sleep(0.01)
    raise AssertionError(f"backend {pid} never waited on a lock")


def _race(
    first: Conn, second: Conn, admin: Conn, hold: Callable[[], None], write: Callable[[], Any]
) -> Future[Any]:
    """``hold`` runs in an open transaction of ``first``; ``write`` (in ``second``) must wait."""
    pool = ThreadPoolExecutor(1)
    try:
        with first.transaction():
            hold()
            future = pool.submit(write)
            _wait_until_blocked(admin, second.info.backend_pid, future)
        future.exception(timeout=30)
        return future
    finally:
        pool.shutdown(wait=True)


def test_a_checkpoint_waits_for_the_row_and_sees_the_new_version(
    connect: Callable[[str], Conn], admin_conn: Conn
) -> None:
    a, b = connect("runledger_worker"), connect("runledger_worker")
    lease = submit_and_claim(a)

    future = _race(
        a,
        b,
        admin_conn,
        hold=lambda: checkpoint(a, lease, 0, {"by": "a"}),
        write=lambda: checkpoint(b, lease, 0, {"by": "b"}),
    )

    with sqlstate("RL002"):
        future.result()
    run = run_row(admin_conn, "r1")
    assert (run["state"], run["state_version"]) == ({"by": "a"}, 1)


def test_a_write_blocked_behind_a_cancel_is_refused_once_it_gets_the_row(
    connect: Callable[[str], Conn], admin_conn: Conn
) -> None:
    op, w = connect("runledger_operator"), connect("runledger_worker")
    lease = submit_and_claim(w)

    future = _race(
        op,
        w,
        admin_conn,
        hold=lambda: cancel(op, "r1", "alice", "stop"),
        write=lambda: checkpoint(w, lease, 0, {"late": True}),
    )

    with sqlstate("RL001") as info:
        future.result()
    assert "cancelled" in info.value.diag.message_detail
    run = run_row(admin_conn, "r1")
    assert (run["status"], run["state"], run["state_version"]) == ("cancelled", None, 0)


def test_a_claim_skips_a_run_whose_row_is_locked(
    connect: Callable[[str], Conn], admin_conn: Conn, db_clock: DbClock
) -> None:
    a, b = connect("runledger_worker"), connect("runledger_worker")
    b.execute("SET lock_timeout = '5s'")  # a claim that waits instead of skipping fails fast
    lease = submit_and_claim(a)

    with a.transaction():
        checkpoint(a, lease, 0, {"step": 1})  # holds the run row until commit
        db_clock.advance(LEASE_SECONDS + 1)
        assert claim(b, "w2") == []  # SKIP LOCKED: no wait, no double claim
    [taken] = claim(b, "w2")
    assert (taken.takeover, taken.token, taken.state_version) == (True, lease.token + 1, 1)
    kinds = [
        e["kind"]
        for e in rows(admin_conn, "SELECT kind FROM runledger.run_events ORDER BY event_id")
    ]
    assert kinds == ["submitted", "claimed", "checkpoint", "takeover"]


def test_renewal_and_takeover_never_both_win(
    connect: Callable[[str], Conn], admin_conn: Conn, db_clock: DbClock
) -> None:
    from .helpers import renew

    a, b = connect("runledger_worker"), connect("runledger_worker")
    lease: Lease = submit_and_claim(a)
    db_clock.advance(LEASE_SECONDS + 1)

    with ThreadPoolExecutor(2) as pool:
        renewed = pool.submit(renew, a, "w1", [lease])
        taken = pool.submit(claim, b, "w2")
        renewed_rows, taken_runs = renewed.result(timeout=30), taken.result(timeout=30)

    assert renewed_rows == []  # the lease had expired: renewal must not revive it
    if not taken_runs:
        # the claim came while the renewal held the run's row (renew_leases locks every
        # running run it is asked for, revision 0025) and skipped it (SKIP LOCKED): no
        # wait, no double win; the renewal is over now and revived nothing
        taken_runs = claim(b, "w2")
    assert [t.run_id for t in taken_runs] == ["r1"]
    assert run_row(admin_conn, "r1")["lease_owner"] == "w2"
