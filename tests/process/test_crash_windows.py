"""One worker process SIGKILLs itself at a named crash point; a second one recovers.

Every crash window of the seed's table, for every safety class. The first worker's
lease is expired with the fake database clock (no waiting), and the assertions are
on the run tables and on the provider's effects.
"""

from __future__ import annotations

from typing import Any

import pytest

from runledger.testing import wait_for
from tests.process.conftest import LEASE, call_rows, events, run_row, submit, wait_status

pytestmark = pytest.mark.process

TOOLS = {"ticket": "idempotent", "charge": "lookup", "email": "unsafe", "read": "read_only"}
POINTS = ["before_dispatch", "after_dispatch", "after_effect", "after_complete"]

# (point, tool) -> (final run status, provider effects for the key, attempts, recovered how)
EXPECTED: dict[tuple[str, str], tuple[str, int, int]] = {
    ("before_dispatch", "ticket"): ("succeeded", 1, 1),
    ("before_dispatch", "charge"): ("succeeded", 1, 1),
    ("before_dispatch", "email"): ("succeeded", 1, 1),
    ("before_dispatch", "read"): ("succeeded", 0, 1),
    # dispatched, tool never ran: idempotent repeats, lookup finds nothing and repeats,
    # read_only reruns, unsafe cannot know -> unknown and the run pauses
    ("after_dispatch", "ticket"): ("succeeded", 1, 2),
    ("after_dispatch", "charge"): ("succeeded", 1, 2),
    ("after_dispatch", "email"): ("paused", 0, 1),
    ("after_dispatch", "read"): ("succeeded", 0, 2),
    # the effect exists, the journal does not know: same key (provider dedups), lookup
    # finds it (no second dispatch), unsafe pauses, read_only reruns
    ("after_effect", "ticket"): ("succeeded", 1, 2),
    ("after_effect", "charge"): ("succeeded", 1, 1),
    ("after_effect", "email"): ("paused", 1, 1),
    ("after_effect", "read"): ("succeeded", 0, 2),
    # the receipt is saved: reuse it, never call again
    ("after_complete", "ticket"): ("succeeded", 1, 1),
    ("after_complete", "charge"): ("succeeded", 1, 1),
    ("after_complete", "email"): ("succeeded", 1, 1),
    ("after_complete", "read"): ("succeeded", 0, 1),
}


@pytest.mark.parametrize("point", POINTS)
@pytest.mark.parametrize("tool", list(TOOLS))
def test_crash_window(
    point: str,
    tool: str,
    workers: Any,
    provider: Any,
    admin_conn: Any,
    db_clock: Any,
    lease_args: list[str],
) -> None:
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

    status, effects, attempts = EXPECTED[(point, tool)]
    assert final["status"] == status, (final, call_rows(admin_conn, run_id), workers.log(second))
    first_call = call_rows(admin_conn, run_id)[0]
    assert first_call["idempotency_key"] == key
    assert first_call["attempts"] == attempts
    assert len(provider.client.effects(key)) == effects
    takeover = events(admin_conn, run_id, "takeover")
    assert takeover and takeover[0]["actor"] == "w1" and takeover[0]["fencing_token"] == 2

    if status == "paused":
        assert first_call["status"] == "unknown"
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
        assert first_call["status"] == "succeeded"
        if tool == "charge" and point == "after_effect":
            assert first_call["receipt"]["found_by"] == "lookup"
        if point in ("before_dispatch", "after_complete"):
            assert first_call["completed_token"] == (2 if point == "before_dispatch" else 1)
    # the second turn ran once, under the new token
    assert len(provider.client.effects(f"{run_id}:1:c0")) == 1
    wait_for(lambda: run_row(admin_conn, run_id)["status"] == "succeeded")
