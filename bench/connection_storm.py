"""Effects sent twice when the server ends the sessions of live workers mid-call.

    .venv/bin/python bench/connection_storm.py                  # 5 reps, 150 runs, 60 s
    .venv/bin/python bench/connection_storm.py --reps 2 --runs 60 --seconds 20

Per repetition, on a fresh database: three workers (default settings: 30 s lease, session
locks) run ``--runs`` runs of the ``scripted@1`` flow, each an idempotent ``ticket``, then
a ``charge`` (lookup: the provider does not deduplicate, only the lookup keeps a retry
from charging twice), then an unsafe ``email``, one per turn. The fake provider applies a
request only ``--arrival`` s after it came in: a request still on its way, which a lookup
cannot see yet. Meanwhile, every 0.2-0.5 s for ``--seconds`` s, one backend of a worker
(its listener or a pool connection, at random) is ended with ``pg_terminate_backend``,
as an operator, a proxy's failover or an idle timeout would; the workers live on. Then
every run is waited for until it has succeeded or paused.

Reported per rep: backends ended; takeovers because a session ended; charges and e-mails
the provider applied twice for one key (the provider deduplicates tickets itself); runs
paused for a person; calls released by their earlier sender (``send_released``, revision
0031); and the time until every run settled. Data on stdout (a markdown table), progress on
stderr.
"""

from __future__ import annotations

import argparse
import random
import time
from collections import Counter
from typing import Any

import psycopg
from psycopg.types.json import Jsonb

from runledger.testing.processes import wait_for

from _common import (
    BenchPool,
    background_load,
    database,
    load_note,
    provider,
    say,
    stop_on_sigterm,
    table,
    tag,
    wait_ready,
)

PLAN = [[{"tool": "ticket"}], [{"tool": "charge", "args": {"amount": 3}}], [{"tool": "email"}]]


def one(db_url: str, prov: Any, rep: int, args: argparse.Namespace, seed: int) -> list[Any]:
    rng = random.Random(seed)
    me = f"s{tag()}"
    pool = BenchPool(
        db_url,
        me,
        env={"RUNLEDGER_PROVIDER_URL": prov.url},
        args=["--concurrency", "8", "--max-stalled-claims", "1000", "--log-level", "WARNING"],
    )
    prov.client.configure(arrival=args.arrival)
    started = time.monotonic()
    with psycopg.connect(db_url, autocommit=True) as conn:
        try:
            pool.start(args.workers)
            wait_ready(conn, pool, list(range(args.workers)))
            for n in range(args.runs):
                conn.execute(
                    "SELECT * FROM runledger.submit_run(%s, 'scripted', '1', %s)",
                    (f"{me}-{n:04d}", Jsonb({"plan": PLAN})),
                )

            def settled() -> int:
                row = conn.execute(
                    "SELECT count(*) FROM runledger.runs WHERE run_id LIKE %s"
                    " AND status IN ('succeeded', 'paused')",
                    (me + "-%",),
                ).fetchone()
                return int(row[0]) if row else 0

            ended = 0
            until = time.monotonic() + args.seconds
            while time.monotonic() < until and settled() < args.runs:
                time.sleep(rng.uniform(0.2, 0.5))  # the storm's schedule
                found = conn.execute(
                    "SELECT pid FROM pg_stat_activity WHERE application_name LIKE %s"
                    " OR application_name LIKE %s",
                    (f"runledger-listener:{me}-%", f"runledger-worker:{me}-%"),
                ).fetchall()
                if found:
                    conn.execute("SELECT pg_terminate_backend(%s)", (rng.choice(found)[0],))
                    ended += 1
            wait_for(lambda: settled() == args.runs, timeout=600, interval=0.2, what="settled")
            took = time.monotonic() - started
            alive = sum(pool.alive(i) for i in range(args.workers))
        finally:
            pool.close()
        effects = Counter(
            (e["kind"], e["key"]) for e in prov.client.effects() if e["key"].startswith(me)
        )
        twice = Counter(kind for (kind, _), n in effects.items() if n > 1)

        def count(sql: str) -> int:
            row = conn.execute(sql, (me + "-%",)).fetchone()
            return int(row[0]) if row else 0

        takeovers = count(
            "SELECT count(*) FROM runledger.run_events WHERE run_id LIKE %s"
            " AND kind = 'takeover' AND detail->>'holder' = 'session_ended'"
        )
        paused = count(
            "SELECT count(*) FROM runledger.runs WHERE run_id LIKE %s AND status = 'paused'"
        )
        released = count(
            "SELECT count(*) FROM runledger.run_events WHERE run_id LIKE %s"
            " AND kind = 'send_released'"
        )
    say(
        f"rep {rep + 1}: ended {ended} backends, {takeovers} takeovers (session ended), "
        f"charges twice {twice['charge']}, e-mails twice {twice['email']}, paused {paused}, "
        f"released {released}, settled in {took:.1f} s, workers alive {alive}/{args.workers}"
    )
    return [
        rep + 1,
        seed,
        ended,
        takeovers,
        twice["charge"],
        twice["email"],
        paused,
        released,
        f"{took:.1f}",
        f"{alive}/{args.workers}",
    ]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--reps", type=int, default=5)
    parser.add_argument("--runs", type=int, default=150)
    parser.add_argument("--seconds", type=float, default=60.0)
    parser.add_argument("--workers", type=int, default=3)
    parser.add_argument("--arrival", type=float, default=0.3)
    parser.add_argument("--seed", type=int, default=None)
    args = parser.parse_args()
    base = args.seed if args.seed is not None else random.randrange(1_000_000)
    stop_on_sigterm()
    before = background_load()
    rows = []
    with database() as db, provider() as prov:
        say(f"PostgreSQL {db.version}, {db.source}; seeds from {base}")
        for rep in range(args.reps):
            rows.append(one(db.fresh(), prov, rep, args, base + rep))
            prov.client.reset()
    print()
    print(
        f"PostgreSQL {db.version}; {args.workers} workers, {args.runs} runs, storm "
        f"{args.seconds:g} s, arrival {args.arrival:g} s; {load_note(before)}"
    )
    print(
        table(
            [
                "rep",
                "seed",
                "backends ended",
                "takeovers (session ended)",
                "charges twice",
                "e-mails twice",
                "runs paused",
                "sends released",
                "settled s",
                "workers alive",
            ],
            rows,
        )
    )


if __name__ == "__main__":
    main()
