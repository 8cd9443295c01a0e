"""How far one primary carries runledger: durable throughput, and the hot path as
finished runs pile up.

    .venv/bin/python bench/capacity.py throughput [--runs 1000]
    .venv/bin/python bench/capacity.py retention [--retained 0,100000,1000000] [--reps 5]

``throughput`` runs ``bench/throughput.py`` twice, each time on a cluster of its own
(``private_cluster``): first durable (``fsync``, ``synchronous_commit`` and
``full_page_writes`` on), then with the test clusters' ``fsync=off``. Both load
``pg_stat_statements`` and set ``track_wal_io_timing``; ``throughput.py`` reaches the
cluster through ``RUNLEDGER_TEST_DATABASE_URL``, so each of its scenarios still gets a
fresh clone of the migrated template. Beside its table this prints, per phase (one
scenario, its warm-up and worker start included), what ``pg_stat_wal`` counted: WAL
bytes and full-page images per run, WAL flushes (``wal_sync``) and the time spent in
them; and the statements that took the most server time.

``retention`` makes one database per ``--retained`` count on one throwaway cluster
(``--durable``: a durable one). Each holds that many finished one-call runs: 1,000 are
driven through the contract's functions (the SQL loop of ``throughput.py``), then copied
by ``INSERT ... SELECT`` with new run ids (32 hex digits, spread over the key space as
uuid run ids are) and timestamps 60 days back, their turns, calls and events with them
(an event's hash is copied, so the copies' chains do not verify: the database is thrown
away). Then, rep by rep, each rep after a ``CHECKPOINT``, the databases in rotating
order, ``--runs-per-rep`` fresh one-call runs (uuid run ids) go through the same SQL
loop on each, every statement timed. It prints the table and index sizes and the bytes
per retained run, the median time of each statement against the database with none
retained, the WAL those runs wrote, and what ``runledger prune --older-than 30d
--events`` and ``checkpoint_events`` cost on the ``--prune-at`` database.

Data on stdout (markdown tables), progress on stderr.
"""

from __future__ import annotations

import argparse
import contextlib
import datetime as dt
import json
import os
import statistics
import subprocess
import sys
import tempfile
import threading
import time
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import psycopg
from psycopg.types.json import Jsonb
from throughput import CLAIM, COMPLETE, READ_CALL, RECORD, SUBMIT, baseline

from runledger.testing.postgres import Databases, Server, private_cluster

from _common import background_load, load_note, say, shielded, stop_on_sigterm, table

HERE = Path(__file__).resolve().parent
CLI = str(Path(sys.executable).with_name("runledger"))
OBSERVED = {
    "shared_preload_libraries": "pg_stat_statements",
    "track_wal_io_timing": "on",
    "track_io_timing": "on",
}
DURABLE = {"fsync": "on", "synchronous_commit": "on", "full_page_writes": "on"}
FAST = {"fsync": "off", "synchronous_commit": "off", "full_page_writes": "off"}
WAL = (
    "SELECT wal_records, wal_fpi, wal_bytes, wal_write, wal_sync, wal_write_time, "
    "wal_sync_time FROM pg_stat_wal"
)
TABLES = ["runs", "run_turns", "run_calls", "run_events"]


@contextlib.contextmanager
def cluster(durable: bool) -> Iterator[Server]:
    settings = {**OBSERVED, **(DURABLE if durable else FAST)}
    say(f"starting a private cluster: {settings}")
    server = private_cluster(settings=settings)
    try:
        with psycopg.connect(server.admin_url, autocommit=True) as c:
            c.execute("CREATE EXTENSION IF NOT EXISTS pg_stat_statements")
        yield server
    finally:
        with shielded():
            server.stop()


# -- throughput -----------------------------------------------------------------------------


