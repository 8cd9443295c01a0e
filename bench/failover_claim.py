"""What the failover checks (revision 0010) cost on the hot path: claims and writes, A/B.

One throwaway cluster (local binaries, fsync off: this measures CPU, not the disk), two
databases: ``a`` migrated to the revision before (``--before``, default 0008), ``b`` to
head. Each round runs the same calls on both, alternating which goes first, one
autocommit transaction per call over one local connection:

- ``poll``: ``claim_runs`` of a flow with no runs (a worker's poll with nothing to do:
  the timeline check and nothing else);
- ``claim 8``: the worker's claim (``claim_runs_v2`` on a, ``claim_runs_v3`` on b) of 8
  queued runs (the token computation, the check, and v3's failover_turn per run);
- ``claim_runs 8``: ``claim_runs`` of 8 on both;
- ``checkpoint``: a write under a held lease (``_lock_leased_run`` with the token check).

Printed: the median over rounds of the mean wall time per call, in microseconds.

    .venv/bin/python bench/failover_claim.py [--rounds 5] [--calls 400] [--before 0008]
"""

from __future__ import annotations

import argparse
import datetime as dt
import statistics
import time
from collections.abc import Callable
from typing import Any

import psycopg
from psycopg.types.json import Jsonb

from runledger.db import migrate
from runledger.testing.postgres import _local_bin_dirs, start_cluster

LEASE = dt.timedelta(seconds=600)


def _timed(fn: Callable[[], Any], n: int) -> float:
    start = time.perf_counter()
    for _ in range(n):
        fn()
    return (time.perf_counter() - start) / n * 1e6


def _submit(conn: psycopg.Connection[Any], prefix: str, n: int) -> None:
    with conn.transaction():
        for i in range(n):
            conn.execute(
                "SELECT runledger.submit_run(%s, 'demo', '1', %s)",
                (f"{prefix}-{i:06d}", Jsonb({"i": i})),
            )


def measure(conn: psycopg.Connection[Any], v3: bool, calls: int, rnd: int) -> dict[str, float]:
    _submit(conn, f"r{rnd}", calls * 8 * 2)
    claim = "claim_runs_v3" if v3 else "claim_runs_v2"
    out = {
        "poll": _timed(
            lambda: conn.execute(
                "SELECT * FROM runledger.claim_runs('w1', '{none@1}', %s, 8)", (LEASE,)
            ).fetchall(),
            calls,
        ),
        "claim 8": _timed(
            lambda: conn.execute(
                f"SELECT * FROM runledger.{claim}('w1', '{{demo@1}}', %s, 8)",
                (LEASE,),
            ).fetchall(),
            calls,
        ),
        "claim_runs 8": _timed(
            lambda: conn.execute(
                "SELECT * FROM runledger.claim_runs('w1', '{demo@1}', %s, 8)", (LEASE,)
            ).fetchall(),
            calls,
        ),
    }
    row = conn.execute(
        "SELECT run_id, lease_id, fencing_token, state_version FROM runledger.runs "
        "WHERE status = 'running' LIMIT 1"
    ).fetchone()
    assert row is not None
    run_id, lease_id, token, version = row
    state = {"v": version}

    def checkpoint() -> None:
        state["v"] = conn.execute(
            "SELECT runledger.checkpoint(%s, %s, %s, %s, %s)",
            (run_id, lease_id, token, state["v"], Jsonb({"n": state["v"]})),
        ).fetchone()[0]  # type: ignore[index]

    out["checkpoint"] = _timed(checkpoint, calls)
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--calls", type=int, default=400)
    ap.add_argument("--before", default="0008")
    args = ap.parse_args()
    bins = _local_bin_dirs()
    if not bins:
        raise SystemExit("no local PostgreSQL binaries (initdb, pg_ctl)")
    server = start_cluster(bins[0], "local")
    try:
        with psycopg.connect(server.admin_url, autocommit=True) as admin:
            for name in ("a", "b"):
                admin.execute(f"CREATE DATABASE {name}")  # type: ignore[arg-type]
        migrate.upgrade(server.url_for("a"), args.before)
        migrate.upgrade(server.url_for("b"))
        results: dict[str, dict[str, list[float]]] = {"a": {}, "b": {}}
        with (
            psycopg.connect(server.url_for("a"), autocommit=True) as a,
            psycopg.connect(server.url_for("b"), autocommit=True) as b,
        ):
            for rnd in range(args.rounds):
                order = [("a", a, False), ("b", b, True)]
                for name, conn, v3 in order if rnd % 2 == 0 else reversed(order):
                    for k, v in measure(conn, v3, args.calls, rnd).items():
                        results[name].setdefault(k, []).append(v)
                print(f"round {rnd + 1}/{args.rounds} done", flush=True)
        print(f"\na = revision {args.before}, b = head; median of {args.rounds} rounds, us/call")
        print("| call | a | b | b - a |\n|---|---:|---:|---:|")
        for k in results["a"]:
            ma, mb = statistics.median(results["a"][k]), statistics.median(results["b"][k])
            print(f"| {k} | {ma:.0f} | {mb:.0f} | {mb - ma:+.0f} ({mb / ma:.2f}x) |")
    finally:
        server.stop()


if __name__ == "__main__":
    main()
