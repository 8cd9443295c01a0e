"""Three workers, 100 runs, random SIGKILLs: nothing is lost and nothing happens twice."""

from __future__ import annotations

import os
import random
import time
from collections import Counter
from typing import Any

import pytest

from runledger.testing import wait_for
from tests.process.conftest import submit

pytestmark = [pytest.mark.process, pytest.mark.chaos, pytest.mark.slow]

RUNS = 100
PLAN = [
    [{"tool": "ticket"}, {"tool": "charge", "args": {"amount": 3}}],
    [{"tool": "email"}, {"tool": "read"}],
]


@pytest.mark.timeout(300)
def test_random_sigkills(workers: Any, provider: Any, admin_conn: Any) -> None:
    seed = int(os.environ.get("RUNLEDGER_CHAOS_SEED", time.time_ns() % 1_000_000))
    rng = random.Random(seed)
    print(f"chaos seed {seed} (RUNLEDGER_CHAOS_SEED to replay)")
    provider.client.configure(latency=0.15)
    started = time.monotonic()
    for n in range(RUNS):
        submit(admin_conn, f"chaos-{n:03d}", PLAN)
    workers.start(
        3, args=["--lease-seconds", "2", "--concurrency", "8", "--max-stalled-claims", "1000"]
    )

    def settled() -> int:
        row = admin_conn.execute(
            "SELECT count(*) FROM runledger.runs WHERE status IN ('succeeded', 'paused')"
        ).fetchone()
        return int(row[0])

    kills = 0
    chaos_until = time.monotonic() + 6
    while time.monotonic() < chaos_until and settled() < RUNS:
        time.sleep(rng.uniform(0.1, 0.6))  # the chaos schedule, not a wait for correctness
        victim = rng.randrange(3)
        workers.kill(victim)
        kills += 1
        workers.restart(victim)
    chaos_done = time.monotonic()
    wait_for(lambda: settled() == RUNS, timeout=150, interval=0.2, what="all runs settled")
    print(f"chaos {chaos_done - started:.1f} s, settled {time.monotonic() - started:.1f} s")

    statuses = Counter(r[0] for r in admin_conn.execute("SELECT status FROM runledger.runs"))
    assert set(statuses) <= {"succeeded", "paused"}, statuses

    effects = Counter(e["key"] for e in provider.client.effects())
    duplicated = {k: n for k, n in effects.items() if n > 1}
    assert duplicated == {}, f"duplicated effects (seed {seed}): {duplicated}"

    calls = admin_conn.execute(
        "SELECT idempotency_key, tool, status FROM runledger.run_calls"
    ).fetchall()
    for key, tool, status in calls:
        if status == "succeeded" and tool != "read":
            assert effects[key] == 1, f"succeeded call {key} without its effect (seed {seed})"
    unknown = [(k, t) for k, t, s in calls if s == "unknown"]
    assert all(t == "email" for _, t in unknown), unknown  # only the unsafe tool is ambiguous
    assert len(unknown) == statuses["paused"]
    print(f"kills={kills} statuses={dict(statuses)} unknown={len(unknown)}")
