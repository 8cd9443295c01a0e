"""Workers and ``Client`` through a real PgBouncer (Debian's 1.18), in both pool modes.

Three workers reach the database only through PgBouncer (``RUNLEDGER_POOLER`` says
which mode), runs are submitted through it with ``Client``, and a worker is SIGKILLed
at random and restarted under its own id again and again. In transaction mode nothing
may be prepared on a server session (PgBouncer 1.18 hands it to another client at the
next transaction) and a registration cannot lean on a session; in session mode the
killed worker's server session stays open in PgBouncer's pool, and its restart under
the same id must be accepted all the same. Each way: no effect twice, every run
finishes or pauses on its ``unknown`` call, no worker exits by itself, and the
``Client`` is never refused. And the read commands, ``audit`` and ``doctor`` leave no
read-only session on the pooler for its next client.

Without a ``pgbouncer`` binary these tests are skipped, saying how to install it; under
``CI=true`` they fail (``scripts/test`` installs Debian's package).
"""

from __future__ import annotations

import os
import random
import subprocess
import sys
import time
from collections import Counter
from typing import Any

import psycopg
import pytest

from runledger.client import Client
from runledger.testing import wait_for
from tests.process.pgbouncer import pgbouncer

pytestmark = [pytest.mark.process, pytest.mark.chaos]

RUNS = 40
PLAN = [
    [{"tool": "ticket"}, {"tool": "charge", "args": {"amount": 3}}],
    [{"tool": "email"}, {"tool": "read"}],
]
CHAOS_SECONDS = 6.0
HOLD = 30  # clients that hold PgBouncer's idle server sessions while w0 restarts
ARGS = ["--lease-seconds", "2", "--concurrency", "8", "--max-stalled-claims", "1000"]
# what the workers said when PgBouncer broke them (issue #34): never again
BROKEN = (
    "Traceback",
    "DuplicatePreparedStatement",
    "InvalidSqlStatementName",
    "already exists",
    "does not exist",
    "in use by another live worker",
)


def _registered(conn: Any, worker_id: str) -> int | None:
    row = conn.execute(
        "SELECT pid FROM runledger.workers WHERE worker_id = %s AND stopped_at IS NULL",
        (worker_id,),
    ).fetchone()
    return None if row is None else int(row[0])


def _settled(conn: Any) -> int:
    row = conn.execute(
        "SELECT count(*) FROM runledger.runs WHERE status IN ('succeeded', 'paused')"
    ).fetchone()
    return int(row[0])


