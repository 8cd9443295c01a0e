"""Runs per second through real worker processes, next to the raw SQL protocol.

    .venv/bin/python bench/throughput.py                  # 1000 runs per scenario
    .venv/bin/python bench/throughput.py --runs 300 --workers 1

Scenarios (flow ``scripted@1`` from ``runledger.demo.flows``):

- ``no-op``: ``{"plan": []}``: the policy decides "nothing to do" and the run finishes.
- ``one-call``: ``{"plan": [[{"tool": "read"}]]}``: one read-only tool call (an HTTP GET
  to the fake provider), then a second turn that decides "done".

For each, with 1 and with 2 workers (``--concurrency`` 8 each): the workers are started
first and waited for (registered in ``runledger.workers`` and LISTENing), then all runs
are submitted in one statement (one transaction). The time is taken from the database:
``max(finished_at) - min(created_at)`` over the scenario's runs.

Baseline, measured in the same invocation on the same database, before any worker runs:
one process, one connection, a tight loop over the writes the worker makes per run
(``submit_run``, ``claim_runs_v4``, then ``record_turn_v4`` deciding "done" and
finishing the run; for one-call the first ``record_turn_v4`` records the call and
dispatches it, ``complete_call`` stores its result, and the second ``record_turn_v4``
checkpoints and finishes), no tool invoked. The ratio shows what the worker process adds
on top of the SQL.

Data on stdout (markdown tables), progress on stderr.
"""

from __future__ import annotations

import argparse
import datetime as dt
import os
import statistics
import sys
import time
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import psycopg
from psycopg.types.json import Jsonb

from runledger.testing.processes import wait_for

from _common import (
    FLOW_REFS,
    BenchPool,
    background_load,
    cpu_delta,
    cpu_snapshot,
    database,
    load_note,
    others,
    provider,
    say,
    stop_on_sigterm,
    table,
    tag,
    wait_ready,
)

PLANS: dict[str, dict[str, Any]] = {
    "no-op": {"plan": []},
    "one-call": {"plan": [[{"tool": "read"}]]},
}
READ_CALL = [{"call_id": "c0", "tool": "read", "args": {}}]
BASELINE = "SQL loop"
BASELINE_UPFRONT = "SQL loop, all submitted first"


@dataclass
class Result:
    scenario: str
    setup: str
    runs: int
    submit_s: float
    elapsed_s: float
    latency_p50_s: float
    cpu: dict[str, float]
    renewal_failed: int = 0

    @property
    def rate(self) -> float:
        return self.runs / self.elapsed_s if self.elapsed_s > 0 else float("nan")


# -- the SQL protocol without a worker ----------------------------------------------------

SUBMIT = "SELECT * FROM runledger.submit_run(%s, 'scripted', '1', %s::jsonb)"
CLAIM = (
    "SELECT run_id, fencing_token, lease_id, state_version "
    "FROM runledger.claim_runs_v4(%s, %s::text[], %s::interval, 1)"
)
# run, lease, token, turn, calls, record, output, expected version, state, finish, dispatch
RECORD = (
    "SELECT state_version FROM runledger.record_turn_v4("
    "%s, %s, %s, %s, %s::jsonb, NULL, %s::jsonb, %s, %s::jsonb, %s, %s::text[])"
)
COMPLETE = "SELECT runledger.complete_call(%s, %s, %s, %s, 'succeeded', %s::jsonb, NULL)"


