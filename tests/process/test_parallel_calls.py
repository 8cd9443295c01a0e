"""Three calls of one turn in flight at once in a real worker process, which is then
SIGKILLed: the next worker recovers each call by its own safety class, exactly as it
would one call alone (``tests/process/parallel_flows.py``)."""

from __future__ import annotations

from typing import Any

import pytest
from psycopg.types.json import Jsonb

from tests.process.conftest import LEASE, call_rows, run_row, wait_status

pytestmark = pytest.mark.process


def test_sigkill_with_three_parallel_calls_in_flight(
    workers: Any, provider: Any, admin_conn: Any, db_clock: Any, lease_args: list[str]
) -> None:
    workers.flows = ["tests.process.parallel_flows:flows"]
    run_id = "fan-1"
    admin_conn.execute(
        "SELECT * FROM runledger.submit_run(%s, 'fanout', '1', %s)",
        (run_id, Jsonb({"gate": "fan"})),
    )
    (first,) = workers.start(1, args=lease_args)
    # all three effects applied and held at once: they were sent concurrently
    provider.client.wait_for_held("fan", 3)
    rows = call_rows(admin_conn, run_id)
    assert [(r["tool"], r["status"]) for r in rows] == [
        ("open_ticket", "dispatched"),
        ("charge", "dispatched"),
        ("send_email", "dispatched"),
    ]
    workers.kill(first)
    assert workers.wait(first) == -9
    provider.client.open_gate("fan")

    db_clock.advance(LEASE + 1)
    workers.start(1, args=lease_args)
    final = wait_status(admin_conn, run_id, ("paused", "succeeded", "failed"))
    assert final["status"] == "paused", (final, call_rows(admin_conn, run_id))
    by_tool = {r["tool"]: r for r in call_rows(admin_conn, run_id)}
    # idempotent: sent again under the same key, deduplicated by the provider
    assert (by_tool["open_ticket"]["status"], by_tool["open_ticket"]["attempts"]) == (
        "succeeded",
        2,
    )
    # lookup: found by its key, not sent again
    assert (by_tool["charge"]["status"], by_tool["charge"]["attempts"]) == ("succeeded", 1)
    # unsafe: unknown, and the pause names it for a person
    email = by_tool["send_email"]
    assert (email["status"], email["attempts"]) == ("unknown", 1)
    assert email["idempotency_key"] in run_row(admin_conn, run_id)["pause_reason"]
    for r in by_tool.values():
        assert len(provider.client.effects(r["idempotency_key"])) == 1, r