@pytest.mark.timeout(150)
@pytest.mark.parametrize(
    ("mode", "direct"),
    [("transaction", False), ("session", False), ("transaction", True)],
    ids=["transaction", "session", "transaction-direct-url"],
)
def test_workers_through_pgbouncer_survive_sigkills(
    mode: str,
    direct: bool,
    workers: Any,
    provider: Any,
    admin_conn: Any,
    database_url: str,
    runledger_server: Any,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    seed = int(os.environ.get("RUNLEDGER_CHAOS_SEED", time.time_ns() % 1_000_000))
    rng = random.Random(seed)
    print(f"pgbouncer {mode} direct={direct} seed {seed} (RUNLEDGER_CHAOS_SEED to replay)")
    provider.client.configure(latency=0.15)
    with pgbouncer(runledger_server.admin_url, mode) as bouncer:
        pooled = bouncer.url(database_url)
        env = {"RUNLEDGER_POOLER": mode}
        if direct:
            env["RUNLEDGER_DIRECT_URL"] = database_url
        workers.database_url = pooled
        workers.start(3, env=env, args=ARGS)
        starts = [1, 1, 1]
        started = time.monotonic()
        monkeypatch.setenv("RUNLEDGER_POOLER", mode)
        with Client(pooled) as client:
            for n in range(RUNS):
                client.submit("scripted", {"plan": PLAN}, run_id=f"pgb-{n:03d}", version="1")
            kills = 0
            until = time.monotonic() + CHAOS_SECONDS
            while time.monotonic() < until and _settled(admin_conn) < RUNS:
                time.sleep(rng.uniform(0.1, 0.6))  # the chaos schedule, not a wait
                victim = rng.randrange(3)
                workers.kill(victim)
                workers.restart(victim)
                kills += 1
                starts[victim] += 1
            try:
                wait_for(lambda: _settled(admin_conn) == RUNS, timeout=90, interval=0.2)
            except AssertionError:
                tails = "".join(f"\n--- w{i}:\n{workers.log(i)[-1500:]}" for i in range(3))
                raise AssertionError(
                    f"{_settled(admin_conn)} of {RUNS} runs settled through pgbouncer ({mode}) "
                    f"in {time.monotonic() - started:.0f} s (seed {seed}){tails}"
                ) from None
            settled_after = time.monotonic() - started
            # the Client reads through the pooler too, every run
            seen = Counter(client.get(f"pgb-{n:03d}").status for n in range(RUNS))
        print(f"kills={kills} settled in {settled_after:.1f} s: {dict(seen)}")

        # Once more, not at random: w0 is killed once registered, and while it restarts,
        # other clients hold every server session PgBouncer had idle (in session mode the
        # dead worker's are among them, still open on the server), so the restart cannot
        # land on one of them. It is accepted, and says once what the pooler costs it.
        for i in range(3):  # each restart was accepted (or a worker exited: said below)
            wait_for(
                lambda i=i: (
                    _registered(admin_conn, f"w{i}") == workers.pid(i) or not workers.alive(i)
                ),
                what=f"w{i} registered",
            )
            log = workers.log(i)
            assert workers.alive(i), f"w{i} exited ({workers.returncode(i)}): {log[-3000:]}"
        workers.kill(0)
        held = [psycopg.connect(pooled, autocommit=True) for _ in range(HOLD)]
        try:
            for conn in held:
                conn.execute("SELECT 1")
            before = len(workers.log(0))
            workers.restart(0)
            starts[0] += 1
            wait_for(
                lambda: _registered(admin_conn, "w0") == workers.pid(0) or not workers.alive(0),
                timeout=30,
                what="w0 registered again",
            )
            assert workers.alive(0), (
                f"w0 exited ({workers.returncode(0)}): {workers.log(0)[before:]}"
            )
            wait_for(lambda: "worker started" in workers.log(0)[before:], what="w0 started")
            fresh = workers.log(0)[before:]
            assert fresh.count("taken over on lease expiry only") == (0 if direct else 1), fresh
        finally:
            for conn in held:
                conn.close()

        statuses = Counter(r[0] for r in admin_conn.execute("SELECT status FROM runledger.runs"))
        assert set(statuses) <= {"succeeded", "paused"}, statuses
        assert seen == statuses
        effects = Counter(e["key"] for e in provider.client.effects())
        twice = {k: n for k, n in effects.items() if n > 1}
        assert twice == {}, f"effects sent twice (seed {seed}): {twice}"
        calls = admin_conn.execute(
            "SELECT idempotency_key, tool, status FROM runledger.run_calls"
        ).fetchall()
        for key, tool, status in calls:
            if status == "succeeded" and tool != "read":
                assert effects[key] == 1, f"succeeded call {key} without its effect (seed {seed})"
        unknown = [(k, t) for k, t, s in calls if s == "unknown"]
        assert all(t == "email" for _, t in unknown), unknown  # only the unsafe tool
        assert len(unknown) == statuses["paused"]

        for i in range(3):
            log = workers.log(i)
            assert workers.alive(i), f"worker {i} exited ({workers.returncode(i)}): {log[-3000:]}"
            for word in BROKEN:
                assert word not in log, f"worker {i} said {word!r} (seed {seed}): {log[-3000:]}"
            # a start said it once at most (one killed before it registered said nothing)
            said = log.count("taken over on lease expiry only")
            assert said <= (0 if direct else starts[i]), (said, starts[i], log[-3000:])
        registered = admin_conn.execute(
            "SELECT worker_id, pid FROM runledger.workers WHERE stopped_at IS NULL ORDER BY 1"
        ).fetchall()
        assert registered == [(f"w{i}", workers.pid(i)) for i in range(3)]
        holders = Counter(
            r[0]
            for r in admin_conn.execute(
                "SELECT detail->>'holder' FROM runledger.run_events WHERE kind = 'takeover'"
            )
        )
        print(f"takeovers {dict(holders)}")
        if not direct:  # no session of its own: a killed worker's runs wait for expiry
            assert holders["session_ended"] == 0, holders


@pytest.mark.timeout(120)
def test_read_commands_through_a_transaction_pooler_leave_no_read_only_session_behind(
    database_url: str, runledger_server: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    """``audit``, ``doctor`` and the read commands make their session read-only. Through
    PgBouncer in transaction mode that setting stayed on the server session after them,
    and every write of the next client there was refused (a worker's, a submit). Two
    server sessions, so the next client certainly gets one they used; the pooler is found
    out, not said (``RUNLEDGER_POOLER`` unset)."""
    monkeypatch.delenv("RUNLEDGER_POOLER", raising=False)
    with pgbouncer(runledger_server.admin_url, "transaction", pool_size=2) as bouncer:
        pooled = bouncer.url(database_url)
        env = {**os.environ, "RUNLEDGER_DATABASE_URL": pooled}
        for command in (["audit"], ["doctor"], ["list"], ["workers"], ["unknown"]):
            done = subprocess.run(
                [sys.executable, "-m", "runledger", *command],
                env=env,
                capture_output=True,
                text=True,
                timeout=60,
            )
            assert "Traceback" not in done.stderr, done.stderr
            assert done.returncode in (0, 1), (command, done.stderr)
        with Client(pooled) as client:
            for n in range(10):  # each on one of the two server sessions the reads used
                client.submit("scripted", {"plan": []}, run_id=f"after-reads-{n}", version="1")
        with psycopg.connect(database_url, autocommit=True) as conn:
            row = conn.execute(
                "SELECT count(*) FROM runledger.runs WHERE run_id LIKE 'after-reads-%'"
            ).fetchone()
        assert row == (10,)