class WalSampler:
    """``pg_stat_wal`` with the database clock, every ``interval`` seconds, in a thread."""

    def __init__(self, url: str, interval: float = 0.25) -> None:
        self.url = url
        self.interval = interval
        self.samples: list[tuple[dt.datetime, tuple[float, ...]]] = []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def _run(self) -> None:
        with psycopg.connect(self.url, autocommit=True) as c:
            while not self._stop.is_set():
                row = c.execute(f"SELECT clock_timestamp(), * FROM ({WAL}) w").fetchone()
                assert row is not None
                self.samples.append((row[0], tuple(float(x) for x in row[1:])))
                self._stop.wait(self.interval)

    def __enter__(self) -> WalSampler:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join()

    def window(
        self, start: dt.datetime, end: dt.datetime
    ) -> tuple[dt.datetime, dt.datetime, list[float]] | None:
        """The samples just inside [start, end] and the counters' change between them."""
        inside = [s for s in self.samples if start <= s[0] <= end]
        if len(inside) < 2:
            return None
        (t0, a), (t1, b) = inside[0], inside[-1]
        return t0, t1, [y - x for x, y in zip(a, b, strict=True)]


BATCHES = """
SELECT regexp_replace(run_id, '-[0-9]+$', '') AS batch, min(created_at), max(finished_at)
FROM runledger.runs GROUP BY 1 HAVING regexp_replace(run_id, '-[0-9]+$', '') NOT LIKE '%-warm'
ORDER BY 2
"""


def throughput(args: argparse.Namespace, passthrough: list[str]) -> None:
    for durable in (True, False):
        mode = "durable (fsync, synchronous_commit on)" if durable else "fsync off"
        with cluster(durable) as server:
            url = server.admin_url
            with psycopg.connect(url, autocommit=True) as c:
                c.execute("SELECT pg_stat_statements_reset()")
                c.execute("SELECT pg_stat_reset_shared('wal')")
            env = dict(os.environ, RUNLEDGER_TEST_DATABASE_URL=url, RUNLEDGER_TEST_POSTGRES="url")
            env.pop("RUNLEDGER_DATABASE_URL", None)
            cmd = [sys.executable, str(HERE / "throughput.py"), *passthrough]
            say(f"{mode}: {' '.join(cmd[1:])}")
            with tempfile.TemporaryFile("w+") as out, WalSampler(url) as sampler:
                proc = subprocess.Popen(cmd, stdout=out, env=env, cwd=HERE.parent)
                if proc.wait() != 0:
                    raise RuntimeError(f"throughput.py exited {proc.returncode}")
                out.seek(0)
                report = out.read()
            rows = []
            with psycopg.connect(url, autocommit=True) as c:
                names = [
                    r[0]
                    for r in c.execute(
                        "SELECT datname FROM pg_database WHERE datname LIKE 'runledger_bench%'"
                    )
                ]
                top: list[Any] = c.execute(
                    "SELECT left(regexp_replace(query, '\\s+', ' ', 'g'), 70), calls,"
                    " round(total_exec_time::numeric / 1000, 2), round(mean_exec_time::numeric, 3)"
                    " FROM pg_stat_statements WHERE query NOT ILIKE 'CREATE DATABASE%%'"
                    " ORDER BY total_exec_time DESC LIMIT 8"
                ).fetchall()
                per_db = {
                    r[0]: (r[1], r[2])
                    for r in c.execute(
                        "SELECT d.datname, sum(s.wal_bytes), sum(s.wal_fpi)"
                        " FROM pg_stat_statements s JOIN pg_database d ON d.oid = s.dbid"
                        " GROUP BY 1"
                    )
                }
                settings = c.execute(
                    "SELECT string_agg(name || '=' || setting, ', ' ORDER BY name) FROM pg_settings"
                    " WHERE name IN ('fsync', 'synchronous_commit', 'full_page_writes',"
                    " 'wal_sync_method', 'shared_buffers', 'max_wal_size')"
                ).fetchone()
            for name in names:
                with psycopg.connect(server.url_for(name), autocommit=True) as c:
                    (total,) = c.execute("SELECT count(*) FROM runledger.runs").fetchone() or (0,)
                    wal_bytes, fpi = per_db.get(name, (0, 0))
                    for batch, start, end in c.execute(BATCHES).fetchall():
                        row = [
                            batch.split("-", 1)[1],
                            f"{total}",
                            f"{float(wal_bytes or 0) / max(total, 1) / 1024:.1f}",
                            f"{float(fpi or 0) / max(total, 1):.2f}",
                        ]
                        w = sampler.window(start, end)
                        if w is None:
                            rows.append(row + ["-"] * 4)
                            continue
                        t0, t1, d = w
                        (runs,) = c.execute(
                            "SELECT count(*) FROM runledger.runs WHERE finished_at"
                            " BETWEEN %s AND %s",
                            (t0, t1),
                        ).fetchone() or (0,)
                        wall = (t1 - t0).total_seconds()
                        rows.append(
                            [
                                *row,
                                f"{wall:.1f}",
                                f"{d[4] / max(runs, 1):.2f}",
                                f"{d[6] / max(d[4], 1):.2f}",
                                f"{d[6] / 1000 / max(wall, 1e-09):.2f}",
                            ]
                        )
        print(f"\n## {mode}\n\nsettings: {settings[0] if settings else '?'}\n")
        print(report)
        print(
            "WAL per scenario: bytes and full-page images from pg_stat_statements over the"
            " scenario's database (every run in it, the warm-up's included; commit records not"
            " counted); flushes from pg_stat_wal sampled every 0.25 s on the database clock,"
            " between the first and the last sample inside the measured batch (backends"
            " report to pg_stat_wal up to 1 s late: approximate)\n"
        )
        print(
            table(
                [
                    "batch",
                    "runs in database",
                    "WAL KiB/run",
                    "full-page images/run",
                    "window s",
                    "WAL flushes/run",
                    "ms per flush",
                    "flushing share of window",
                ],
                rows,
            )
        )
        print("\nserver time by statement (pg_stat_statements, whole invocation)\n")
        print(table(["statement", "calls", "total s", "mean ms"], [list(r) for r in top]))


