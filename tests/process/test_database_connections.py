"""The database drops a worker's connections mid-run (a failover, a restart, an admin
terminating backends): the worker reconnects, the store's read-back settles every
ambiguous write, and no effect happens twice."""

from __future__ import annotations

import time
from collections import Counter
from typing import Any

import pytest

from runledger.testing import wait_for
from tests.process.conftest import submit

pytestmark = pytest.mark.process

RUNS = 30


def test_terminated_connections_mid_run(workers: Any, provider: Any, admin_conn: Any) -> None:
    provider.client.configure(latency=0.05)
    for n in range(RUNS):
        submit(
            admin_conn,
            f"conn-{n:02d}",
            [[{"tool": "ticket"}, {"tool": "charge"}], [{"tool": "read"}]],
        )
    (w0,) = workers.start(1, args=["--concurrency", "6"])

    def terminate_all() -> int:
        rows = admin_conn.execute(
            "SELECT pg_terminate_backend(pid) FROM pg_stat_activity "
            "WHERE application_name LIKE 'runledger-%%:w0%%'"
        ).fetchall()
        return len(rows)

    def settled() -> int:
        row = admin_conn.execute(
            "SELECT count(*) FROM runledger.runs WHERE status IN ('succeeded', 'paused', 'failed')"
        ).fetchone()
        return int(row[0])

    terminated = 0
    for _ in range(4):
        wait_for(
            lambda: admin_conn.execute(
                "SELECT 1 FROM runledger.run_calls WHERE status = 'dispatched'"
            ).fetchone(),
            what="calls in flight",
        )
        terminated += terminate_all()
        time.sleep(0.3)  # let it reconnect before the next blow (a schedule, not a wait)
    assert terminated >= 4
    wait_for(lambda: settled() == RUNS, timeout=90, interval=0.1, what="all runs settled")

    statuses = Counter(r[0] for r in admin_conn.execute("SELECT status FROM runledger.runs"))
    assert statuses == {"succeeded": RUNS}, (statuses, workers.log(w0)[-3000:])
    effects = Counter(e["key"] for e in provider.client.effects())
    assert max(effects.values()) == 1 and len(effects) == 2 * RUNS
    assert workers.alive(w0)
    assert "database call failed, retrying" in workers.log(w0)  # the blows did land
