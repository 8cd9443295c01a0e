"""PostgreSQL restarts under real workers: a fast restart, then an immediate one (a crash,
recovered at start), each while calls are in flight. Every session ends, so every
listener fences its runs; the workers reconnect, register again, take the runs over
(their holders' sessions ended) and finish them: nothing is lost, nothing happens twice."""

from __future__ import annotations

from collections import Counter
from collections.abc import Iterator
from typing import Any

import psycopg
import pytest

from runledger.testing import ProviderProcess, WorkerPool, wait_for
from runledger.testing.postgres import Databases, Server, private_cluster
from tests.conftest import DEMO_FLOWS
from tests.process.conftest import submit

pytestmark = [pytest.mark.process, pytest.mark.chaos, pytest.mark.slow]

RUNS = 40
PLAN = [
    [{"tool": "ticket"}, {"tool": "charge", "args": {"amount": 3}}],
    [{"tool": "email"}, {"tool": "read"}],
]


@pytest.fixture
def cluster() -> Iterator[Server]:
    """A cluster of its own (the test restarts it); commits durable, so that an immediate
    shutdown loses no acknowledged commit."""
    server = private_cluster(settings={"synchronous_commit": "on"})
    try:
        yield server
    finally:
        server.stop()


def _started(conn: psycopg.Connection[Any]) -> Any:
    row = conn.execute("SELECT pg_postmaster_start_time()").fetchone()
    assert row is not None
    return row[0]


@pytest.mark.timeout(300)
def test_fast_and_immediate_restarts_during_runs(
    cluster: Server, request: pytest.FixtureRequest
) -> None:
    dbs = Databases(cluster)
    dbs.ensure_template()
    url = dbs.create("rl_restart")
    provider = ProviderProcess()
    request.addfinalizer(provider.stop)
    provider.client.configure(latency=0.1)
    pool = WorkerPool(
        url,
        DEMO_FLOWS,
        env={"RUNLEDGER_PROVIDER_URL": provider.url},
        args=["--poll-seconds", "0.2", "--concurrency", "6", "--max-stalled-claims", "1000"],
    )
    request.addfinalizer(pool.close)

    def admin() -> psycopg.Connection[Any]:
        return psycopg.connect(url, autocommit=True)

    def settled() -> int:
        with admin() as conn:
            row = conn.execute(
                "SELECT count(*) FROM runledger.runs WHERE status IN ('succeeded', 'paused')"
            ).fetchone()
            return int(row[0]) if row else 0

    def in_flight() -> bool:
        with admin() as conn:
            return bool(
                conn.execute(
                    "SELECT 1 FROM runledger.run_calls WHERE status = 'dispatched'"
                ).fetchone()
            )

    with admin() as conn:
        for n in range(RUNS):
            submit(conn, f"restart-{n:03d}", PLAN)
        first = _started(conn)
    pool.start(2)

    def registered() -> bool:  # a worker that cannot reach the database at start fails
        with admin() as conn:
            row = conn.execute(
                "SELECT count(*) FROM runledger.workers WHERE session_lock IS NOT NULL"
            ).fetchone()
            return bool(row and row[0] == 2)

    wait_for(registered, timeout=60, what="both workers registered")
    restarts = []
    for mode in ("fast", "immediate"):
        wait_for(in_flight, timeout=60, what=f"calls in flight before the {mode} restart")
        before = settled()
        cluster.restart(mode)
        restarts.append((mode, before))
        # the workers come back and make progress before the next blow
        wait_for(lambda b=before: settled() > b, timeout=90, interval=0.2, what="progress")
    wait_for(lambda: settled() == RUNS, timeout=150, interval=0.2, what="all runs settled")

    with admin() as conn:
        assert _started(conn) > first  # the restarts did happen
        statuses = Counter(r[0] for r in conn.execute("SELECT status FROM runledger.runs"))
        calls = conn.execute(
            "SELECT idempotency_key, tool, status FROM runledger.run_calls"
        ).fetchall()
        takeovers = conn.execute(
            "SELECT count(*) FROM runledger.run_events"
            " WHERE kind = 'takeover' AND detail ->> 'holder' = 'session_ended'"
        ).fetchone()
    assert set(statuses) <= {"succeeded", "paused"}, statuses
    effects = Counter(e["key"] for e in provider.client.effects())
    assert {k: n for k, n in effects.items() if n > 1} == {}
    for key, tool, status in calls:
        if status == "succeeded" and tool != "read":
            assert effects[key] == 1, f"succeeded call {key} without its effect"
    unknown = [(k, t) for k, t, s in calls if s == "unknown"]
    assert all(t == "email" for _, t in unknown), unknown  # only the unsafe tool
    assert len(unknown) == statuses["paused"]
    assert takeovers is not None and takeovers[0] > 0  # runs left by ended sessions
    for i in range(2):
        assert pool.alive(i), pool.log(i)[-6000:]
    print(
        f"restarts {restarts}; statuses {dict(statuses)}; unknown {len(unknown)}; "
        f"takeovers through ended sessions {takeovers[0]}"
    )
