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
    assert [line for line in log.splitlines() if line.startswith("Error:")] == [
        "Error: Invalid value for '--lease-seconds' (env var: RUNLEDGER_LEASE_SECONDS): "
        "'nan' is not a finite number."
    ]
    assert "Traceback" not in log
