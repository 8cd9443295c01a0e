"""Cost of one claim_runs_v4 call as the backlog grows, against a baseline in the same run.

The baseline is the claim query as it was before the index-ordered rewrite (one scan
of every claimable row, then a sort), installed beside the current one as
``runledger.claim_runs_baseline``. Both claim from the same backlog, alternating.
``claim_runs_v4`` (the worker's claim) also returns each claimed run's journal, which
the baseline does not read: a backlog's runs have none, so that costs little here.

    .venv/bin/python bench/claim_scaling.py [--backlogs 10000,100000,1000000] [--claims 200]
        [--baseline-max 100000] [--no-analyze]

The backlog is submitted in one statement (``submit_run`` over ``generate_series``) and
analyzed (``--no-analyze``: claimed before any analyze, as a burst is before autovacuum's
next one). The baseline scans and sorts every claimable row, so it is timed only up to
``--baseline-max`` queued runs (at a million, 200 of its claims take minutes).
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time

import psycopg

from _common import database

BASELINE = """
CREATE OR REPLACE FUNCTION runledger.claim_runs_baseline(p_worker_id text, p_flows text[],
                                                         p_lease interval, p_max_runs int)
RETURNS SETOF text LANGUAGE sql AS $$
    WITH t AS MATERIALIZED (SELECT runledger.now() AS now), pinned AS (
        SELECT split_part(f, '@', 1) AS name, split_part(f, '@', 2) AS version
        FROM unnest(p_flows) f
    ), candidates AS (
        SELECT c.run_id FROM runledger.runs c
        JOIN pinned p ON p.name = c.flow AND p.version = c.flow_version, t
        WHERE (c.status = 'queued' AND c.available_at <= t.now)
           OR (c.status = 'running' AND c.lease_expires_at <= t.now)
        ORDER BY c.priority DESC, c.created_at, c.run_id
        LIMIT p_max_runs
        FOR NO KEY UPDATE OF c SKIP LOCKED
    )
    UPDATE runledger.runs r
    SET status = 'running', fencing_token = r.fencing_token + 1,
        lease_id = gen_random_uuid(), lease_owner = p_worker_id,
        lease_expires_at = runledger.now() + p_lease, claims = r.claims + 1
    FROM candidates c WHERE r.run_id = c.run_id
    RETURNING r.run_id
$$;
"""


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--backlogs", default="10000,100000,1000000")
    parser.add_argument("--claims", type=int, default=200)
    parser.add_argument("--baseline-max", type=int, default=100_000)
    parser.add_argument(
        "--no-analyze",
        action="store_true",
        help="claim before the backlog is analyzed (a burst claimed before autovacuum's next"
        " analyze)",
    )
    args = parser.parse_args()
    with database() as db:
        print(f"PostgreSQL {db.version}, {db.source}")
        print("| queued runs | claim_runs_v4 ms (median) | baseline ms (median) | speed-up |")
        print("|---:|---:|---:|---:|")
        for backlog in (int(x) for x in args.backlogs.split(",")):
            _measure(
                db.fresh(f"claims{backlog}"),
                backlog,
                args.claims,
                args.baseline_max,
                analyze=not args.no_analyze,
            )


def _measure(url: str, backlog: int, claims: int, baseline_max: int, *, analyze: bool) -> None:
    with psycopg.connect(url, autocommit=True) as c:
        if not analyze:  # nor autovacuum while the claims run
            c.execute("ALTER TABLE runledger.runs SET (autovacuum_enabled = false)")
        c.execute(BASELINE)
        c.execute(
            "SELECT count(*) FROM generate_series(0, %s - 1) n, LATERAL runledger.submit_run("
            "'q' || n, CASE WHEN n %% 2 = 1 THEN 'a' ELSE 'b' END, '1',"
            " jsonb_build_object('n', n), n %% 3) s",
            (backlog,),
        )
        if analyze:
            c.execute("ANALYZE runledger.runs")
        timings: dict[str, list[float]] = {"claim_runs_v4": [], "baseline": []}
        statements = [
            ("claim_runs_v4", "SELECT * FROM runledger.claim_runs_v4('w', %s, '1 min', 1)")
        ]
        if backlog <= baseline_max:
            statements.append(
                ("baseline", "SELECT * FROM runledger.claim_runs_baseline('w', %s, '1 min', 1)")
            )
        for _ in range(claims):
            for name, sql in statements:
                t0 = time.perf_counter()
                c.execute(sql, (["a@1", "b@1"],)).fetchall()  # type: ignore[arg-type]
                timings[name].append((time.perf_counter() - t0) * 1000)
        new = statistics.median(timings["claim_runs_v4"])
        if timings["baseline"]:
            old = statistics.median(timings["baseline"])
            print(f"| {backlog} | {new:.2f} | {old:.2f} | {old / new:.1f}x |", flush=True)
        else:
            print(f"| {backlog} | {new:.2f} | (not timed) | |", flush=True)


if __name__ == "__main__":
    sys.exit(main())
