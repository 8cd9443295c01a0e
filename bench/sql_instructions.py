"""Instructions per agent run of the contract's SQL, counted by callgrind: an A/B of SQL
changes that does not depend on how busy the machine is.

On a shared machine two identical schemas can differ by 20 % in CPU time per call within
one rep of ``hot_sql.py``, so a change worth a few percent cannot be told from the noise.
valgrind's callgrind counts the instructions a process executes instead: the same binary,
inputs and data give the same count whatever else runs (two identical runs here differed
by 348 instructions in 700 million).

One durable throwaway cluster (``peers.cluster``). Each schema gets a database: ``tree``
(this tree's migrations), then one per ``--step``, each with its file and those of the
steps before it applied on top (as ``hot_sql.py --step``). Each database gets queued runs
of the peer flow. The server is then stopped, and for each schema a copy of the data
directory is run by one backend in single-user mode (``postgres --single``) under
callgrind, reading the statements a worker at concurrency 1 sends, one transaction each:
``claim_runs_v4``; per run 3 x [``record_turn_v4`` dispatching the first call,
``complete_call_v2`` twice with the next call, ``complete_call``], then
``finish_and_claim``. It does that for 2 runs and for ``2 + --runs`` runs. The difference,
divided by ``--runs``, is the instructions per run, with no start-up in it. The
statements are not prepared and carry the lease in session settings, so their own parse
and plan are in the count: the same for every schema.

    .venv/bin/python bench/sql_instructions.py [--runs 20] [--step NAME=FILE ...]
"""

from __future__ import annotations

import argparse
import json
import re
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

import psycopg

from peers.cluster import DEFAULT_BIN, _as_postgres, durable_cluster

ROOT = Path(__file__).resolve().parent.parent
CALLS = json.dumps([{"call_id": f"c{i}", "tool": "noop", "args": {"i": i}} for i in range(3)])
LEASE = "split_part(current_setting('ir.l'), ' ', 1)::uuid"
TOKEN = "split_part(current_setting('ir.l'), ' ', 2)::bigint"
RUN = "split_part(current_setting('ir.l'), ' ', 3)"
VERSION = "current_setting('ir.v')::bigint"
FLOWS = "'{peers-agent@1}'"


def script(runs: int) -> str:
    """The statements of ``runs`` runs, one per line (single-user mode's terminator)."""
    out = [
        "SELECT set_config('ir.l', (SELECT lease_id || ' ' || fencing_token || ' ' || run_id"
        f" FROM runledger.claim_runs_v4('w0', {FLOWS}, '60 s', 1)), false);",
        f"SELECT set_config('ir.v', (SELECT state_version::text FROM runledger.runs"
        f" WHERE run_id = {RUN}), false);",
    ]
    lease = f"{RUN}, {LEASE}, {TOKEN}"
    for _ in range(runs):
        for turn in range(3):
            state = "NULL" if turn == 0 else f"'{{\"completed_turns\": {turn}}}'"
            out.append(
                f"SELECT set_config('ir.v', (SELECT state_version::text FROM"
                f" runledger.record_turn_v4({lease}, {turn}, '{CALLS}', NULL, NULL, {VERSION},"
                f" {state}, false, '{{c0}}')), false);"
            )
            for c in range(3):
                key = f"{RUN} || ':{turn}:c{c}'"
                result = f'\'{{"ok": true, "i": {c}}}\''
                if c < 2:
                    out.append(
                        f"SELECT runledger.complete_call_v2({lease}, {key}, 'succeeded',"
                        f" {result}, NULL, {RUN} || ':{turn}:c{c + 1}');"
                    )
                else:
                    out.append(
                        f"SELECT runledger.complete_call({lease}, {key}, 'succeeded',"
                        f" {result}, NULL);"
                    )
        out.append(
            "SELECT set_config('ir.l', (SELECT coalesce(max(lease_id || ' ' || fencing_token"
            f" || ' ' || run_id), 'none') FROM runledger.finish_and_claim({lease}, 3, NULL,"
            f" NULL, {VERSION}, '{{\"completed_turns\": 3}}', 'w0', {FLOWS}, '60 s', 1)"
            " WHERE run_id IS NOT NULL), false);"
        )
        out.append(
            "SELECT set_config('ir.v', (SELECT coalesce(max(state_version), 0)::text"
            f" FROM runledger.runs WHERE run_id = {RUN}), false);"
        )
    return "\n".join(out) + "\n"


