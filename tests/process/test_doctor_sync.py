"""``runledger doctor`` on a real primary with one synchronous and one asynchronous
standby (local binaries; the default of Patroni's synchronous mode): healthy, exit 0,
the synchronous standby named synchronous and the other asynchronous."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from runledger.db import migrate
from runledger.testing import wait_for
from tests.process.replication import start_cluster

pytestmark = [pytest.mark.process]

ROOT = Path(__file__).resolve().parents[2]


@pytest.mark.timeout(120)
def test_doctor_is_healthy_with_one_sync_and_one_async_standby() -> None:
    cluster = start_cluster(n_standbys=2, sync="FIRST 1 (s1)")
    try:
        expected = {"s1": ("streaming", "sync"), "s2": ("streaming", "async")}
        wait_for(
            lambda: cluster.replication() == expected,
            timeout=30,
            what="s1 to stream synchronously and s2 asynchronously",
        )
        with cluster.primary.connect() as admin:
            admin.execute("CREATE DATABASE doctor")
        url = cluster.primary.url("doctor")
        migrate.upgrade(url)  # its commits wait for s1
        done = subprocess.run(
            [sys.executable, "-m", "runledger", "doctor", "--json", "--database-url", url],
            capture_output=True,
            text=True,
            timeout=60,
            env={**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT), *sys.path])},
            check=False,
        )
    finally:
        cluster.stop()
    assert done.returncode == 0, done.stdout + done.stderr
    checks = {r["check"]: r for r in json.loads(done.stdout)}
    assert {name: r["status"] for name, r in checks.items() if r["status"] != "ok"} == {}
    repl = checks["replication"]
    assert repl["data"]["synchronous"] == ["s1 (sync)"]
    assert repl["data"]["asynchronous"] == ["s2 (async)"]
    assert repl["data"]["synchronous_standby_names"] == "FIRST 1 (s1)"
    detail = repl["detail"]
    assert detail.startswith("synchronous standby(s): s1 (sync); asynchronous standby(s): s2")
    assert "A failover must go to a synchronous standby" in detail
