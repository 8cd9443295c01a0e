"""``runledger demo``: the whole story in one command, against a real PostgreSQL.

Starts the fake provider and three worker processes, submits ticket-triage runs
(open a ticket -- idempotent; e-mail its id -- unsafe), SIGKILLs workers while calls
are in flight, restarts them, and then audits: every run succeeded or paused, no
effect happened twice, every paused run waits on an ``unknown`` call for a person.
Uses ``RUNLEDGER_DATABASE_URL`` when set, else a throwaway cluster.
"""

from __future__ import annotations

import contextlib
import random
import time
from collections import Counter
from collections.abc import Iterator
from typing import Any

import click
import psycopg
from psycopg.types.json import Jsonb

from runledger.db.migrate import upgrade
from runledger.testing.processes import ProviderProcess, WorkerPool, wait_for


@contextlib.contextmanager
def _database(url: str | None) -> Iterator[str]:
    if url:
        yield url
        return
    from runledger.testing.postgres import Databases, acquire_server

    click.echo("no RUNLEDGER_DATABASE_URL: starting a throwaway PostgreSQL", err=True)
    server = acquire_server()
    try:
        click.echo(f"PostgreSQL {server.version} ({server.backend})", err=True)
        yield Databases(server).create("runledger_demo", migrated=False)
    finally:
        server.stop()


def run_demo(url: str | None, runs: int, workers: int, kills: int, seed: int) -> int:
    rng = random.Random(seed)
    with _database(url) as db:
        upgrade(db)
        provider = ProviderProcess()
        pool = WorkerPool(
            db,
            ["runledger.demo.flows:flows"],
            env={"RUNLEDGER_PROVIDER_URL": provider.url},
            args=["--lease-seconds", "2", "--poll-seconds", "0.2", "--log-level", "WARNING"],
        )
        try:
            return _play(db, provider, pool, runs, workers, kills, rng)
        finally:
            pool.close()
            provider.stop()


def _play(
    db: str,
    provider: ProviderProcess,
    pool: WorkerPool,
    runs: int,
    workers: int,
    kills: int,
    rng: random.Random,
) -> int:
    provider.client.configure(latency=0.1)
    started = time.monotonic()
    with psycopg.connect(db, autocommit=True) as conn:
        prefix = f"demo-{int(time.time())}"
        for n in range(runs):
            conn.execute(
                "SELECT * FROM runledger.submit_run(%s, 'ticket-triage', '1', %s)",
                (
                    f"{prefix}-{n:03d}",
                    Jsonb({"title": f"Login fails #{n}", "notify": "ops@example.com"}),
                ),
            )
        pool.start(workers)
        click.echo(f"submitted {runs} runs, started {workers} workers", err=True)

        def settled() -> int:
            row = conn.execute(
                "SELECT count(*) FROM runledger.runs WHERE run_id LIKE %s "
                "AND status IN ('succeeded', 'paused', 'failed')",
                (f"{prefix}-%",),
            ).fetchone()
            return int(row[0]) if row else 0

        for _ in range(kills):
            wait_for(
                lambda: conn.execute(
                    "SELECT 1 FROM runledger.run_calls "
                    "WHERE run_id LIKE %s AND status = 'dispatched'",
                    (f"{prefix}-%",),
                ).fetchone(),
                timeout=60,
                what="a call in flight",
            )
            victim = rng.randrange(workers)
            pool.kill(victim)
            click.echo(f"SIGKILL worker w{victim} with calls in flight; restarting it", err=True)
            pool.restart(victim)
        wait_for(lambda: settled() == runs, timeout=300, interval=0.1, what="all runs settled")
        elapsed = time.monotonic() - started
        return _audit(conn, db, prefix, provider, runs, elapsed)


def _audit(
    conn: psycopg.Connection[Any],
    db: str,
    prefix: str,
    provider: ProviderProcess,
    runs: int,
    elapsed: float,
) -> int:
    like = f"{prefix}-%"
    statuses = dict(
        conn.execute(
            "SELECT status, count(*) FROM runledger.runs WHERE run_id LIKE %s GROUP BY 1", (like,)
        ).fetchall()
    )
    takeovers = conn.execute(
        "SELECT count(*) FROM runledger.run_events WHERE run_id LIKE %s AND kind = 'takeover'",
        (like,),
    ).fetchone()
    unknown = conn.execute(
        "SELECT idempotency_key FROM runledger.effect_ledger WHERE run_id LIKE %s "
        "AND status = 'unknown' ORDER BY 1",
        (like,),
    ).fetchall()
    effects = Counter(e["key"] for e in provider.client.effects() if e["key"].startswith(prefix))
    duplicated = sorted(k for k, n in effects.items() if n > 1)
    missing = [
        k
        for (k,) in conn.execute(
            "SELECT idempotency_key FROM runledger.run_calls WHERE run_id LIKE %s "
            "AND status = 'succeeded'",
            (like,),
        ).fetchall()
        if effects[k] != 1
    ]

    click.echo(f"\n{runs} runs in {elapsed:.1f} s: {statuses}")
    click.echo(f"takeovers after SIGKILL: {takeovers[0] if takeovers else 0}")
    click.echo(
        f"effects at the provider: {sum(effects.values())} for {len(effects)} keys; "
        f"duplicated: {len(duplicated)}"
    )
    click.echo(f"succeeded calls without their effect: {len(missing)}")
    for (key,) in unknown:
        click.echo(
            f"  unknown (e-mail may or may not have gone out): {key}"
            f" -> runledger resolve {key} applied|not_applied|abandoned"
        )
    from runledger.audit import run_checks

    broken = [f.check.name for f in run_checks(db) if not f.ok]
    click.echo(f"invariant checks (runledger audit): {broken or 'all ok'}")
    ok = not duplicated and not missing and not broken and set(statuses) <= {"succeeded", "paused"}
    click.echo("audit: OK" if ok else "audit: FAILED")
    return 0 if ok else 1
