"""What one claim costs with live workers holding runs (the session-lock check included).

    .venv/bin/python bench/claim_cost.py [--workers 10] [--held 4] [--backlog 1000] [--claims 500]

Setup: ``--workers`` listener sessions, each registered (``register_worker_v2`` with a
session lock), each holding ``--held``
running runs; ``--backlog`` queued runs of another flow. Then, alternating, on one
connection: an *idle* claim (a flow with running runs but nothing claimable: the poll of
a worker with nothing to do) and a *busy* claim (one run from the backlog, handed back at
once with ``release_lease``, not timed). Reports the median and p95 of each, in ms, on
the database clock of this machine. Run it on two trees to compare (PYTHONPATH).
"""

from __future__ import annotations

import argparse
import datetime as dt
import statistics
import sys
import time
from contextlib import ExitStack
from typing import Any

import psycopg
from psycopg.types.json import Jsonb

from _common import database, say

LEASE = dt.timedelta(seconds=30)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n", 1)[0])
    ap.add_argument("--workers", type=int, default=10)
    ap.add_argument("--held", type=int, default=4)
    ap.add_argument("--backlog", type=int, default=1000)
    ap.add_argument("--claims", type=int, default=500)
    args = ap.parse_args(argv)
    with database() as db, ExitStack() as stack:
        conn = stack.enter_context(psycopg.connect(db.url, autocommit=True))
        say(f"PostgreSQL {db.version}")
        for w in range(args.workers):
            listener = stack.enter_context(psycopg.connect(db.url, autocommit=True))
            wid = f"cc-w{w}"
            listener.execute(
                "SELECT * FROM runledger.register_worker_v2(%s, 'h', 1, %s, true)",
                (wid, ["held@1"]),
            )
            for n in range(args.held):
                conn.execute(
                    "SELECT * FROM runledger.submit_run(%s, 'held', '1', %s)",
                    (f"cc-held-{w}-{n}", Jsonb({})),
                )
            conn.execute(
                "SELECT * FROM runledger.claim_runs_v4(%s, %s, %s, %s)",
                (wid, ["held@1"], LEASE, args.held),
            )
        conn.execute(
            "SELECT runledger.submit_run('cc-q-' || g, 'queued', '1', '{}'::jsonb)"
            " FROM generate_series(1, %s) g",
            (args.backlog,),
        )
        conn.execute("ANALYZE runledger.runs")
        idle: list[float] = []
        busy: list[float] = []
        claimer = "cc-claimer"
        for _ in range(args.claims):
            t = time.perf_counter()
            conn.execute(
                "SELECT * FROM runledger.claim_runs_v4(%s, %s, %s, 4)",
                (claimer, ["held@1"], LEASE),
            ).fetchall()
            idle.append((time.perf_counter() - t) * 1000)
            t = time.perf_counter()
            rows: list[Any] = conn.execute(
                "SELECT run_id, lease_id, fencing_token FROM runledger.claim_runs_v4"
                "(%s, %s, %s, 1)",
                (claimer, ["queued@1"], LEASE),
            ).fetchall()
            busy.append((time.perf_counter() - t) * 1000)
            for run_id, lease_id, token in rows:
                conn.execute(
                    "SELECT runledger.release_lease(%s, %s, %s)", (run_id, lease_id, token)
                )

    def q(xs: list[float]) -> str:
        xs = sorted(xs)
        return f"{statistics.median(xs):.3f} / {xs[int(len(xs) * 0.95)]:.3f}"

    print(
        "| workers | held runs | backlog | idle claim ms (p50 / p95) | busy claim ms (p50 / p95) |"
    )
    print("|---|---|---|---|---|")
    held = args.workers * args.held
    print(f"| {args.workers} | {held} | {args.backlog} | {q(idle)} | {q(busy)} |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
