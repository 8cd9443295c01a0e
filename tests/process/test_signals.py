"""SIGSTOP past the lease, SIGTERM drain, and a listener that is killed."""

from __future__ import annotations

import os
import signal
import time
from typing import Any

import pytest

from runledger.testing import wait_for
from runledger.worker.listening import REGISTER_PATIENCE
from tests.integration.test_supervisor import NOTE_REGISTRATIONS, REGISTRATIONS
from tests.process.conftest import (
    LEASE,
    call_rows,
    events,
    listening_backend,
    run_row,
    submit,
    wait_status,
)
from tests.process.test_health_endpoints import answers, free_port, get

pytestmark = pytest.mark.process


def test_paused_worker_is_fenced_by_the_database(
    workers: Any, provider: Any, admin_conn: Any, db_clock: Any, lease_args: list[str]
) -> None:
    run_id = "stopped-run"
    key = f"{run_id}:0:c0"
    provider.client.configure(check_tokens=True)
    submit(admin_conn, run_id, [[{"tool": "ticket", "args": {"gate": "g1"}}]])
    (w0,) = workers.start(1, args=lease_args)
    # w0 is inside the tool call: the provider has the effect, the response is held
    wait_for(lambda: provider.client.effects(key), what="w0's request at the provider")
    workers.stop(w0)  # SIGSTOP: paused like a long GC or a partition

    db_clock.advance(LEASE + 1)
    (w1,) = workers.start(1, args=lease_args)
    wait_for(lambda: run_row(admin_conn, run_id)["fencing_token"] == 2, what="takeover by w1")
    provider.client.open_gate("g1")
    done = wait_status(admin_conn, run_id, ("succeeded",))
    assert done["fencing_token"] == 2
    (call,) = call_rows(admin_conn, run_id)
    assert call["completed_by"] == "w1" and call["completed_token"] == 2 and call["attempts"] == 2

    workers.cont(w0)  # it wakes up holding a result for a lease it lost
    rejected = wait_for(
        lambda: events(admin_conn, run_id, "stale_write_rejected"),
        what="w0's refused write recorded",
    )
    assert rejected[0]["actor"] == "w0"
    assert rejected[0]["fencing_token"] is None  # the stale token lives in detail only
    assert rejected[0]["detail"]["stale_token"] == 1
    assert rejected[0]["detail"]["current_token"] == 2
    # the refused write changed nothing, and the effect happened once
    (after,) = call_rows(admin_conn, run_id)
    assert after == call
    assert len(provider.client.effects(key)) == 1
    # w0 stays alive and keeps working on other runs
    assert workers.alive(w0)
    workers.terminate(w1)
    assert workers.wait(w1) == 0
    submit(admin_conn, "after-wakeup", [[{"tool": "ticket"}]])
    wait_status(admin_conn, "after-wakeup", ("succeeded",))
    assert call_rows(admin_conn, "after-wakeup")[0]["completed_by"] == "w0"


def test_sigterm_drains_in_flight_call_and_releases_lease(
    workers: Any, provider: Any, admin_conn: Any, lease_args: list[str]
) -> None:
    run_id = "drained"
    submit(
        admin_conn,
        run_id,
        [
            [{"tool": "ticket", "args": {"gate": "g2"}}],
            [{"tool": "ticket", "args": {"title": "second"}}],
        ],
    )
    (w0,) = workers.start(1, args=lease_args)
    wait_for(lambda: provider.client.effects(f"{run_id}:0:c0"), what="call in flight")
    workers.terminate(w0)
    provider.client.open_gate("g2")
    assert workers.wait(w0, timeout=30) == 0, workers.log(w0)

    # the in-flight call finished and was journaled; the next turn was not started
    row = run_row(admin_conn, run_id)
    assert row["status"] == "queued" and row["lease_owner"] is None
    calls = call_rows(admin_conn, run_id)
    assert [c["status"] for c in calls] == ["succeeded"]
    assert [e["actor"] for e in events(admin_conn, run_id, "lease_released")] == ["w0"]
    stopped = admin_conn.execute(
        "SELECT started_at, heartbeat_at, stopped_at FROM runledger.workers WHERE worker_id = 'w0'"
    ).fetchone()
    assert stopped is not None and stopped[2] is not None and stopped[0] <= stopped[2]

    (w1,) = workers.start(1, args=lease_args)
    wait_status(admin_conn, run_id, ("succeeded",))
    assert len(provider.client.effects(f"{run_id}:0:c0")) == 1
    assert len(provider.client.effects(f"{run_id}:1:c0")) == 1
    del w1


def test_second_sigterm_exits_at_once(
    workers: Any, provider: Any, admin_conn: Any, lease_args: list[str]
) -> None:
    submit(admin_conn, "held", [[{"tool": "ticket", "args": {"gate": "never"}}]])
    (w0,) = workers.start(1, args=[*lease_args, "--grace-seconds", "600"])
    wait_for(lambda: provider.client.effects("held:0:c0"), what="call in flight")
    workers.terminate(w0)
    wait_for(lambda: "stopping" in workers.log(w0), what="first SIGTERM handled")
    assert workers.alive(w0)  # waiting for its in-flight call (grace 600 s)
    workers.terminate(w0)
    assert workers.wait(w0, timeout=10) == 1


