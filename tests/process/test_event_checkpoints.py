"""The event chains as real workers write them (revision 0016): two worker processes,
one SIGKILLed mid-call and its run taken over; the workers checkpoint the chains
themselves (every 10 s), and `runledger audit` verifies every hash and every head."""

from __future__ import annotations

from typing import Any

import pytest

from runledger.audit import audit
from runledger.testing import wait_for
from runledger.worker.process import CHECKPOINT_EVERY
from tests.process.conftest import submit, wait_status

pytestmark = pytest.mark.process


def test_workers_checkpoint_chains_that_audit_verifies(
    workers: Any, provider: Any, admin_conn: Any, database_url: str
) -> None:
    workers.start(2)
    submit(admin_conn, "held", [[{"tool": "ticket", "args": {"gate": "g"}}]])
    for i in range(6):
        submit(admin_conn, f"free-{i}", [[{"tool": "ticket", "args": {}}] * 2, []])
    provider.client.wait_for_held("g")
    workers.kill_holder("held", admin_conn)
    provider.client.open_gate("g")
    for run_id in ["held", *(f"free-{i}" for i in range(6))]:
        wait_status(admin_conn, run_id, ("succeeded",))
    (last,) = admin_conn.execute("SELECT max(event_id) FROM runledger.run_events").fetchone()
    ids = [workers.worker_id(i) for i in range(2)]
    made = wait_for(
        lambda: admin_conn.execute(
            "SELECT checkpoint_id, actor FROM runledger.event_checkpoints"
            " WHERE through_event_id >= %s AND actor = ANY(%s)",
            (last, ids),
        ).fetchone(),
        timeout=3 * CHECKPOINT_EVERY + 10,
        what="a worker's checkpoint covering every event",
    )
    assert made[0] >= 1
    covered = admin_conn.execute(
        "SELECT count(DISTINCT run_id) FROM runledger.event_checkpoint_heads"
    ).fetchone()[0]
    assert covered == 7
    result = audit(database_url)
    assert result.ok, [(f.check.name, f.rows) for f in result.findings if not f.ok]
    assert result.latest is not None and result.latest["through_event_id"] >= last