# -- retention ------------------------------------------------------------------------------

SHIFT = "{col} - %(back)s::interval + g.g * interval '1 s'"
# a copy's id: 32 hex digits, spread over the key space as uuid run ids are
NEW_ID = "md5(g.g || '-' || {alias}.run_id)"
# (table, alias, the columns a copy changes), copied in this order; other columns as they are
COPIES = [
    (
        "runs",
        "r",
        {
            "run_id": NEW_ID,
            **{
                col: SHIFT.format(col=f"r.{col}")
                for col in ("created_at", "available_at", "updated_at", "finished_at")
            },
        },
    ),
    ("run_turns", "t", {"run_id": NEW_ID}),
    (
        "run_calls",
        "k",
        {
            "run_id": NEW_ID,
            "idempotency_key": NEW_ID + " || ':' || k.turn || ':' || k.call_id",
        },
    ),
    (
        "run_events",
        "e",
        {
            "event_id": "nextval('runledger.run_events_event_id_seq')",
            "run_id": NEW_ID,
            "at": SHIFT.format(col="e.at"),
        },
    ),
]


def copy_sql(c: psycopg.Connection[Any], name: str, alias: str, changed: dict[str, str]) -> str:
    """INSERT ... SELECT of the seed rows of ``name``, ``%(copies)s`` times."""
    cols = [
        r[0]
        for r in c.execute(
            "SELECT attname FROM pg_attribute WHERE attrelid = %s::regclass AND attnum > 0"
            " AND NOT attisdropped ORDER BY attnum",
            (f"runledger.{name}",),
        )
    ]
    exprs = ", ".join(changed.get(col, f'{alias}."{col}"').format(alias=alias) for col in cols)
    order = " ORDER BY g.g, e.event_id" if name == "run_events" else ""
    quoted = ", ".join(f'"{x}"' for x in cols)
    return (
        f"INSERT INTO runledger.{name} ({quoted}) SELECT {exprs}"
        f" FROM generate_series(1, %(copies)s) g, runledger.{name} {alias}"
        f" WHERE {alias}.run_id LIKE %(seed)s{order}"
    )


