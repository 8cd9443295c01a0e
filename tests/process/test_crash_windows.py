"""One worker process SIGKILLs itself at a named crash point; a second one recovers.

Every crash window of the seed's table, for every safety class: the rows are
``tests/crash_windows.py``, the same ones ``tests/unit/test_recovery.py`` drives the
pure decision through. The first worker's lease is expired with the fake database
clock (no waiting), and the assertions are on the run tables, the events and the
provider's effects.
"""

from __future__ import annotations

from typing import Any

import pytest

from runledger.testing import wait_for
from runledger.worker.recovery import MarkUnknown, Reuse
from tests.crash_windows import ROWS, Row
from tests.process.conftest import LEASE, call_rows, events, run_row, submit, wait_status

pytestmark = pytest.mark.process


@pytest.mark.parametrize("row", ROWS, ids=[r.id for r in ROWS])
def test_crash_window(
    row: Row,
    workers: Any,
    provider: Any,
    admin_conn: Any,
    db_clock: Any,
    lease_args: list[str],
) -> None:
    point, tool = row.point, row.tool
    run_id = f"crash-{point}-{tool}"
    key = f"{run_id}:0:c0"
    submit(admin_conn, run_id, [[{"tool": tool}], [{"tool": "ticket", "args": {"title": "after"}}]])

    (first,) = workers.start(1, env={"RUNLEDGER_CRASH_AT": f"{point}:{tool}"}, args=lease_args)
    assert workers.wait(first, timeout=30) == -9, workers.log(first)
    crashed = run_row(admin_conn, run_id)
    assert crashed["status"] == "running" and crashed["fencing_token"] == 1

    db_clock.advance(LEASE + 1)  # the dead worker's lease is over by the database clock
    (second,) = workers.start(1, args=lease_args)
    final = wait_status(admin_conn, run_id, ("succeeded", "paused", "failed"))

    assert final["status"] == row.run_status, (
        final,
        call_rows(admin_conn, run_id),
        workers.log(second),
    )
    first_call = call_rows(admin_conn, run_id)[0]
    assert first_call["idempotency_key"] == key
    assert first_call["status"] == row.call_status
    assert first_call["attempts"] == row.attempts
    effects = len(provider.client.effects(key))
    assert effects == row.effects
    # what the next worker did: its sends of the call (same key), under its token
    resent = [
        e
        for e in events(admin_conn, run_id, "call_dispatched")
        if e["detail"]["idempotency_key"] == key and e["fencing_token"] == 2
    ]
    assert len(resent) == row.resends
    takeover = events(admin_conn, run_id, "takeover")
    assert takeover and takeover[0]["actor"] == "w1" and takeover[0]["fencing_token"] == 2

    if row.run_status == "paused":
        (unknown,) = row.steps
        assert isinstance(unknown, MarkUnknown)
        error = dict(first_call["error"])
        [waited] = error.pop("evidence")  # the dead worker, waited for
        assert error == unknown.error
        assert (waited["step"], waited["worker"]) == ("earlier sender", "w0")
        assert key in final["pause_reason"]
        # a person reconciles: the provider shows whether the e-mail went out
        resolution = "applied" if effects else "not_applied"
        admin_conn.execute(
            "SELECT runledger.resolve_call(%s, %s, %s::jsonb, 'ops', 'checked')",
            (key, resolution, '{"checked": true}' if effects else None),
        )
        wait_status(admin_conn, run_id, ("succeeded",))
        assert len(provider.client.effects(key)) == 1  # exactly one e-mail, never two
    else:
        found_by = (first_call["receipt"] or {}).get("found_by")
        assert (found_by == "lookup") == row.found_by_lookup
        # a reused receipt keeps the dead worker's token; anything else is the new one's
        assert first_call["completed_token"] == (1 if row.steps == (Reuse(),) else 2)
    # the second turn ran once, under the new token
    assert len(provider.client.effects(f"{run_id}:1:c0")) == 1
    wait_for(lambda: run_row(admin_conn, run_id)["status"] == "succeeded")