def prepare(url: str, files: list[Path], runs: int) -> None:
    subprocess.run(
        [sys.executable, "-m", "runledger", "migrate", "--database-url", url],
        check=True,
        capture_output=True,
        timeout=300,
    )
    with psycopg.connect(url, autocommit=True) as conn:
        for f in files:
            conn.execute(f.read_text(encoding="utf-8"))
        conn.execute(
            "SELECT count(*) FROM generate_series(1, %s) AS g CROSS JOIN LATERAL "
            "runledger.submit_run('r-' || lpad(g::text, 6, '0'), 'peers-agent', '1', "
            "'{}'::jsonb) AS s",
            (runs,),
        )
        conn.execute("CHECKPOINT")


def count(bin_dir: Path, pgdata: Path, dbname: str, runs: int, work: Path) -> int:
    """Instructions of one single-user backend that runs ``runs`` runs on a copy."""
    run_as = _as_postgres()
    copy = work / "data"
    shutil.rmtree(copy, ignore_errors=True)
    shutil.copytree(pgdata, copy, symlinks=True)
    (copy / "postmaster.pid").unlink(missing_ok=True)
    if run_as:
        subprocess.run(["chown", "-R", "postgres:", str(work)], check=True)
    stmts = work / "script.sql"
    stmts.write_text(script(runs), encoding="utf-8")
    out = work / "callgrind.out"
    with stmts.open() as stdin:
        done = subprocess.run(
            ["valgrind", "--tool=callgrind", f"--callgrind-out-file={out}",
             str(bin_dir / "postgres"), "--single", "-D", str(copy), dbname],
            stdin=stdin,
            capture_output=True,
            text=True,
            timeout=1800,
            **run_as,
        )  # fmt: skip
    errors = [line for line in done.stderr.splitlines() if " ERROR: " in line]
    if errors:
        raise RuntimeError(f"{dbname}: {errors[0]}")
    found = re.search(r"Collected : (\d+)", done.stderr)
    if done.returncode != 0 or found is None:
        raise RuntimeError(f"{dbname}: valgrind exited {done.returncode}:\n{done.stderr[-2000:]}")
    return int(found.group(1))


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n", 1)[0])
    ap.add_argument("--runs", type=int, default=20, help="runs counted per schema (20)")
    ap.add_argument(
        "--step",
        action="append",
        default=[],
        metavar="NAME=FILE",
        help="an extra schema: tree, then this file and those of the steps before it",
    )
    ap.add_argument("--pg-bin", type=Path, default=DEFAULT_BIN, help=f"default {DEFAULT_BIN}")
    args = ap.parse_args()
    if args.runs < 1:
        ap.error("--runs >= 1")
    if shutil.which("valgrind") is None:
        print("error: valgrind not found (apt-get install valgrind)", file=sys.stderr)
        return 2
    schemas: list[tuple[str, list[Path]]] = [("tree", [])]
    for step in args.step:
        name, sep, file = step.partition("=")
        path = Path(file)
        if not sep or not name.isidentifier() or not path.is_file():
            ap.error(f"--step {step!r}: NAME=FILE with an existing file")
        schemas.append((name, [*schemas[-1][1], path]))
    try:
        counts = measure(schemas, args.runs, args.pg_bin)
    except (RuntimeError, psycopg.Error, subprocess.CalledProcessError) as exc:
        print(f"error: {str(exc).strip().splitlines()[0]}", file=sys.stderr)
        return 1
    base = counts["tree"]
    print(f"\ninstructions per run ({args.runs} runs of 3 x 3 calls), PostgreSQL backend")
    print("| schema | per run | per tool call | vs tree |")
    print("|---|---:|---:|---:|")
    for name, per_run in counts.items():
        print(f"| {name} | {per_run:,} | {per_run // 9:,} | {per_run / base:.4f} |")
    return 0


def measure(schemas: list[tuple[str, list[Path]]], runs: int, bin_dir: Path) -> dict[str, int]:
    """Instructions per run of each schema."""
    counts: dict[str, int] = {}
    with durable_cluster(bin_dir) as cluster:
        for name, files in schemas:
            print(f"preparing {name} ...", file=sys.stderr)
            prepare(cluster.create(f"ir_{name}"), files, runs + 10)
        subprocess.run(
            [str(bin_dir / "pg_ctl"), "-D", str(cluster.pgdata), "-m", "fast", "-w", "stop"],
            check=True,
            capture_output=True,
            timeout=120,
            **_as_postgres(),
        )
        with tempfile.TemporaryDirectory(prefix="runledger-ir-") as tmp:
            work = Path(tmp)
            work.chmod(0o755)
            for name, _ in schemas:
                print(f"counting {name} ...", file=sys.stderr)
                small = count(bin_dir, cluster.pgdata, f"ir_{name}", 2, work)
                big = count(bin_dir, cluster.pgdata, f"ir_{name}", 2 + runs, work)
                counts[name] = (big - small) // runs
    return counts


if __name__ == "__main__":
    sys.exit(main())