SIZES = """
SELECT c.relname, pg_relation_size(c.oid), pg_indexes_size(c.oid),
       coalesce(pg_relation_size(c.reltoastrelid), 0), c.reltuples::bigint
FROM pg_class c JOIN pg_namespace n ON n.oid = c.relnamespace
WHERE n.nspname = 'runledger' AND c.relkind = 'r'
  AND c.relname = ANY(%s)
ORDER BY c.relname
"""
STEPS = [
    "submit_run",
    "claim_runs_v4",
    "record_turn_v4 (call)",
    "complete_call",
    "record_turn_v4 (finish)",
]


def load(url: str, retained: int, seed_runs: int) -> float:
    """``retained`` finished one-call runs in the database at ``url``; returns seconds."""
    t0 = time.perf_counter()
    if retained == 0:
        return 0.0
    seed = min(seed_runs, retained)
    copies = retained // seed - 1
    with psycopg.connect(url, autocommit=True) as c:
        baseline(c, "seed", "one-call", seed, dt.timedelta(minutes=5), upfront=False)
        params = {"seed": "seed-%", "copies": copies, "back": "60 days"}
        if copies:
            for name, alias, changed in COPIES:
                t = time.perf_counter()
                c.execute(copy_sql(c, name, alias, changed), params)  # type: ignore[arg-type]
                say(f"  {retained:,}: copied {name} in {time.perf_counter() - t:.1f} s")
        c.execute(
            "VACUUM ANALYZE runledger.runs, runledger.run_turns, runledger.run_calls,"
            " runledger.run_events"
        )
        c.execute("CHECKPOINT")
    return time.perf_counter() - t0


def sizes(url: str) -> dict[str, tuple[int, int, int, int]]:
    with psycopg.connect(url, autocommit=True) as c:
        rows = c.execute(SIZES, ([*TABLES, "event_chain_prunes", "event_checkpoint_heads"],))
        return {r[0]: (int(r[1]), int(r[2]), int(r[3]), int(r[4])) for r in rows.fetchall()}


def hot_path(url: str, prefix: str, n: int) -> dict[str, list[float]]:
    """``n`` one-call runs through the SQL loop, every statement timed (ms)."""
    times: dict[str, list[float]] = {s: [] for s in STEPS}
    lease = dt.timedelta(minutes=5)
    flows = ["scripted@1", "ticket-triage@1"]
    with psycopg.connect(url, autocommit=True) as c:

        def timed(step: str, sql: str, params: tuple[Any, ...]) -> Any:
            t = time.perf_counter()
            row = c.execute(sql, params).fetchone()  # type: ignore[arg-type]
            times[step].append((time.perf_counter() - t) * 1000)
            return row

        for _ in range(n):
            run_id = uuid.uuid4().hex  # spread over the indexes, as uuid run ids are
            timed("submit_run", SUBMIT, (run_id, Jsonb({"plan": [[{"tool": "read"}]]})))
            row = timed("claim_runs_v4", CLAIM, (f"{prefix}-w", flows, lease))
            assert row is not None and row[0] == run_id, row
            _, token, lease_id, version = row
            lease_args = (run_id, lease_id, token)
            row = timed(
                "record_turn_v4 (call)",
                RECORD,
                (*lease_args, 0, Jsonb(READ_CALL), None, version, None, False, ["c0"]),
            )
            timed(
                "complete_call",
                COMPLETE,
                (*lease_args, f"{run_id}:0:c0", Jsonb({"what": "x", "seen": 0})),
            )
            timed(
                "record_turn_v4 (finish)",
                RECORD,
                (
                    *lease_args,
                    1,
                    Jsonb([]),
                    Jsonb({"turns": 2, "calls": 1}),
                    row[0],
                    Jsonb({"completed_turns": 1}),
                    True,
                    None,
                ),
            )
    return times


