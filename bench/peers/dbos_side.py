"""DBOS Transact (system database only, offline) in the peer benchmark."""

from __future__ import annotations

import shutil
import subprocess
import sys
from pathlib import Path
from typing import Any

import psycopg

from peers.cluster import Cluster
from peers.harness import Procs, unique

QUEUE = "peers"
APP = "peers"
VERSION = "1"
WORKER = Path(__file__).with_name("dbos_worker.py")


def dbos_cli() -> str:
    found = shutil.which("dbos") or str(Path(sys.executable).with_name("dbos"))
    if not Path(found).exists():
        raise RuntimeError("dbos is not installed: pip install 'runledger-pg[bench]'")
    return found


class DbosSide:
    name = "dbos"

    def __init__(self, concurrency: int, poll_seconds: float) -> None:
        self.concurrency = concurrency
        self.poll_seconds = poll_seconds
        self.template = ""

    def setup(self, sequential: bool) -> str:
        threads = 1 if sequential else self.concurrency
        return f"1 process x worker_concurrency {threads}, queue poll {self.poll_seconds:g} s"

    def prepare(self, cluster: Cluster) -> None:
        self.template = unique("peers_dbos_tpl")
        url = cluster.create(self.template)
        done = subprocess.run([dbos_cli(), "migrate", "-s", url], capture_output=True, text=True)
        if done.returncode:
            raise RuntimeError(f"dbos migrate failed: {done.stderr or done.stdout}")

    def fresh(self, cluster: Cluster) -> tuple[str, str]:
        name = unique("peers_dbos")
        return name, cluster.create(name, template=self.template)

    def submit(self, url: str, runs: int) -> None:
        from dbos import DBOSClient

        client = DBOSClient(system_database_url=url, application_name=APP)
        try:
            for _ in range(runs):
                client.enqueue(
                    {"queue_name": QUEUE, "workflow_name": "agent_run", "app_version": VERSION}
                )
        finally:
            client.destroy()

    def start(self, url: str, sequential: bool, procs: Procs) -> None:
        concurrency = 1 if sequential else self.concurrency
        procs.start(
            [sys.executable, str(WORKER), url, QUEUE, str(concurrency), str(self.poll_seconds)]
        )

    def progress(self, conn: psycopg.Connection[Any]) -> tuple[int, int]:
        row = conn.execute(
            "SELECT (SELECT count(*) FROM dbos.operation_outputs "
            "        WHERE completed_at_epoch_ms IS NOT NULL),"
            "       (SELECT count(*) FROM dbos.workflow_status "
            "        WHERE status NOT IN ('ENQUEUED', 'PENDING', 'DELAYED'))"
        ).fetchone()
        assert row is not None
        return int(row[0]), int(row[1])

    def call_times(self, conn: psycopg.Connection[Any]) -> list[tuple[str, float]]:
        rows = conn.execute(
            "SELECT workflow_uuid, completed_at_epoch_ms / 1000.0 FROM dbos.operation_outputs "
            "WHERE completed_at_epoch_ms IS NOT NULL"
        ).fetchall()
        return [(str(r[0]), float(r[1])) for r in rows]

    def failures(self, conn: psycopg.Connection[Any]) -> int:
        row = conn.execute(
            "SELECT count(*) FROM dbos.workflow_status WHERE status <> 'SUCCESS'"
        ).fetchone()
        return int(row[0]) if row else 0
