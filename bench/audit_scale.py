"""How long the event-chain work takes on a big history: a checkpoint over every run,
then ``runledger audit`` (every check, every hash recomputed), then ``runledger show``.

    .venv/bin/python bench/audit_scale.py [--runs 1000000] [--events 6]

The runs are submitted through ``submit_run`` over ``generate_series`` (one statement;
each ``submitted`` event is chained by ``runledger._event``). Each run then gets
``--events - 1`` more events, written as the owner one event per run per statement,
each hashed from the run's previous one with ``runledger._event_hash``: the chains are
the same as the workers would write, without running a million runs through workers.
A checkpoint covers at most 500,000 events: they are made until every event is
covered, while another session submits runs (its wait is the cost to writers).
Prints a markdown table; progress on stderr.
"""

from __future__ import annotations

import argparse
import statistics
import subprocess
import sys
import threading
import time
from pathlib import Path

import psycopg

from _common import database, say

CLI = [str(Path(sys.executable).with_name("runledger"))]

NEXT_EVENT = """
INSERT INTO runledger.run_events (event_id, run_id, at, kind, actor, fencing_token,
                                  state_version, detail, hash)
SELECT n.id, n.run_id, n.at, n.kind, 'w1', 1, %(k)s, n.detail,
       runledger._event_hash(n.previous, n.id, n.run_id, n.at, n.kind, 'w1', 1, %(k)s,
                             n.detail)
FROM (SELECT nextval('runledger.run_events_event_id_seq') AS id, p.run_id, p.hash AS previous,
             p.at + interval '1 ms' AS at,
             (ARRAY['claimed', 'turn_recorded', 'call_dispatched', 'call_succeeded',
                    'turn_recorded', 'run_succeeded'])[1 + (%(k)s - 1) %% 6] AS kind,
             jsonb_build_object('turn', %(k)s / 3, 'idempotency_key', p.run_id || ':0:c1')
                 AS detail
      FROM runledger.run_events p WHERE p.event_id > %(after)s) n
"""


def _timed(label: str, fn) -> float:  # type: ignore[no-untyped-def]
    say(f"{label}...")
    t0 = time.perf_counter()
    fn()
    took = time.perf_counter() - t0
    say(f"{label}: {took:.1f} s")
    return took


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--runs", type=int, default=1_000_000)
    parser.add_argument("--events", type=int, default=6, help="events per run (>= 1)")
    args = parser.parse_args()
    with database() as db, psycopg.connect(db.url, autocommit=True) as c:
        rows: list[tuple[str, str]] = []

        def load() -> None:
            c.execute(
                "SELECT count(*) FROM generate_series(1, %s) n, LATERAL runledger.submit_run("
                "'a' || n, 'demo', '1', jsonb_build_object('n', n)) s",
                (args.runs,),
            )
            for k in range(1, args.events):
                row = c.execute("SELECT coalesce(max(event_id), 0) FROM runledger.run_events")
                (after,) = row.fetchone() or (0,)
                c.execute(NEXT_EVENT, {"k": k, "after": after - args.runs})  # type: ignore[arg-type]
            c.execute("VACUUM ANALYZE runledger.run_events")
            c.execute("VACUUM ANALYZE runledger.runs")

        loaded = _timed(f"load {args.runs:,} runs x {args.events} events", load)
        rows.append(("load (submit_run + hashed events)", f"{loaded:.1f} s"))
        (events,) = c.execute("SELECT count(*) FROM runledger.run_events").fetchone() or (0,)
        # checkpoints until every event is covered (at most 500,000 events each), while
        # another session submits runs: how long a writer waits meanwhile
        stop = threading.Event()
        waits: list[float] = []

        def writer() -> None:
            with psycopg.connect(db.url, autocommit=True) as w:
                n = 0
                while not stop.is_set():
                    n += 1
                    t0 = time.perf_counter()
                    w.execute(
                        "SELECT * FROM runledger.submit_run(%s, 'demo', '1', '{}')", (f"w{n}",)
                    )
                    waits.append(time.perf_counter() - t0)

        (last,) = c.execute("SELECT max(event_id) FROM runledger.run_events").fetchone() or (0,)
        checkpoints = 0

        def catch_up() -> None:
            nonlocal checkpoints
            while True:
                row = c.execute(
                    "SELECT through_event_id, created FROM runledger.checkpoint_events("
                    "'bench', '0')"
                ).fetchone()
                assert row is not None
                checkpoints += row[1]
                if row[0] >= last:
                    return

        probe = threading.Thread(target=writer)
        probe.start()
        try:
            made = _timed("checkpoints over every run", catch_up)
        finally:
            stop.set()
            probe.join()
        rows.append(
            (
                f"checkpoint_events over {args.runs:,} runs ({checkpoints} checkpoints)",
                f"{made:.1f} s",
            )
        )
        rows.append(
            (
                f"a concurrent submit_run meanwhile ({len(waits):,}): median / max",
                f"{statistics.median(waits) * 1000:.1f} / {max(waits) * 1000:.0f} ms",
            )
        )
        # the writer's runs are checkpointed too; then one with nothing new
        c.execute("SELECT * FROM runledger.checkpoint_events('bench', '0')")
        again = _timed(
            "checkpoint with nothing new",
            lambda: c.execute("SELECT * FROM runledger.checkpoint_events('bench', '0')"),
        )
        rows.append(("checkpoint_events (no new event)", f"{again * 1000:.1f} ms"))
        audited = _timed(
            "runledger audit",
            lambda: subprocess.run(
                [*CLI, "audit", "--database-url", db.url], check=True, stdout=subprocess.DEVNULL
            ),
        )
        rows.append((f"runledger audit ({events:,} events)", f"{audited:.1f} s"))
        shown = _timed(
            "runledger show",
            lambda: subprocess.run(
                [*CLI, "show", f"a{args.runs // 2}", "--database-url", db.url, "--json"],
                check=True,
                stdout=subprocess.DEVNULL,
            ),
        )
        rows.append(("runledger show (one run, whole CLI process)", f"{shown * 1000:.0f} ms"))
        print(f"\n{db.source}, PostgreSQL {db.version}\n")
        print("| step | time |\n| --- | ---: |")
        for step, took in rows:
            print(f"| {step} | {took} |")


if __name__ == "__main__":
    main()
