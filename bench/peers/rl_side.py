"""runledger in the peer benchmark: real ``runledger worker`` processes."""

from __future__ import annotations

import sys
from typing import Any

import psycopg

from runledger.testing.postgres import Databases, Server

from peers.cluster import Cluster
from peers.harness import Procs, unique


class Runledger:
    name = "runledger"

    def __init__(self, workers: int, concurrency: int) -> None:
        self.workers = workers
        self.concurrency = concurrency
        self._databases: Databases | None = None

    def setup(self, sequential: bool) -> str:
        if sequential:
            return "1 worker x concurrency 1"
        return f"{self.workers} workers x concurrency {self.concurrency}"

    def prepare(self, cluster: Cluster) -> None:
        server = Server(admin_url=cluster.admin_url, backend="local", version=cluster.version)
        self._databases = Databases(server)
        self._databases.ensure_template()  # migrated once; each batch clones it

    def fresh(self, cluster: Cluster) -> tuple[str, str]:
        assert self._databases is not None
        name = unique("peers_runledger")
        return name, cluster.create(name, template=self._databases.template)

    def submit(self, url: str, runs: int) -> None:
        with psycopg.connect(url, autocommit=True) as conn:
            conn.execute(
                "SELECT count(*) FROM generate_series(1, %s) AS g CROSS JOIN LATERAL "
                "runledger.submit_run('r-' || lpad(g::text, 6, '0'), 'peers-agent', '1', "
                "'{}'::jsonb) AS s",
                (runs,),
            )

    def start(self, url: str, sequential: bool, procs: Procs) -> None:
        n, concurrency = (1, 1) if sequential else (self.workers, self.concurrency)
        for i in range(n):
            procs.start(
                [sys.executable, "-m", "runledger", "worker", "--flows", "peers.rl_flow:flow",
                 "--worker-id", f"peers-w{i}", "--concurrency", str(concurrency),
                 "--log-level", "warning"],
                env={"RUNLEDGER_DATABASE_URL": url},
            )  # fmt: skip

    def progress(self, conn: psycopg.Connection[Any]) -> tuple[int, int]:
        row = conn.execute(
            "SELECT (SELECT count(*) FROM runledger.run_calls WHERE status = 'succeeded'),"
            "       (SELECT count(*) FROM runledger.runs WHERE finished_at IS NOT NULL "
            "        OR status = 'paused')"
        ).fetchone()
        assert row is not None
        return int(row[0]), int(row[1])

    def call_times(self, conn: psycopg.Connection[Any]) -> list[tuple[str, float]]:
        rows = conn.execute(
            "SELECT run_id, extract(epoch FROM completed_at)::float8 FROM runledger.run_calls "
            "WHERE status = 'succeeded'"
        ).fetchall()
        return [(str(r[0]), float(r[1])) for r in rows]

    def failures(self, conn: psycopg.Connection[Any]) -> int:
        row = conn.execute(
            "SELECT count(*) FROM runledger.runs WHERE status <> 'succeeded'"
        ).fetchone()
        return int(row[0]) if row else 0