def test_killed_listener_does_not_stop_claiming(
    workers: Any, provider: Any, admin_conn: Any, lease_args: list[str]
) -> None:
    for statement in NOTE_REGISTRATIONS:
        admin_conn.execute(statement)
    (w0,) = workers.start(1, args=lease_args)

    def registrations() -> list[int]:
        return [r[0] for r in admin_conn.execute(REGISTRATIONS, ("w0",)).fetchall()]

    def listener_pids() -> list[int]:
        rows = admin_conn.execute(
            "SELECT pid FROM pg_stat_activity WHERE application_name LIKE 'runledger-listener:w0%'"
        ).fetchall()
        return [r[0] for r in rows]

    # started on its listener (a session ended before that is a failed start, exit 3)
    old = wait_for(lambda: listening_backend(admin_conn, "w0"), what="w0's listener up")
    assert listener_pids() == [old]
    # w0 registered from its listener's session
    assert wait_for(registrations, what="w0's registration") == [old]
    admin_conn.execute("SELECT pg_terminate_backend(%s)", (old,))
    submit(admin_conn, "after-kill", [[{"tool": "ticket"}]])
    wait_status(admin_conn, "after-kill", ("succeeded",))
    # and the listener came back on a new connection
    new = wait_for(lambda: [p for p in listener_pids() if p != old], what="listener reconnect")
    assert old not in new
    # and registered again on it
    assert wait_for(lambda: len(registrations()) == 2 and registrations()) == [old, *new]
    assert workers.alive(w0)


def registered_session(admin_conn: Any) -> int:
    row = admin_conn.execute(
        "SELECT session_pid FROM runledger.workers WHERE worker_id = 'w0'"
    ).fetchone()
    return int(row[0])


def test_a_lost_listener_session_the_server_still_holds_is_waited_for(
    workers: Any, provider: Any, admin_conn: Any, lease_args: list[str]
) -> None:
    """The worker gave its listener session up (no heartbeat answered within the budget)
    but the server has not ended it yet, as after a partition shorter than the server's
    keepalives: the session's backend is SIGSTOPped here. Registering again is refused
    while that session lives, for longer than the patience a predecessor's session gets
    at start and for more attempts than the worker remembers sessions of its own; the
    worker waits for its own session to end instead of stopping, then registers again
    and works on; /readyz says claiming is paused meanwhile."""
    port = free_port()
    (w0,) = workers.start(
        1, args=[*lease_args, "--http-port", str(port), "--http-host", "127.0.0.1"]
    )
    assert wait_for(lambda: answers(port, "/readyz"), what="/readyz") == (200, "ok\n")

    def stopped_while_idle() -> int | None:
        pid = wait_for(lambda: listening_backend(admin_conn, "w0"), what="w0's listener up")
        os.kill(pid, signal.SIGSTOP)
        # not inside a heartbeat, whose locks would hold the next registration up
        state = admin_conn.execute(
            "SELECT state FROM pg_stat_activity WHERE pid = %s", (pid,)
        ).fetchone()
        if state == ("idle",):
            return pid
        os.kill(pid, signal.SIGCONT)
        return None

    def sessions() -> int:
        row = admin_conn.execute(
            "SELECT sessions FROM pg_stat_database WHERE datname = current_database()"
        ).fetchone()
        return int(row[0])

    old = wait_for(stopped_while_idle, what="w0's listener stopped while idle")
    try:
        wait_for(
            lambda: "previous listener session" in workers.log(w0) or not workers.alive(w0),
            what="w0 waiting for its previous session to end",
        )
        assert workers.alive(w0), workers.log(w0)
        # each attempt is a session of its own: more of them than the 16 it remembers,
        # and longer than REGISTER_PATIENCE
        started, since = sessions(), time.monotonic()
        wait_for(
            lambda: sessions() - started >= 20 or not workers.alive(w0),
            timeout=90,
            interval=0.5,
            what="20 refused attempts",
        )
        assert workers.alive(w0), workers.log(w0)
        assert time.monotonic() - since > REGISTER_PATIENCE
        assert registered_session(admin_conn) == old  # not registered again meanwhile
        assert get(port, "/readyz") == (
            503,
            "not ready: the listener session is down: claiming paused until it is back\n",
        )
    finally:
        os.kill(old, signal.SIGCONT)  # it reads the worker's goodbye and exits
    new = wait_for(
        lambda: (pid := registered_session(admin_conn)) != old and pid, what="w0 registered again"
    )
    assert wait_for(lambda: listening_backend(admin_conn, "w0") == new, what="listening") is True
    assert get(port, "/readyz") == (200, "ok\n")
    submit(admin_conn, "after-wait", [[{"tool": "ticket"}]])
    wait_status(admin_conn, "after-wait", ("succeeded",))
    assert [e["actor"] for e in events(admin_conn, "after-wait", "claimed")] == ["w0"]
    assert "Traceback" not in workers.log(w0)
