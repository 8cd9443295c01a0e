"""Two workers with the same ``--worker-id``: the second is refused while the first lives.

The database ties a worker's registration to the session that made it (the worker's
listener connection) and refuses the id with RL008 (``WorkerConflict``) while another
live session holds it. NOTE: these tests need that ``register_worker`` (the SQL side of
issue 7, item 11); against an older ``register_worker`` they fail, as they should.
"""

from __future__ import annotations

import signal
from typing import Any

import pytest

from runledger.testing import wait_for
from tests.process.conftest import events, listening_backend, submit, wait_status

pytestmark = pytest.mark.process

TICKET = [[{"tool": "ticket"}]]
CONFLICT = "worker id 'w0' is in use by another live worker"


def _registered_pid(admin_conn: Any) -> int | None:
    row = admin_conn.execute(
        "SELECT pid FROM runledger.workers WHERE worker_id = 'w0' AND stopped_at IS NULL"
    ).fetchone()
    return None if row is None else int(row[0])


def _one_clear_line(log: str) -> str:
    assert "Traceback" not in log, log
    [line] = [x for x in log.splitlines() if "CRITICAL" in x]
    return line


def test_a_second_worker_with_a_live_id_exits_with_one_line_and_the_id_is_free_after_a_kill(
    workers: Any, provider: Any, admin_conn: Any, lease_args: list[str]
) -> None:
    (w0,) = workers.start(1, args=lease_args)
    submit(admin_conn, "first", TICKET)
    wait_status(admin_conn, "first", ("succeeded",))
    assert _registered_pid(admin_conn) == workers.pid(w0)

    (dup,) = workers.start(1, args=[*lease_args, "--worker-id", "w0"])
    assert workers.wait(dup, timeout=30) == 1, workers.log(dup)
    # the whole output is one line: no retry warning before it, no log line's stamp
    [line] = workers.log(dup).splitlines()
    assert line.startswith(f"error: WorkerConflict: {CONFLICT} (registered by host "), line
    assert f" pid {workers.pid(w0)} since " in line
    assert line.endswith(": stop that worker or start this one with another --worker-id")
    # the first worker is untouched and still the registered one
    assert workers.alive(w0)
    assert _registered_pid(admin_conn) == workers.pid(w0)

    # SIGKILLed, its session goes away (a moment later): a restart with the id succeeds
    workers.kill(w0)
    workers.restart(w0)
    wait_for(lambda: _registered_pid(admin_conn) == workers.pid(w0), what="w0 registered again")
    submit(admin_conn, "second", TICKET)
    wait_status(admin_conn, "second", ("succeeded",))
    assert [e["actor"] for e in events(admin_conn, "second", "claimed")] == ["w0"]
    assert "Traceback" not in workers.log(w0)


def test_a_worker_whose_id_was_taken_while_its_listener_was_away_stops(
    workers: Any, provider: Any, admin_conn: Any
) -> None:
    args = ["--lease-seconds", "30"]  # w0 is SIGSTOPped a moment: keep its leases valid
    (w0,) = workers.start(1, args=args)
    listener = wait_for(lambda: listening_backend(admin_conn, "w0"), what="w0's listener up")
    wait_for(lambda: _registered_pid(admin_conn) == workers.pid(w0), what="w0 registered")

    # cut w0 off: frozen, its listener session ended by the server; another takes the id
    workers.signal(w0, signal.SIGSTOP)
    admin_conn.execute("SELECT pg_terminate_backend(%s)", (listener,))
    (dup,) = workers.start(1, args=[*args, "--worker-id", "w0"])
    wait_for(lambda: _registered_pid(admin_conn) == workers.pid(dup), what="the id taken")

    workers.signal(w0, signal.SIGCONT)  # w0 reconnects, is refused, and stops
    assert workers.wait(w0, timeout=30) == 1, workers.log(w0)
    assert CONFLICT in _one_clear_line(workers.log(w0))
    # the worker that holds the id goes on, its registration untouched by w0's exit
    assert workers.alive(dup)
    assert _registered_pid(admin_conn) == workers.pid(dup)
    submit(admin_conn, "after-conflict", TICKET)
    wait_status(admin_conn, "after-conflict", ("succeeded",))
