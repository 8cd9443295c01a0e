"""A real ``runledger worker`` process takes its settings from ``RUNLEDGER_<OPTION>``."""

from __future__ import annotations

import datetime as dt
from typing import Any

import pytest

from tests.process.conftest import submit, wait_status

pytestmark = pytest.mark.process


def test_a_worker_process_reads_runledger_option(workers: Any, admin_conn: Any) -> None:
    workers.start(1, env={"RUNLEDGER_LEASE_SECONDS": "7", "RUNLEDGER_CONCURRENCY": "2"})
    submit(admin_conn, "env-proc", [[{"tool": "ticket"}]])
    wait_status(admin_conn, "env-proc", ("succeeded",))
    claimed = admin_conn.execute(
        "SELECT actor, (detail->>'lease_expires_at')::timestamptz - at FROM runledger.run_events "
        "WHERE run_id = 'env-proc' AND kind = 'claimed'"
    ).fetchall()
    assert claimed == [("w0", dt.timedelta(seconds=7))]


def test_a_bad_env_value_stops_the_worker_with_one_line(workers: Any) -> None:
    (w0,) = workers.start(1, env={"RUNLEDGER_LEASE_SECONDS": "nan"})
    assert workers.wait(w0) == 2
    log = workers.log(w0)
    assert [line for line in log.splitlines() if line.startswith("error:")] == [
        "error: Invalid value for '--lease-seconds' (env var: RUNLEDGER_LEASE_SECONDS): "
        "'nan' is not a finite number."
    ]
    assert "Traceback" not in log


@pytest.mark.parametrize(("choice", "loop"), [("auto", "uvloop"), ("asyncio", "asyncio")])
def test_the_worker_runs_on_the_event_loop_it_is_given(
    workers: Any, admin_conn: Any, choice: str, loop: str
) -> None:
    """uvloop by default (a dependency on this platform), asyncio's own on request; the
    runs go through either way."""
    (w0,) = workers.start(1, env={"RUNLEDGER_EVENT_LOOP": choice, "RUNLEDGER_LOG_LEVEL": "INFO"})
    submit(admin_conn, f"loop-{choice}", [[{"tool": "ticket"}], [{"tool": "ticket"}]])
    wait_status(admin_conn, f"loop-{choice}", ("succeeded",))
    [started] = [line for line in workers.log(w0).splitlines() if "worker started" in line]
    assert f"event_loop={loop}" in started
