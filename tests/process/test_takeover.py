"""SIGKILL mid-call with the default 30 s lease: the kernel closes the dead worker's
sockets, the server ends its listener session and frees its session lock, and the other
worker's listener heartbeat sees it and claims -- long before the lease expires, with a
new fencing token, and with no second effect."""

from __future__ import annotations

import signal
from typing import Any

import pytest

from runledger.testing import wait_for
from tests.process.conftest import call_rows, events, run_row, submit, wait_status

pytestmark = pytest.mark.process


def test_a_killed_workers_run_is_taken_over_before_its_lease_expires(
    workers: Any, provider: Any, admin_conn: Any
) -> None:
    # default lease (30 s); a poll interval past it, so that only the listener's heartbeat
    # can wake the other worker before the lease expires
    args = ["--poll-seconds", "120"]
    workers.start(2, args=args)
    wait_for(
        lambda: admin_conn.execute(
            "SELECT count(*) = 2 FROM runledger.workers WHERE session_lock IS NOT NULL"
        ).fetchone()[0],
        what="both workers registered with a session lock",
    )
    submit(admin_conn, "killed", [[{"tool": "ticket", "args": {"gate": "g"}}]])
    provider.client.wait_for_held("g")
    before = run_row(admin_conn, "killed")
    victim = workers.kill_holder("killed", admin_conn)

    takeover = wait_for(
        lambda: events(admin_conn, "killed", "takeover"), timeout=25, what="the takeover"
    )[0]
    assert takeover["detail"]["holder"] == "session_ended"
    assert takeover["detail"]["previous_owner"] == workers.worker_id(victim)
    assert takeover["fencing_token"] == before["fencing_token"] + 1
    assert takeover["actor"] == workers.worker_id(1 - victim)

    provider.client.open_gate("g")
    wait_status(admin_conn, "killed", ("succeeded",))
    assert len(provider.client.effects("killed:0:c0")) == 1
    [call] = call_rows(admin_conn, "killed")
    assert call["completed_by"] == workers.worker_id(1 - victim)


def test_a_frozen_worker_keeps_its_lock_and_is_taken_over_on_expiry_only(
    workers: Any, provider: Any, admin_conn: Any, db_clock: Any
) -> None:
    """SIGSTOP: alive but frozen, its kernel keeps the connection up, so its session and
    lock stay; nothing tells a slow worker from a stopped one but the lease."""
    (w0,) = workers.start(1)
    submit(admin_conn, "frozen", [[{"tool": "ticket", "args": {"gate": "g"}}]])
    provider.client.wait_for_held("g")
    workers.signal(w0, signal.SIGSTOP)
    try:
        workers.start(1)
        key = admin_conn.execute(
            "SELECT lease_lock FROM runledger.runs WHERE run_id = 'frozen'"
        ).fetchone()[0]
        assert key is not None
        # w1 is up and heartbeating; w0's lock is held by its listener's backend
        wait_for(
            lambda: admin_conn.execute(
                "SELECT 1 FROM runledger.workers"
                " WHERE worker_id = 'w1' AND session_lock IS NOT NULL"
            ).fetchone(),
            what="w1 registered",
        )
        holders = admin_conn.execute(
            "SELECT l.pid FROM pg_locks l JOIN runledger.workers w ON w.session_pid = l.pid"
            " WHERE l.locktype = 'advisory' AND l.granted AND w.worker_id = 'w0'"
            " AND ((l.classid::bigint << 32) | l.objid::bigint) = %s",
            (key,),
        ).fetchall()
        assert len(holders) == 1
        assert events(admin_conn, "frozen", "takeover") == []
        db_clock.advance(31)  # past the 30 s lease
        takeover = wait_for(
            lambda: events(admin_conn, "frozen", "takeover"), what="takeover on expiry"
        )[0]
        assert takeover["detail"]["holder"] == "expired"
        assert takeover["actor"] == "w1"
    finally:
        workers.signal(w0, signal.SIGCONT)
    provider.client.open_gate("g")
    wait_status(admin_conn, "frozen", ("succeeded",))
    assert len(provider.client.effects("frozen:0:c0")) == 1