def baseline(
    conn: psycopg.Connection[Any],
    prefix: str,
    kind: str,
    n: int,
    lease: dt.timedelta,
    upfront: bool,
) -> None:
    """``upfront``: submit all runs first (one statement, like the worker scenarios), so
    every claim sees the backlog; otherwise submit and claim one run at a time."""
    worker = f"{prefix}-sql"
    payload = Jsonb(PLANS[kind])
    if upfront:
        submit_batch(conn, prefix, kind, n)
    for i in range(1, n + 1):
        run_id = f"{prefix}-{i:06d}"
        if not upfront:
            conn.execute(SUBMIT, (run_id, payload))
        row = conn.execute(CLAIM, (worker, FLOW_REFS, lease)).fetchone()
        if row is None or row[0] != run_id:
            raise RuntimeError(
                f"baseline claimed {row!r}, expected {run_id}: is a worker "
                "running against this database?"
            )
        _, token, lease_id, version = row
        lease_args = (run_id, lease_id, token)
        if kind == "no-op":
            result = Jsonb({"turns": 1, "calls": 0})
            conn.execute(RECORD, (*lease_args, 0, Jsonb([]), result, version, None, True, None))
            continue
        key = f"{run_id}:0:c0"
        row = conn.execute(
            RECORD, (*lease_args, 0, Jsonb(READ_CALL), None, version, None, False, ["c0"])
        ).fetchone()
        assert row is not None
        conn.execute(COMPLETE, (*lease_args, key, Jsonb({"what": "x", "seen": 0})))
        result = Jsonb({"turns": 2, "calls": 1})
        state = Jsonb({"completed_turns": 1})
        conn.execute(RECORD, (*lease_args, 1, Jsonb([]), result, row[0], state, True, None))


# -- through workers ------------------------------------------------------------------------


def submit_batch(conn: psycopg.Connection[Any], prefix: str, kind: str, n: int) -> None:
    """All ``n`` runs in one statement, so in one transaction."""
    conn.execute(
        "SELECT count(*) FROM generate_series(1, %s) AS g "
        "CROSS JOIN LATERAL runledger.submit_run(%s || lpad(g::text, 6, '0'), 'scripted', '1', "
        "%s::jsonb) AS s",
        (n, f"{prefix}-", Jsonb(PLANS[kind])),
    )


def settled(conn: psycopg.Connection[Any], prefix: str) -> tuple[int, int]:
    row = conn.execute(
        "SELECT count(*) FILTER (WHERE status IN ('succeeded', 'failed', 'paused', 'cancelled')),"
        "       count(*) FILTER (WHERE status IN ('failed', 'paused', 'cancelled')) "
        "FROM runledger.runs WHERE run_id LIKE %s",
        (f"{prefix}-%",),
    ).fetchone()
    assert row is not None
    return int(row[0]), int(row[1])


def measured(conn: psycopg.Connection[Any], prefix: str) -> tuple[int, float, float, float]:
    """(succeeded, submit seconds, elapsed seconds, median run latency) from DB timestamps."""
    row = conn.execute(
        """
        SELECT count(*) FILTER (WHERE status = 'succeeded'),
               extract(epoch FROM max(created_at) - min(created_at)),
               extract(epoch FROM max(finished_at) - min(created_at)),
               percentile_cont(0.5) WITHIN GROUP (
                   ORDER BY extract(epoch FROM finished_at - created_at))
        FROM runledger.runs WHERE run_id LIKE %s
        """,
        (f"{prefix}-%",),
    ).fetchone()
    assert row is not None
    return int(row[0]), float(row[1]), float(row[2]), float(row[3])


