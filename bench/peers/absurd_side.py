"""Absurd (absurd-sdk, schema installed by ``absurdctl``) in the peer benchmark."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path
from typing import Any

import psycopg

from peers.cluster import Cluster
from peers.harness import Procs, unique

QUEUE = "peers"
WORKER = Path(__file__).with_name("absurd_worker.py")


def absurdctl() -> str:
    found = shutil.which("absurdctl") or str(Path(sys.executable).with_name("absurdctl"))
    if not Path(found).exists():
        raise RuntimeError("absurdctl is not installed: pip install 'runledger-pg[bench]'")
    return found


class AbsurdSide:
    name = "absurd"

    def __init__(self, workers: int, concurrency: int) -> None:
        self.workers = workers
        self.concurrency = concurrency
        self.template = ""

    def setup(self, sequential: bool) -> str:
        if sequential:
            return "1 worker x concurrency 1"
        return f"{self.workers} workers x concurrency {self.concurrency}"

    def prepare(self, cluster: Cluster) -> None:
        import absurd_sdk  # noqa: F401 - fail early when the [bench] extra is missing

        self.template = unique("peers_absurd_tpl")
        url = cluster.create(self.template)
        # absurdctl runs psql; the cluster's own bin directory has a matching one.
        env = dict(os.environ, PATH=f"{cluster.bin_dir}{os.pathsep}{os.environ.get('PATH', '')}")
        for args in (["init"], ["create-queue", QUEUE]):
            done = subprocess.run(
                [absurdctl(), *args, "-d", url], env=env, capture_output=True, text=True
            )
            if done.returncode:
                raise RuntimeError(f"absurdctl {args[0]} failed: {done.stderr or done.stdout}")

    def fresh(self, cluster: Cluster) -> tuple[str, str]:
        name = unique("peers_absurd")
        return name, cluster.create(name, template=self.template)

    def submit(self, url: str, runs: int) -> None:
        from absurd_sdk import Absurd

        app = Absurd(url, queue_name=QUEUE)
        try:
            for _ in range(runs):
                app.spawn("agent-run", {}, queue=QUEUE)
        finally:
            app.close()

    def start(self, url: str, sequential: bool, procs: Procs) -> None:
        n, concurrency = (1, 1) if sequential else (self.workers, self.concurrency)
        for i in range(n):
            procs.start([sys.executable, str(WORKER), url, QUEUE, f"peers-w{i}", str(concurrency)])

    def progress(self, conn: psycopg.Connection[Any]) -> tuple[int, int]:
        row = conn.execute(
            f"SELECT (SELECT count(*) FROM absurd.c_{QUEUE}),"
            f"       (SELECT count(*) FROM absurd.t_{QUEUE} "
            "        WHERE state IN ('completed', 'failed', 'cancelled'))"
        ).fetchone()
        assert row is not None
        return int(row[0]), int(row[1])

    def call_times(self, conn: psycopg.Connection[Any]) -> list[tuple[str, float]]:
        rows = conn.execute(
            f"SELECT task_id::text, extract(epoch FROM updated_at)::float8 FROM absurd.c_{QUEUE}"
        ).fetchall()
        return [(str(r[0]), float(r[1])) for r in rows]

    def failures(self, conn: psycopg.Connection[Any]) -> int:
        row = conn.execute(
            f"SELECT count(*) FROM absurd.t_{QUEUE} WHERE state <> 'completed'"
        ).fetchone()
        return int(row[0]) if row else 0
