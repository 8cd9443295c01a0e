"""runledger in the peer benchmark: real ``runledger worker`` processes."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import psycopg

from runledger.testing.postgres import Databases, Server

from peers.cluster import Cluster
from peers.harness import Procs, unique


class Runledger:
    """runledger from this tree; with ``ref``, from the checkout at that path instead
    (``--rl-ref``: its ``service/`` first on the workers' path, its own migrations), so
    that a before and an after run side by side in one interleaved run."""

    name = "runledger"

    def __init__(self, workers: int, concurrency: int, ref: Path | None = None) -> None:
        self.workers = workers
        self.concurrency = concurrency
        self.ref = ref
        self._databases: Databases | None = None
        self._template: str | None = None
        self._label = ""
        if ref is not None:
            self.name = "runledger-ref"
            if not (ref / "service" / "runledger").is_dir():
                raise SystemExit(f"--rl-ref {ref}: no service/runledger there")
            head = subprocess.run(["git", "-C", str(ref), "rev-parse", "--short", "HEAD"],
                                  capture_output=True, text=True, check=False)  # fmt: skip
            self._label = f", {head.stdout.strip() or ref.name}"

    def _env(self) -> dict[str, str]:
        if self.ref is None:
            return {}
        path = os.pathsep.join(filter(None, [str(self.ref / "service"),
                                             os.environ.get("PYTHONPATH")]))  # fmt: skip
        return {"PYTHONPATH": path}

    def setup(self, sequential: bool) -> str:
        if sequential:
            return f"1 worker x concurrency 1{self._label}"
        return f"{self.workers} workers x concurrency {self.concurrency}{self._label}"

    def prepare(self, cluster: Cluster) -> None:
        if self.ref is not None:  # migrated by the reference tree's own code
            self._template = unique("peers_rlref_template")
            url = cluster.create(self._template)
            subprocess.run(
                [sys.executable, "-m", "runledger", "migrate", "--database-url", url],
                env={**os.environ, **self._env()},
                check=True,
                capture_output=True,
                timeout=300,
            )
            return
        server = Server(admin_url=cluster.admin_url, backend="local", version=cluster.version)
        self._databases = Databases(server)
        self._template = self._databases.ensure_template()  # migrated once; batches clone it

    def fresh(self, cluster: Cluster) -> tuple[str, str]:
        assert self._template is not None
        name = unique("peers_runledger")
        return name, cluster.create(name, template=self._template)

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
                env={"RUNLEDGER_DATABASE_URL": url, **self._env()},
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