def retention(args: argparse.Namespace) -> None:
    counts = [int(x) for x in args.retained.split(",")]
    if counts[0] != 0:
        counts.insert(0, 0)
    started = time.monotonic()
    with cluster(args.durable) as server:
        dbs = Databases(server)
        dbs.ensure_template()
        urls = {n: dbs.create(f"retained{n}") for n in counts}
        loaded = {}
        for n in counts:
            say(f"loading {n:,} finished runs ...")
            loaded[n] = load(urls[n], n, args.seed_runs)
            say(f"  {n:,}: {loaded[n]:.1f} s")
        size = {n: sizes(urls[n]) for n in counts}
        times: dict[int, dict[str, list[float]]] = {n: {s: [] for s in STEPS} for n in counts}
        per_rep: dict[int, list[float]] = {n: [] for n in counts}
        with psycopg.connect(server.admin_url, autocommit=True) as c:
            c.execute("SELECT pg_stat_statements_reset()")
        for rep in range(args.reps):
            with psycopg.connect(server.admin_url, autocommit=True) as c:
                c.execute("CHECKPOINT")  # each rep starts a checkpoint cycle: full-page images
            order = counts[rep % len(counts) :] + counts[: rep % len(counts)]
            for n in order:
                t = hot_path(urls[n], f"h{rep}", args.runs_per_rep)
                for s in STEPS:
                    times[n][s].extend(t[s])
                per_rep[n].append(sum(statistics.median(t[s]) for s in STEPS))
            say(
                f"rep {rep + 1}/{args.reps}: "
                + ", ".join(f"{n:,}: {per_rep[n][-1]:.2f} ms/run" for n in counts)
            )
        with psycopg.connect(server.admin_url, autocommit=True) as c:
            per_db = {
                r[0]: (float(r[1] or 0), float(r[2] or 0))
                for r in c.execute(
                    "SELECT d.datname, sum(s.wal_bytes), sum(s.wal_fpi)"
                    " FROM pg_stat_statements s JOIN pg_database d ON d.oid = s.dbid"
                    " GROUP BY 1"
                )
            }
        hot_runs = args.reps * args.runs_per_rep
        wal_rows = []
        for n in counts:
            name = urls[n].rsplit("/", 1)[1].split("?")[0]
            wal_bytes, fpi = per_db.get(name, (0.0, 0.0))
            wal_rows.append(
                [f"{n:,}", f"{wal_bytes / hot_runs / 1024:.1f}", f"{fpi / hot_runs:.2f}"]
            )
        prune_rows = []
        if args.prune_at and args.prune_at in urls:
            url = urls[args.prune_at]
            t0 = time.perf_counter()
            made = []
            with psycopg.connect(url, autocommit=True) as c:
                (last,) = c.execute("SELECT max(event_id) FROM runledger.run_events").fetchone()
                while True:
                    row = c.execute(
                        "SELECT through_event_id FROM runledger.checkpoint_events('bench', '0')"
                    ).fetchone()
                    made.append(row)
                    if row is None or row[0] >= last:
                        break
            took = time.perf_counter() - t0
            prune_rows.append(
                [
                    f"checkpoint_events over {args.prune_at:,} runs ({len(made)} calls)",
                    f"{took:.1f} s",
                ]
            )
            t0 = time.perf_counter()
            out = subprocess.run(
                [CLI, "prune", "--older-than", "30d", "--events", "--json", "--database-url", url],
                check=True,
                capture_output=True,
                text=True,
            )
            took = time.perf_counter() - t0
            doc = json.loads(out.stdout)
            prune_rows.append(
                [
                    f"runledger prune --older-than 30d --events ({doc['runs']:,} runs, "
                    f"{doc['batches']} batches, their events too: {doc['events_deleted']})",
                    f"{took:.1f} s (its own count: {doc['seconds']:.1f} s)",
                ]
            )
            after = sizes(url)
            for name in ("event_checkpoint_heads", "event_chain_prunes"):
                a = after.get(name, (0, 0, 0, 0))
                with psycopg.connect(url, autocommit=True) as c:
                    (count,) = c.execute(f"SELECT count(*) FROM runledger.{name}").fetchone()
                prune_rows.append(
                    [
                        f"{name} after ({count:,} rows)",
                        f"{(a[0] + a[1] + a[2]) / max(doc['runs'], 1):.0f} bytes per pruned run",
                    ]
                )
            with psycopg.connect(url, autocommit=True) as c:
                c.execute(
                    "VACUUM runledger.runs, runledger.run_turns, runledger.run_calls,"
                    " runledger.run_events"
                )
                t = hot_path(url, "after-prune", args.runs_per_rep)
            prune_rows.append(
                [
                    "the hot path after the prune and a VACUUM (one rep)",
                    f"{sum(statistics.median(t[s]) for s in STEPS):.2f} ms/run",
                ]
            )

    print(
        f"\n{'durable' if args.durable else 'fsync off'} private cluster; "
        f"{args.reps} reps x {args.runs_per_rep} one-call runs per database\n"
    )
    rows = []
    for n in counts:
        s = size[n]
        total = sum(sum(v[:3]) for k, v in s.items() if k in TABLES)
        rows.append(
            [f"{n:,}", f"{loaded[n]:.0f}"]
            + [f"{(s[t][0] + s[t][2]) / 2**20:.0f} + {s[t][1] / 2**20:.0f}" for t in TABLES]
            + [f"{total / 2**20:.0f}"]
        )
    print(
        table(
            ["retained runs", "load s"]
            + [f"{t} MB (heap + indexes)" for t in TABLES]
            + ["total MB"],
            rows,
        )
    )
    if len(counts) > 1:
        a, b = counts[0], counts[-1]
        per = []
        for t in TABLES:
            d = [size[b][t][i] - size[a][t][i] for i in range(3)]
            per.append(f"{t}: {(d[0] + d[2]) / (b - a):.0f} + {d[1] / (b - a):.0f}")
        print(f"\nbytes per retained run (heap + indexes), {a:,} to {b:,}: " + "; ".join(per))
    print()
    rows = []
    for s in [*STEPS, "whole run (sum of medians)"]:
        row = [s]
        for n in counts:
            if s in STEPS:
                v = statistics.median(times[n][s])
                base = statistics.median(times[counts[0]][s])
            else:
                v = statistics.median(per_rep[n])
                base = statistics.median(per_rep[counts[0]])
            row.append(f"{v:.3f} ({v / base:.2f}x)")
        rows.append(row)
    print(table(["statement, median ms"] + [f"{n:,} retained" for n in counts], rows))
    rows = []
    for n in counts[1:]:
        ratios = [x / y for x, y in zip(per_rep[n], per_rep[counts[0]], strict=True)]
        rows.append(
            [f"{n:,}", f"{statistics.median(ratios):.2f} [{min(ratios):.2f}-{max(ratios):.2f}]"]
        )
    if rows:
        print("\nsame-rep ratio to none retained (sum of the statements' medians per rep)\n")
        print(table(["retained runs", "ratio [min-max]"], rows))
    print(
        "\nWAL of the measured runs (pg_stat_statements of each database; a CHECKPOINT"
        " before each rep)\n"
    )
    print(table(["retained runs", "WAL KiB/run", "full-page images/run"], wal_rows))
    if prune_rows:
        print()
        print(table(["step", "cost"], prune_rows))
    say(f"total {time.monotonic() - started:.0f} s")


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n", 1)[0])
    sub = ap.add_subparsers(dest="what", required=True)
    tp = sub.add_parser("throughput", help="throughput.py, durable and fsync off")
    tp.add_argument("--runs", type=int, default=1000)
    tp.add_argument("--warmup", type=int, default=50)
    rp = sub.add_parser("retention", help="the hot path against retained finished runs")
    rp.add_argument("--retained", default="0,100000,1000000")
    rp.add_argument("--seed-runs", type=int, default=1000)
    rp.add_argument("--reps", type=int, default=5)
    rp.add_argument("--runs-per-rep", type=int, default=200)
    rp.add_argument("--prune-at", type=int, default=100000, help="0: no prune")
    rp.add_argument("--durable", action="store_true")
    args, rest = ap.parse_known_args()
    stop_on_sigterm()
    say(load_note(background_load()))
    if args.what == "throughput":
        throughput(args, ["--runs", str(args.runs), "--warmup", str(args.warmup), *rest])
    else:
        if rest:
            ap.error(f"unknown arguments {rest}")
        retention(args)
    return 0


if __name__ == "__main__":
    sys.exit(main())
