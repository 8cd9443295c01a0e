"""A pooler outage shorter than a third of the lease costs no lease.

Workers reach the database through a real PgBouncer (transaction mode), with and without
a direct URL for their own sessions. Runs hold their leases on a gated tool call while
PgBouncer is SIGKILLed and started again within two seconds. Every pooled connection
breaks, and the pool waits before it reconnects; the lease keeper renews on a session of
its own meanwhile (the direct URL when there is one, else a fresh connection through the
pooler once it is back), so no run is taken over, fenced or claimed twice.
"""

from __future__ import annotations

import time
from typing import Any

import pytest

from runledger.testing import wait_for
from tests.process.conftest import events, run_row, submit, wait_status
from tests.process.pgbouncer import pgbouncer

pytestmark = pytest.mark.process

LEASE = 5.0  # a third of it (1.7 s) is more than the outage
OUTAGE = 1.5  # s between PgBouncer's SIGKILL and its start
RUNS = 6


def _expiries(conn: Any, prefix: str) -> list[Any]:
    return [
        r[0]
        for r in conn.execute(
            "SELECT lease_expires_at FROM runledger.runs WHERE run_id LIKE %s AND status = "
            "'running'",
            (prefix + "%",),
        ).fetchall()
    ]


@pytest.mark.timeout(180)
@pytest.mark.parametrize("direct", [False, True], ids=["pooled", "direct-url"])
def test_a_pooler_restarted_within_two_seconds_costs_no_lease(
    direct: bool,
    workers: Any,
    provider: Any,
    admin_conn: Any,
    database_url: str,
    runledger_server: Any,
) -> None:
    prefix = f"pgb-restart-{'direct' if direct else 'pooled'}-"
    with pgbouncer(runledger_server.admin_url, "transaction") as bouncer:
        env = {"RUNLEDGER_POOLER": "transaction"}
        if direct:
            env["RUNLEDGER_DIRECT_URL"] = database_url
        workers.database_url = bouncer.url(database_url)
        workers.start(2, env=env, args=["--lease-seconds", str(LEASE), "--concurrency", "4"])
        for n in range(RUNS):
            submit(admin_conn, f"{prefix}{n}", [[{"tool": "ticket", "args": {"gate": "g"}}]])
        provider.client.wait_for_held("g", count=RUNS, timeout=60)

        bouncer.kill()  # every pooled connection drops
        time.sleep(OUTAGE)  # the fault's length, not a wait for a result
        bouncer.start()
        back = admin_conn.execute("SELECT runledger.now()").fetchone()[0]
        # each lease renewed after the outage: its expiry past the restart plus a lease
        wait_for(
            lambda: min(_expiries(admin_conn, prefix)).timestamp() > back.timestamp() + LEASE,
            timeout=4 * LEASE,
            what="every lease renewed after the outage",
        )

        provider.client.open_gate("g")
        for n in range(RUNS):
            wait_status(admin_conn, f"{prefix}{n}", ("succeeded",), timeout=60)
        logs = workers.log(0) + workers.log(1)
        for n in range(RUNS):
            run_id = f"{prefix}{n}"
            assert run_row(admin_conn, run_id)["fencing_token"] == 1, (run_id, logs)
            assert not events(admin_conn, run_id, "takeover"), logs
            assert not events(admin_conn, run_id, "renewal_failed"), logs
            assert len(provider.client.effects(f"{run_id}:0:c0")) == 1
        assert "dropping run" not in logs, logs
        assert "Traceback" not in logs, logs
