"""runledger next to Absurd and DBOS: tool calls/s, transactions, CPU and latency per call.

    .venv/bin/python bench/peers.py [--reps 3] [--runs 1000] \
        [--systems runledger,absurd,dbos] [--json out.json]

The workload is an agent run of 3 turns x 3 no-op tool calls (9 calls), then an empty
decision; for Absurd a task of 9 ``ctx.step`` calls, for DBOS a workflow of 9
``@DBOS.step`` calls. Everything runs on one dedicated throwaway cluster with fsync on
(local binaries, ``--pg-bin``), each system in its own fresh database per rep; the reps
interleave the systems (rep 1: runledger, absurd, dbos; rep 2: dbos, absurd, runledger;
the order alternates so that no place in a rep favours a system). In each rep and
for each system: ``--runs`` runs are submitted, then the workers start (throughput);
then, on another fresh database, ``--seq-runs`` runs through 1 worker with concurrency 1
(sequential latency). See bench/README.md for what each column measures.

Needs the ``[bench]`` extra (absurd-sdk, absurdctl, dbos); installs nothing itself.
Data (a markdown table) on stdout, progress on stderr.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import platform
import sys
import time
from pathlib import Path
from typing import Any

from _common import background_load, load_note, say, shielded, stop_on_sigterm
from peers.cluster import DEFAULT_BIN, SETTINGS, durable_cluster
from peers.harness import Batch, Side, measure
from peers.report import render, summarize

SYSTEMS = ("runledger", "absurd", "dbos")
REF = "runledger-ref"  # --rl-ref: runledger from another checkout, beside this one
SQL = "runledger-sql"  # runledger's statements from bare clients: the floor under the worker
NEEDS = {"absurd": "absurd_sdk", "dbos": "dbos"}  # the [bench] extra


def make_side(name: str, args: argparse.Namespace) -> Side:
    if name in ("runledger", REF):
        from peers.rl_side import Runledger

        ref = args.rl_ref if name == REF else None
        return Runledger(args.rl_workers, args.rl_concurrency, ref)
    if name == SQL:
        from peers.rl_sql_side import RunledgerSql

        return RunledgerSql(args.sql_clients)
    if name == "absurd":
        from peers.absurd_side import AbsurdSide

        return AbsurdSide(args.absurd_workers, args.absurd_concurrency)
    from peers.dbos_side import DbosSide

    return DbosSide(args.dbos_concurrency, args.dbos_poll_seconds)


def versions() -> dict[str, str]:
    from importlib.metadata import PackageNotFoundError, version

    out = {"python": platform.python_version()}
    for dist in ("runledger-pg", "absurd-sdk", "dbos", "psycopg"):
        try:
            out[dist] = version(dist)
        except PackageNotFoundError:
            out[dist] = "not installed"
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n", 1)[0])
    ap.add_argument("--reps", type=int, default=3, help="repetitions (default 3)")
    ap.add_argument("--runs", type=int, default=1000, help="runs per throughput batch (1000)")
    ap.add_argument("--seq-runs", type=int, default=30, help="runs of the sequential batch (30)")
    ap.add_argument("--systems", default=",".join(SYSTEMS), help="default runledger,absurd,dbos")
    ap.add_argument("--json", type=Path, help="also write every batch and the summary here")
    ap.add_argument("--rl-workers", type=int, default=2, help="runledger workers (2)")
    ap.add_argument("--rl-concurrency", type=int, default=32, help="runledger --concurrency (32)")
    ap.add_argument(
        "--absurd-workers", type=int, default=8, help="Absurd workers (8: its best here)"
    )
    ap.add_argument(
        "--absurd-concurrency", type=int, default=1, help="Absurd start_worker concurrency (1)"
    )
    ap.add_argument(
        "--dbos-concurrency", type=int, default=4, help="DBOS queue worker_concurrency (4)"
    )
    ap.add_argument(
        "--dbos-poll-seconds", type=float, default=0.01, help="DBOS queue polling interval (0.01)"
    )
    ap.add_argument(
        "--rl-parallel",
        action="store_true",
        help="runledger's flow with parallel_calls: each turn's 3 calls are one group",
    )
    ap.add_argument(
        "--rl-ref",
        type=Path,
        help="another checkout (e.g. a git worktree of the previous release): its runledger "
        "runs as system runledger-ref next to this tree's, rep by rep",
    )
    ap.add_argument(
        "--sql-clients",
        type=int,
        default=8,
        help=f"{SQL}'s bare clients in the throughput batch (8; 1 in the sequential one)",
    )
    ap.add_argument("--sample-seconds", type=float, default=0.1, help="progress/CPU sampling")
    ap.add_argument("--pg-bin", type=Path, default=DEFAULT_BIN, help=f"default {DEFAULT_BIN}")
    args = ap.parse_args(argv)
    if args.rl_parallel:
        os.environ["PEERS_RL_PARALLEL"] = "1"  # read by peers.rl_flow in the workers
    names = [s.strip() for s in args.systems.split(",") if s.strip()]
    if args.rl_ref is not None and REF not in names:
        names.insert(names.index("runledger") + 1 if "runledger" in names else 0, REF)
    for n in names:
        if n not in (*SYSTEMS, REF, SQL) or (n == REF and args.rl_ref is None):
            ap.error(f"unknown system {n!r}; choose from {', '.join((*SYSTEMS, SQL))}")
    if args.reps < 1 or args.runs < 10 or args.seq_runs < 2 or args.sql_clients < 1:
        ap.error("--reps >= 1, --runs >= 10, --seq-runs >= 2 and --sql-clients >= 1")
    missing = [m for n, m in NEEDS.items() if n in names and importlib.util.find_spec(m) is None]
    if missing:
        print(
            f"error: {', '.join(missing)} not installed: pip install -e '.[bench]'", file=sys.stderr
        )
        return 2
    sides = [make_side(n, args) for n in names]
    stop_on_sigterm()
    before = background_load()
    started = time.monotonic()
    batches: list[Batch] = []
    with durable_cluster(args.pg_bin) as cluster:
        say(f"PostgreSQL {cluster.version}, throwaway cluster in {cluster.pgdata} (fsync on)")
        for side in sides:
            say(f"preparing {side.name} ...")
            side.prepare(cluster)
        for rep in range(1, args.reps + 1):
            # the order alternates by rep: a system's place in a rep (first after the
            # previous rep's last, or right after another) favours none of them
            for side in sides if rep % 2 else sides[::-1]:
                say(f"rep {rep}/{args.reps}: {side.name}, {args.runs} runs ...")
                batches.append(
                    measure(side, cluster, rep=rep, runs=args.runs, sequential=False,
                            sample_seconds=args.sample_seconds)
                )  # fmt: skip
                batches.append(
                    measure(side, cluster, rep=rep, runs=args.seq_runs, sequential=True,
                            sample_seconds=args.sample_seconds / 2)
                )  # fmt: skip
        version = cluster.version
    summary = summarize(batches, names)
    meta: dict[str, Any] = {
        "postgres": version,
        "cluster": list(SETTINGS),
        "cpus": os.cpu_count(),
        "busy_before": before,
        "reps": args.reps,
        "runs": args.runs,
        "seq_runs": args.seq_runs,
        "versions": versions(),
    }
    print()
    print(
        f"{args.reps} reps x {args.runs} runs (9 tool calls each) per system, interleaved; "
        f"PostgreSQL {version}, dedicated throwaway cluster, fsync on; {os.cpu_count()} CPUs; "
        f"{load_note(before)}"
    )
    print(render(summary))
    print()
    print(
        "medians over the reps, [min-max]; calls/s between 10 % and 90 % of the calls "
        "completed, from the database's timestamps; vs runledger = median of each rep's "
        "calls/s over runledger's in the same rep; xact/call = pg_stat_database "
        "commits + rollbacks of the system's database / calls; CPU = worker processes + "
        "the whole cluster, between 10 % and 90 %; sequential = 1 worker, concurrency 1, "
        f"{args.seq_runs} runs, the median time from one run's last call to the next's / 9 "
        "(then, for a peer, the median of its same-rep ratios to runledger's time); "
        "other jobs = cores busy with "
        "processes outside the benchmark (well above 0: noisy numbers, trust the ratios); "
        "worker RSS = the largest resident set of one worker process during the throughput "
        "batches (Absurd runs one process per concurrent task)."
    )
    if args.json:
        with shielded():
            args.json.write_text(
                json.dumps(
                    {"meta": meta, "summary": summary, "batches": [b.as_dict() for b in batches]},
                    indent=2,
                )
            )
        say(f"wrote {args.json}")
    say(f"total {time.monotonic() - started:.0f} s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
