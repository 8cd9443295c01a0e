"""A/B of the contract's SQL: the hot sequence of one agent run, two schemas, one cluster.

Two databases on one durable throwaway cluster (fsync on, pg_stat_statements with
track = all): ``a`` gets the living SQL of a git ref (default: the merge base with
``main``), ``b`` the living SQL of the working tree. Each repetition runs the same
sequence on both, alternating which goes first, one autocommit transaction per call as
a worker makes them:

    claim_runs; 3 x [record_turn_v2 (3 calls), 3 x (dispatch_call, complete_call),
    checkpoint]; record_turn_v2 (the empty final decision); finish_run

Reported per statement: the median over repetitions of pg_stat_statements' mean time
(top level, and the nested statements of the helpers); per tool call: the backend's CPU
(``/proc/<pid>/stat``), the wall time and the transactions. Ratios are b / a.

    .venv/bin/python bench/hot_sql.py --reps 7 --runs 100 [--ref REF]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
import uuid
from pathlib import Path
from typing import Any

import psycopg
from psycopg.types.json import Jsonb

sys.path.insert(0, str(Path(__file__).parent))
sys.path.insert(0, str(Path(__file__).parent / "peers"))

import cluster as peers_cluster  # noqa: E402

ROOT = Path(__file__).resolve().parent.parent
SQL_DIR = "service/runledger/db/sql"
TURNS = 3
CALLS = 3
FLOW = "bench-agent"


def living_sql_of(ref: str | None) -> str:
    if ref is None:
        files = sorted((ROOT / SQL_DIR).glob("*.sql"))
        return "\n".join(p.read_text(encoding="utf-8") for p in files)
    names = subprocess.run(
        ["git", "ls-tree", "--name-only", f"{ref}:{SQL_DIR}"],
        cwd=ROOT, check=True, capture_output=True, text=True,
    ).stdout.split()  # fmt: skip
    parts = []
    for name in sorted(n for n in names if n.endswith(".sql")):
        parts.append(
            subprocess.run(
                ["git", "show", f"{ref}:{SQL_DIR}/{name}"],
                cwd=ROOT, check=True, capture_output=True, text=True,
            ).stdout  # fmt: skip
        )
    return "\n".join(parts)


def backend_cpu(pid: int) -> float:
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    ticks = os.sysconf("SC_CLK_TCK")
    return (int(fields[11]) + int(fields[12])) / ticks


def submit(conn: psycopg.Connection[Any], prefix: str, runs: int) -> None:
    conn.execute(
        "SELECT count(*) FROM generate_series(1, %s) i, LATERAL runledger.submit_run("
        "%s || i, %s, '1', '{}'::jsonb) s",
        (runs, prefix, FLOW),
    )


def one_run(conn: psycopg.Connection[Any], worker: str) -> None:
    ex = conn.execute
    row = ex(
        "SELECT * FROM runledger.claim_runs(%s, %s::text[], %s::interval, %s)",
        (worker, [f"{FLOW}@1"], "30 seconds", 1),
    ).fetchone()
    assert row is not None, "nothing to claim"
    run_id, version, token, lease = row[0], row[5], row[6], row[7]
    lease_args = (run_id, lease, token)
    for turn in range(TURNS):
        calls = [{"call_id": f"c{i}", "tool": "noop", "args": {"i": i}} for i in range(CALLS)]
        ex(
            "SELECT runledger.record_turn_v2(%s, %s, %s, %s, %s::jsonb, %s::jsonb, %s::jsonb)",
            (*lease_args, turn, Jsonb(calls), None, None),
        )
        for i in range(CALLS):
            key = f"{run_id}:{turn}:c{i}"
            ex("SELECT runledger.dispatch_call(%s, %s, %s, %s) AS attempt", (*lease_args, key))
            ex(
                "SELECT runledger.complete_call(%s, %s, %s, %s, %s, %s::jsonb, %s::jsonb)",
                (*lease_args, key, "succeeded", Jsonb({"ok": True, "i": i}), None),
            )
        version = ex(
            "SELECT runledger.checkpoint(%s, %s, %s, %s, %s::jsonb) AS checkpoint",
            (*lease_args, version, Jsonb({"turn": turn + 1})),
        ).fetchone()[0]  # type: ignore[index]
    ex(
        "SELECT runledger.record_turn_v2(%s, %s, %s, %s, %s::jsonb, %s::jsonb, %s::jsonb)",
        (*lease_args, TURNS, Jsonb([]), None, Jsonb({"done": True})),
    )
    ex(
        "SELECT runledger.finish_run(%s, %s, %s, %s, %s::jsonb, %s)",
        (*lease_args, "succeeded", Jsonb({"done": True}), None),
    )


def measure(url: str, dbname: str, admin: psycopg.Connection[Any], runs: int) -> dict[str, Any]:
    with psycopg.connect(url, autocommit=True, prepare_threshold=0) as conn:
        submit(conn, f"r{uuid.uuid4().hex[:8]}-", runs)
        one_run(conn, "w1")  # warm the session's caches
        pid = int(conn.execute("SELECT pg_backend_pid()").fetchone()[0])  # type: ignore[index]
        admin.execute("SELECT pg_stat_statements_reset(0, (SELECT oid FROM pg_database "
                      "WHERE datname = %s), 0)", (dbname,))  # fmt: skip
        cpu0, t0 = backend_cpu(pid), time.perf_counter()
        for _ in range(runs - 1):
            one_run(conn, "w1")
        wall, cpu = time.perf_counter() - t0, backend_cpu(pid) - cpu0
    stats = admin.execute(
        "SELECT query, toplevel, calls, mean_exec_time FROM pg_stat_statements s "
        "JOIN pg_database d ON d.oid = s.dbid WHERE d.datname = %s",
        (dbname,),
    ).fetchall()
    calls = (runs - 1) * TURNS * CALLS
    per: dict[str, float] = {}
    for query, toplevel, n, mean in stats:
        key = ("" if toplevel else "  nested: ") + " ".join(query.split())[:90]
        per[key] = mean
        per["#" + key] = n / (runs - 1)
    return {"wall_ms_call": wall * 1000 / calls, "cpu_ms_call": cpu * 1000 / calls, "per": per}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--reps", type=int, default=7)
    ap.add_argument("--runs", type=int, default=100)
    ap.add_argument("--ref", default=None, help="git ref of schema a (default: merge-base main)")
    ap.add_argument("--json", type=Path, default=None, help="also write raw numbers here")
    args = ap.parse_args()
    ref = args.ref or subprocess.run(
        ["git", "merge-base", "HEAD", "main"], cwd=ROOT, check=True, capture_output=True,
        text=True,
    ).stdout.strip()  # fmt: skip
    # pg_stat_statements on top of the peers' durable settings
    peers_cluster.SETTINGS = (*peers_cluster.SETTINGS,  # type: ignore[misc]
        "shared_preload_libraries=pg_stat_statements", "pg_stat_statements.track=all",
        "pg_stat_statements.max=5000", "track_functions=all")  # fmt: skip
    results: dict[str, list[dict[str, Any]]] = {"a": [], "b": []}
    with peers_cluster.durable_cluster() as cl:
        with cl.admin() as admin:
            admin.execute("CREATE EXTENSION IF NOT EXISTS pg_stat_statements")
        urls = {}
        for name, source in (("a", ref), ("b", None)):
            urls[name] = cl.create(f"hot_{name}")
            with psycopg.connect(urls[name], autocommit=True) as conn:
                conn.execute(living_sql_of(source))  # type: ignore[arg-type]
        with cl.admin() as admin:
            for rep in range(args.reps):
                order = ("a", "b") if rep % 2 == 0 else ("b", "a")
                for name in order:
                    results[name].append(measure(urls[name], f"hot_{name}", admin, args.runs))
                print(f"rep {rep + 1}/{args.reps} done", file=sys.stderr)
    if args.json:
        args.json.write_text(json.dumps(results, indent=1))
    report(results, ref)


def _median(rows: list[dict[str, Any]], key: str, sub: str | None = None) -> float:
    vals = [(r[key] if sub is None else r[key].get(sub)) for r in rows]
    return statistics.median(v for v in vals if v is not None) if any(
        v is not None for v in vals
    ) else float("nan")


def report(results: dict[str, list[dict[str, Any]]], ref: str) -> None:
    a, b = results["a"], results["b"]
    print(f"a = {ref[:12]} (living SQL), b = working tree; medians of {len(a)} reps\n")
    print("| per tool call | a | b | b/a |\n|---|---:|---:|---:|")
    for key in ("cpu_ms_call", "wall_ms_call"):
        ma, mb = _median(a, key), _median(b, key)
        print(f"| {key} | {ma:.3f} | {mb:.3f} | {mb / ma:.2f} |")
    keys = sorted({k for r in a + b for k in r["per"] if not k.startswith("#")},
                  key=lambda k: (k.startswith("  "), k))  # fmt: skip
    print("\n| statement (mean ms; calls per run) | a | b | b/a |\n|---|---:|---:|---:|")
    for key in keys:
        ma, mb = _median(a, "per", key), _median(b, "per", key)
        na, nb = _median(a, "per", "#" + key), _median(b, "per", "#" + key)
        if max(na if na == na else 0, nb if nb == nb else 0) < 0.5:
            continue
        ratio = mb / ma if ma and ma == ma and mb == mb else float("nan")
        print(f"| `{key.strip()}` ({na:.1f}; {nb:.1f}) | {ma:.4f} | {mb:.4f} | {ratio:.2f} |")


if __name__ == "__main__":
    main()
