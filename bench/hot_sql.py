"""A/B of the contract's SQL: the hot sequence of one agent run, two schemas, one cluster.

Two databases on one durable throwaway cluster (fsync on, pg_stat_statements with
track = all): ``a`` gets the living SQL of a git ref (default: the merge base with
``main``), ``b`` the living SQL of the working tree. Each repetition runs the same
sequence on both, alternating which goes first, one autocommit transaction per call as
a worker makes them (``--sequence fast``, the default: what the worker sends):

    claim_runs_v4; 3 x [record_turn_v4 (3 calls, with the checkpoint before it,
    dispatching the first), 3 x complete_call_v2 (each dispatching the next)];
    record_turn_v4 (the empty final decision, which finishes the run)

Both schemas need the functions of that sequence (any ref since revision 0018).

Reported per statement: the median over repetitions of pg_stat_statements' mean time
(top level, and the nested statements of the helpers); per tool call: the backend's CPU
(``/proc/<pid>/stat``), the wall time and the transactions. Ratios are b / a.

    .venv/bin/python bench/hot_sql.py --reps 7 --runs 100 [--ref REF] [--sequence fast|steps|group]
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

from peers import cluster as peers_cluster

ROOT = Path(__file__).resolve().parent.parent
SQL_DIR = "service/runledger/db/sql"
TURNS = 3
CALLS = 3
FLOW = "bench-agent"
SEQUENCE = "fast"


def living_sql_of(ref: str | None) -> str:
    if ref is None:
        files = sorted((ROOT / SQL_DIR).glob("*.sql"))
        return "\n".join(p.read_text(encoding="utf-8") for p in files)
    names = subprocess.run(
        ["git", "ls-tree", "--name-only", f"{ref}:{SQL_DIR}"],
        cwd=ROOT,
        check=True,
        capture_output=True,
        text=True,
    ).stdout.split()
    parts = []
    for name in sorted(n for n in names if n.endswith(".sql")):
        parts.append(
            subprocess.run(
                ["git", "show", f"{ref}:{SQL_DIR}/{name}"],
                cwd=ROOT,
                check=True,
                capture_output=True,
                text=True,
            ).stdout
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


# record_turn_v4's arguments after the lease's: turn, calls, record, output,
# expected version, state, finish, dispatch
TURN_ARGS = "%s, %s, %s, %s, %s::jsonb, %s::jsonb, %s::jsonb, %s, %s::jsonb, %s, %s::text[]"


def one_steps_run(conn: psycopg.Connection[Any], worker: str) -> None:
    """One transaction per step, nothing merged: the decision alone (``record_turn_v4``
    with no checkpoint and no dispatch), ``dispatch_call`` and ``complete_call`` per call,
    ``checkpoint``, and ``finish_run`` after the final decision."""
    ex = conn.execute
    row = ex(
        "SELECT run_id, state_version, fencing_token, lease_id "
        "FROM runledger.claim_runs_v4(%s, %s::text[], %s::interval, %s)",
        (worker, [f"{FLOW}@1"], "30 seconds", 1),
    ).fetchone()
    assert row is not None, "nothing to claim"
    run_id, version, token, lease = row
    lease_args = (run_id, lease, token)
    for turn in range(TURNS):
        calls = [{"call_id": f"c{i}", "tool": "noop", "args": {"i": i}} for i in range(CALLS)]
        ex(
            f"SELECT state_version FROM runledger.record_turn_v4({TURN_ARGS})",
            (*lease_args, turn, Jsonb(calls), None, None, version, None, False, None),
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
        f"SELECT state_version FROM runledger.record_turn_v4({TURN_ARGS})",
        (*lease_args, TURNS, Jsonb([]), None, Jsonb({"done": True}), version, None, False, None),
    )
    ex(
        "SELECT runledger.finish_run(%s, %s, %s, %s, %s::jsonb, %s)",
        (*lease_args, "succeeded", Jsonb({"done": True}), None),
    )


def one_fast_run(conn: psycopg.Connection[Any], worker: str) -> None:
    """What the worker sends: the journal comes with the claim (``claim_runs_v4``), the
    checkpoint rides on the next decision, which also dispatches its first call
    (``record_turn_v4``), a call's completion dispatches the next one
    (``complete_call_v2``), and the final empty decision finishes the run."""
    ex = conn.execute
    row = ex(
        "SELECT run_id, state_version, fencing_token, lease_id "
        "FROM runledger.claim_runs_v4(%s, %s::text[], %s::interval, %s)",
        (worker, [f"{FLOW}@1"], "30 seconds", 1),
    ).fetchone()
    assert row is not None, "nothing to claim"
    run_id, version, token, lease = row
    lease_args = (run_id, lease, token)
    for turn in range(TURNS + 1):
        final = turn == TURNS
        calls = (
            []
            if final
            else [{"call_id": f"c{i}", "tool": "noop", "args": {"i": i}} for i in range(CALLS)]
        )
        state = None if turn == 0 else Jsonb({"turn": turn})
        args = (
            *lease_args,
            turn,
            Jsonb(calls),
            None,
            Jsonb({"done": True}) if final else None,
            version,
            state,
            final,
            [] if final else ["c0"],
        )
        version = ex(
            f"SELECT state_version FROM runledger.record_turn_v4({TURN_ARGS})", args
        ).fetchone()[0]  # type: ignore[index]
        if final:
            break
        keys = [f"{run_id}:{turn}:c{i}" for i in range(CALLS)]
        for i, key in enumerate(keys):
            ex(
                "SELECT runledger.complete_call_v2(%s, %s, %s, %s, %s, %s::jsonb, %s::jsonb, %s)",
                (
                    *lease_args,
                    key,
                    "succeeded",
                    Jsonb({"ok": True, "i": i}),
                    None,
                    keys[i + 1] if i + 1 < CALLS else None,
                ),
            )


def one_group_run(conn: psycopg.Connection[Any], worker: str) -> None:
    """A parallel flow's run: each decision dispatches its group of three calls
    (``record_turn_v4``); their results, ready together, are one ``complete_calls``."""
    ex = conn.execute
    row = ex(
        "SELECT run_id, state_version, fencing_token, lease_id "
        "FROM runledger.claim_runs_v4(%s, %s::text[], %s::interval, %s)",
        (worker, [f"{FLOW}@1"], "30 seconds", 1),
    ).fetchone()
    assert row is not None, "nothing to claim"
    run_id, version, token, lease = row
    lease_args = (run_id, lease, token)
    for turn in range(TURNS + 1):
        final = turn == TURNS
        ids = [] if final else [f"c{i}" for i in range(CALLS)]
        calls = [{"call_id": c, "tool": "noop", "args": {"i": i}} for i, c in enumerate(ids)]
        version = ex(
            f"SELECT state_version FROM runledger.record_turn_v4({TURN_ARGS})",
            (
                *lease_args,
                turn,
                Jsonb(calls),
                None,
                Jsonb({"done": True}) if final else None,
                version,
                None if turn == 0 else Jsonb({"turn": turn}),
                final,
                ids,
            ),
        ).fetchone()[0]  # type: ignore[index]
        if final:
            break
        keys = [f"{run_id}:{turn}:{c}" for c in ids]
        results = [Jsonb({"ok": True, "i": i}) for i in range(CALLS)]
        ex(
            "SELECT runledger.complete_calls(%s, %s, %s, %s::text[], %s::text[],"
            " %s::jsonb[], %s::jsonb[])",
            (*lease_args, keys, ["succeeded"] * CALLS, results, [None] * CALLS),
        )


SEQUENCES = {"fast": one_fast_run, "steps": one_steps_run, "group": one_group_run}


def measure(url: str, dbname: str, admin: psycopg.Connection[Any], runs: int) -> dict[str, Any]:
    with psycopg.connect(url, autocommit=True, prepare_threshold=0) as conn:
        submit(conn, f"r{uuid.uuid4().hex[:8]}-", runs)
        run = SEQUENCES[SEQUENCE]
        run(conn, "w1")  # warm the session's caches
        pid = int(conn.execute("SELECT pg_backend_pid()").fetchone()[0])  # type: ignore[index]
        admin.execute(
            "SELECT pg_stat_statements_reset(0, (SELECT oid FROM pg_database "
            "WHERE datname = %s), 0)",
            (dbname,),
        )
        cpu0, t0 = backend_cpu(pid), time.perf_counter()
        for _ in range(runs - 1):
            run(conn, "w1")
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
    # autocommit: each top-level statement is one transaction
    xacts = sum(n for q, top, n, _ in stats if top)
    return {
        "wall_ms_call": wall * 1000 / calls,
        "cpu_ms_call": cpu * 1000 / calls,
        "tx_call": xacts / calls,
        "per": per,
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--reps", type=int, default=7)
    ap.add_argument("--runs", type=int, default=100)
    ap.add_argument("--ref", default=None, help="git ref of schema a (default: merge-base main)")
    ap.add_argument(
        "--step",
        action="append",
        default=[],
        metavar="NAME=FILE",
        help="an extra schema: a, then this file and those of the steps before it (repeatable)",
    )
    ap.add_argument(
        "--track",
        choices=("all", "top"),
        default="all",
        help="pg_stat_statements.track: top costs the backend less",
    )
    ap.add_argument(
        "--sequence",
        choices=tuple(SEQUENCES),
        default="fast",
        help="fast: what the worker sends; steps: one transaction per step, nothing merged;"
        " group: a parallel flow's run (its group's results in one commit)",
    )
    ap.add_argument("--json", type=Path, default=None, help="also write raw numbers here")
    args = ap.parse_args()
    global SEQUENCE
    SEQUENCE = args.sequence
    ref = (
        args.ref
        or subprocess.run(
            ["git", "merge-base", "HEAD", "main"],
            cwd=ROOT,
            check=True,
            capture_output=True,
            text=True,
        ).stdout.strip()
    )
    base = living_sql_of(ref)
    schemas: dict[str, str] = {"a": base}
    extra = ""
    for step in args.step:
        name, _, file = step.partition("=")
        extra += "\n" + Path(file).read_text(encoding="utf-8")
        schemas[name] = base + extra
    schemas["b"] = living_sql_of(None)
    # pg_stat_statements on top of the peers' durable settings
    peers_cluster.SETTINGS = (  # type: ignore[assignment]
        *peers_cluster.SETTINGS,
        "shared_preload_libraries=pg_stat_statements",
        f"pg_stat_statements.track={args.track}",
        "pg_stat_statements.max=5000",
    )
    results: dict[str, list[dict[str, Any]]] = {name: [] for name in schemas}
    with peers_cluster.durable_cluster() as cl:
        with cl.admin() as admin:
            admin.execute("CREATE EXTENSION IF NOT EXISTS pg_stat_statements")
        urls = {}
        for name, text in schemas.items():
            urls[name] = cl.create(f"hot_{name}")
            with psycopg.connect(urls[name], autocommit=True) as conn:
                # the roles' grants name Alembic's table (revision 0013): as migrate makes it
                conn.execute(
                    "CREATE SCHEMA runledger; CREATE TABLE runledger.alembic_version"
                    " (version_num varchar(32) PRIMARY KEY)"
                )
                conn.execute(text)
        names = list(schemas)
        with cl.admin() as admin:
            for rep in range(args.reps):
                order = names if rep % 2 == 0 else names[::-1]
                for name in order:
                    results[name].append(measure(urls[name], f"hot_{name}", admin, args.runs))
                print(f"rep {rep + 1}/{args.reps} done", file=sys.stderr)
    if args.json:
        args.json.write_text(json.dumps(results, indent=1))
    report(results, ref)


def _median(rows: list[dict[str, Any]], key: str, sub: str | None = None) -> float:
    vals = [r[key] if sub is None else r[key].get(sub) for r in rows]
    present = [v for v in vals if v is not None]
    return statistics.median(present) if present else float("nan")


def paired(rows: list[dict[str, Any]], base: list[dict[str, Any]], key: str) -> str:
    """Median of each rep's ratio to the same rep of ``base``, with the interquartile
    range (the middle half of the reps)."""
    ratios = [r[key] / b[key] for r, b in zip(rows, base, strict=True) if b[key]]
    if len(ratios) < 4:
        return f"{statistics.median(ratios):.3f}" if ratios else "-"
    q1, _, q3 = statistics.quantiles(ratios, n=4)
    return f"{statistics.median(ratios):.3f} [{q1:.3f}-{q3:.3f}]"


def report(results: dict[str, list[dict[str, Any]]], ref: str) -> None:
    names = list(results)
    a = results["a"]
    print(
        f"a = {ref[:12]} (living SQL), b = working tree; medians of {len(a)} reps; "
        "each cell: value (ratio to a)\n"
    )
    head = "| per tool call | " + " | ".join(names) + " |"
    print(head + "\n|---|" + "---:|" * len(names))
    for key in ("cpu_ms_call", "wall_ms_call", "tx_call"):
        ma = _median(a, key)
        cells = [
            f"{_median(results[n], key):.3f} ({_median(results[n], key) / ma:.2f})" for n in names
        ]
        print(f"| {key} | " + " | ".join(cells) + " |")
    # the same rep's ratios: a shared machine's speed drifts between reps more than a
    # change of a few per cent moves the medians; within a rep it drifts less
    for key in ("cpu_ms_call", "wall_ms_call"):
        cells = [paired(results[n], a, key) for n in names]
        print(f"| {key}, same-rep ratio to a | " + " | ".join(cells) + " |")
    keys = sorted(
        {k for rows in results.values() for r in rows for k in r["per"] if not k.startswith("#")},
        key=lambda k: (k.startswith("  "), k),
    )
    print("\n| statement: mean ms (calls per run) | " + " | ".join(names) + " |")
    print("|---|" + "---:|" * len(names))
    for key in keys:
        counts = [_median(results[n], "per", "#" + key) for n in names]
        if max((c for c in counts if c == c), default=0) < 0.5:
            continue
        ma = _median(a, "per", key)
        cells = []
        for n, c in zip(names, counts, strict=True):
            m = _median(results[n], "per", key)
            cells.append(
                "-"
                if m != m
                else f"{m:.4f} ({m / ma:.2f}; {c:.0f})"
                if ma == ma
                else f"{m:.4f} ({c:.0f})"
            )
        print(f"| `{key.strip()}` | " + " | ".join(cells) + " |")


if __name__ == "__main__":
    main()