def run_batch(
    conn: psycopg.Connection[Any],
    pool: BenchPool | None,
    prefix: str,
    kind: str,
    n: int,
    *,
    lease: dt.timedelta,
    postmaster: int | None,
    others: Sequence[int],
    upfront: bool = False,
) -> tuple[int, float, float, float, dict[str, float]]:
    """One measured batch: through ``pool``, or the SQL loop when ``pool`` is None.

    Returns (succeeded, submit s, elapsed s, median latency s, CPU cores per consumer).
    """
    pids = [pool.pid(i) for i in range(len(pool.procs))] if pool else []
    before = cpu_snapshot(pids, postmaster, others)
    if pool is None:
        baseline(conn, prefix, kind, n, lease, upfront)
    else:
        submit_batch(conn, prefix, kind, n)

        def done() -> bool:
            for i in range(len(pool.procs)):
                if not pool.alive(i):
                    raise RuntimeError(f"worker {pool.worker_id(i)} died:\n{pool.log(i)[-3000:]}")
            total, bad = settled(conn, prefix)
            if bad:
                raise RuntimeError(f"{bad} run(s) of {prefix} failed or paused")
            return total == n

        wait_for(done, timeout=60 + n / 5, interval=0.05, what=f"{n} {kind} runs finished")
    after = cpu_snapshot(pids, postmaster, others)
    ok, submit_s, elapsed_s, p50 = measured(conn, prefix)
    if ok != n:
        raise RuntimeError(f"{prefix}: {ok} of {n} runs succeeded")
    return ok, submit_s, elapsed_s, p50, cpu_delta(before, after)


def renewal_failed(conn: psycopg.Connection[Any], prefix: str) -> int:
    row = conn.execute(
        "SELECT count(*) FROM runledger.run_events WHERE run_id LIKE %s "
        "AND kind = 'renewal_failed'",
        (f"{prefix}-%",),
    ).fetchone()
    return int(row[0]) if row else 0


