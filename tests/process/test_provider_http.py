"""The generic HTTP tool under SIGKILL: a worker process kills itself at each crash
window (``before_dispatch``, ``after_dispatch``, ``after_effect``, ``after_complete``)
inside a ``create_order`` call (tests/process/http_flows.py); a second worker recovers.
The orders API runs in this process, so it outlives the kill.

Every window settles without a person: the run succeeds, the call is ``succeeded`` and
the API holds exactly one order for its key (after ``after_effect``: found by the
lookup, not sent again).
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import pytest

from runledger.testing import WorkerPool
from tests.process.conftest import LEASE, call_rows, events, run_row, submit, wait_status
from tests.providers.fake_http import OrdersApi

pytestmark = pytest.mark.process

POINTS = ("before_dispatch", "after_dispatch", "after_effect", "after_complete")


@pytest.fixture(scope="module")
def api() -> Iterator[OrdersApi]:
    with OrdersApi() as a:
        yield a


@pytest.mark.parametrize("point", POINTS)
def test_a_kill_in_every_window_settles_with_one_order(
    point: str,
    api: OrdersApi,
    runledger_workers: WorkerPool,
    admin_conn: Any,
    db_clock: Any,
    lease_args: list[str],
) -> None:
    workers = runledger_workers
    workers.flows = ["tests.process.http_flows:flow"]
    env = {"ORDERS_URL": api.url}
    run_id = f"http-{point}"
    key = f"{run_id}:0:c0"
    body = {"body": {"sku": "A-1", "qty": 1}}
    plan = [[{"tool": "create_order", "args": body}], [{"tool": "create_order", "args": body}]]
    submit(admin_conn, run_id, plan, flow="http-providers")

    crash = {**env, "RUNLEDGER_CRASH_AT": f"{point}:create_order"}
    (first,) = workers.start(1, env=crash, args=lease_args)
    assert workers.wait(first, timeout=30) == -9, workers.log(first)
    assert run_row(admin_conn, run_id)["status"] == "running"
    assert api.effects(key) == (1 if point in ("after_effect", "after_complete") else 0)

    db_clock.advance(LEASE + 1)  # the dead worker's lease is over by the database clock
    (second,) = workers.start(1, env=env, args=lease_args)
    final = wait_status(admin_conn, run_id, ("succeeded", "paused", "failed"), timeout=40)

    calls = call_rows(admin_conn, run_id)
    assert final["status"] == "succeeded", (final, calls, workers.log(second))
    assert [c["status"] for c in calls] == ["succeeded", "succeeded"]
    assert api.effects(key) == 1  # never twice, never lost
    assert api.effects(f"{run_id}:1:c0") == 1
    assert not events(admin_conn, run_id, "run_paused")
    if point == "after_effect":
        # the order was created, its answer never journaled: found, not sent again
        assert api.posts(key) == 1
        assert calls[0]["result"]["idempotency_key"] == key