def provider_round_trip(client: Any, n: int = 200) -> float:
    """Median seconds of the HTTP GET the ``read`` tool makes, from this process."""
    samples = []
    for _ in range(n):
        t = time.perf_counter()
        client.effects()
        samples.append(time.perf_counter() - t)
    return statistics.median(samples)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n", 1)[0])
    ap.add_argument("--runs", type=int, default=1000, help="runs per scenario (default 1000)")
    ap.add_argument("--workers", default="1,2", help="worker counts to try (default 1,2)")
    ap.add_argument("--concurrency", type=int, default=8, help="run slots per worker (default 8)")
    ap.add_argument("--scenarios", default="no-op,one-call", help="default no-op,one-call")
    ap.add_argument(
        "--warmup",
        type=int,
        default=50,
        help="unmeasured runs per scenario after workers start (default 50)",
    )
    ap.add_argument("--lease-seconds", type=float, default=30.0)
    ap.add_argument("--poll-seconds", type=float, default=2.0)
    ap.add_argument(
        "--worker-log-level",
        default="WARNING",
        help="workers' --log-level (INFO logs two lines per run; default WARNING)",
    )
    ap.add_argument("--no-baseline", action="store_true")
    args = ap.parse_args(argv)
    kinds = [k.strip() for k in args.scenarios.split(",") if k.strip()]
    for k in kinds:
        if k not in PLANS:
            ap.error(f"unknown scenario {k!r}; choose from {', '.join(PLANS)}")
    counts = [int(x) for x in args.workers.split(",") if x.strip()]
    lease = dt.timedelta(seconds=args.lease_seconds)
    me = tag()
    results: list[Result] = []
    stop_on_sigterm()
    before = background_load()
    started = time.monotonic()

    with database() as db, provider() as prov:
        say(f"PostgreSQL {db.version}, {db.source}; bench tag {me}")
        rtt = provider_round_trip(prov.client)
        common: dict[str, Any] = {
            "lease": lease,
            "postmaster": db.postmaster,
            "others": [prov.proc.pid],
        }

        # Each scenario on a fresh database (a clone of the migrated template) when the
        # cluster is ours, so none runs on the rows and dead tuples of the previous ones.
        if not args.no_baseline:
            for kind in kinds:
                for upfront, setup in ((False, BASELINE), (True, BASELINE_UPFRONT)):
                    say(f"baseline: {setup}, {kind}, {args.runs} runs ...")
                    with psycopg.connect(db.fresh(), autocommit=True) as conn:
                        prefix = f"b{me}-sql{int(upfront)}-{kind}"
                        n, sub, el, p50, cpu = run_batch(
                            conn, None, prefix, kind, args.runs, upfront=upfront, **common
                        )
                    results.append(Result(kind, setup, n, sub, el, p50, cpu))

        for count in counts:
            for kind in kinds:
                setup = f"{count} worker{'s' if count > 1 else ''} x {args.concurrency}"
                say(f"{setup}: {kind}, {args.runs} runs ...")
                url = db.fresh()
                name = f"b{me}-{count}w-{kind}"
                pool = BenchPool(
                    url,
                    name,
                    env={"RUNLEDGER_PROVIDER_URL": prov.url},
                    args=[
                        "--concurrency",
                        str(args.concurrency),
                        "--lease-seconds",
                        str(args.lease_seconds),
                        "--poll-seconds",
                        str(args.poll_seconds),
                        "--log-level",
                        args.worker_log_level,
                    ],
                )
                try:
                    with psycopg.connect(url, autocommit=True) as conn:
                        pool.start(count)
                        wait_ready(conn, pool, range(count))
                        if args.warmup:
                            run_batch(conn, pool, f"{name}-warm", kind, args.warmup, **common)
                        n, sub, el, p50, cpu = run_batch(
                            conn, pool, f"{name}-m", kind, args.runs, **common
                        )
                        stray = renewal_failed(conn, f"{name}-m")
                    results.append(Result(kind, setup, n, sub, el, p50, cpu, stray))
                finally:
                    pool.close()

    base = {r.scenario: r.rate for r in results if r.setup == BASELINE}
    rows = []
    for r in results:
        ratio = f"{r.rate / base[r.scenario]:.2f}x" if r.scenario in base else "-"
        client = r.cpu["me"] if r.setup.startswith("SQL") else r.cpu["workers"]
        per_run = r.elapsed_s / r.runs * 1000  # ms of wall time per run
        pg = f"{r.cpu['postgres']:.2f}" if db.postmaster else "n/a"
        pg_ms = f"{r.cpu['postgres'] * per_run:.1f}" if db.postmaster else "n/a"
        rows.append(
            [
                r.scenario,
                r.setup,
                f"{r.rate:.0f}",
                ratio,
                f"{r.elapsed_s:.2f}",
                f"{r.submit_s:.2f}",
                f"{r.latency_p50_s:.2f}",
                f"{client:.2f}",
                pg,
                f"{client * per_run:.1f}",
                pg_ms,
                f"{others(r.cpu):.2f}",
            ]
        )
    print()
    print(
        f"{args.runs} runs per row; PostgreSQL {db.version}, {db.source}; "
        f"{os.cpu_count()} CPUs; {load_note(before)}"
    )
    print(
        table(
            [
                "scenario",
                "setup",
                "runs/s",
                "vs SQL loop",
                "elapsed s",
                "submit s",
                "p50 latency s",
                "client cores",
                "postgres cores",
                "client CPU ms/run",
                "postgres CPU ms/run",
                "other jobs cores",
            ],
            rows,
        )
    )
    print()
    print(
        "elapsed = max(finished_at) - min(created_at) on the database clock; submit = "
        "max(created_at) - min(created_at); p50 latency = median of finished_at - "
        "created_at; client = the worker processes, or this process for the SQL loop; "
        "cores = CPU time / elapsed (1.00 = one core busy all along); other jobs = the "
        "machine's busy time used by none of these processes (well above 0: skewed numbers)."
    )
    provider_cores = max((r.cpu["extra"] for r in results), default=0.0)
    print(
        f"the read tool's HTTP round trip to the fake provider: {rtt * 1000:.2f} ms (median, "
        f"from one client); the provider process used at most {provider_cores:.2f} cores."
    )
    stray = sum(r.renewal_failed for r in results)
    if stray:
        print(
            f"renewal_failed events written during the worker scenarios: {stray} "
            "(every run succeeded; these are renewals of runs that had just finished)"
        )
    say(f"total {time.monotonic() - started:.0f} s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
