"""Workers on a full disk: the tablespace of the worker's database is a small filesystem
the test fills to its last byte and frees again (tests/small_disk.py), a real ENOSPC
(SQLSTATE 53100), no mock.

- A claim the database fails is one warning line, its cause first, without a traceback,
  and the claimer backs off: the waits it announces double, and it keeps to them.
- An e-mail sent while the disk is full is not dropped when its completion fails: the
  worker keeps the result and sends it again, and once space is back it is journaled as
  sent by the same lease. When the lease ends first, the worker hands the result over
  (``release_call``, sent again until it lands), and the run's next holder journals it as
  sent. Never ``unknown``, never a person asked, one e-mail.
"""

from __future__ import annotations

import datetime as dt
import itertools
import json
import os
from collections.abc import Iterator
from typing import Any

import psycopg
import pytest

from runledger.testing import ProviderProcess, WorkerPool, wait_for
from tests.process.conftest import call_rows, events, run_row, submit, wait_status
from tests.process.full_disk_flows import message

pytestmark = pytest.mark.process

LEASE = 5.0
FLOW = "full-disk-mail"


@pytest.fixture
def disk_workers(
    request: pytest.FixtureRequest, small_disk: Any, provider: ProviderProcess
) -> Iterator[WorkerPool]:
    """Worker processes on the small disk's database, running full_disk_flows."""
    paths = [str(request.config.rootpath), os.environ.get("PYTHONPATH", "")]
    pool = WorkerPool(
        small_disk.url,
        ["tests.process.full_disk_flows:flow"],
        env={
            "RUNLEDGER_PROVIDER_URL": provider.url,
            "PYTHONPATH": os.pathsep.join(p for p in paths if p),
        },
        args=["--poll-seconds", "0.2", "--lease-seconds", str(LEASE)],
        cwd=str(request.config.invocation_params.dir),
    )
    try:
        yield pool
    finally:
        pool.close()


@pytest.fixture
def conn(small_disk: Any) -> Iterator[psycopg.Connection[Any]]:
    with psycopg.connect(small_disk.url, autocommit=True) as c:
        yield c


def _json_lines(log: str) -> list[dict[str, Any]]:
    found = []
    for line in log.splitlines():
        if line.startswith("{"):
            found.append(json.loads(line))
    return found


def _at(line: dict[str, Any]) -> float:
    return dt.datetime.strptime(line["at"], "%Y-%m-%d %H:%M:%S,%f").timestamp()


def test_a_failed_claim_is_one_line_cause_first_and_the_claimer_backs_off(
    small_disk: Any, disk_workers: WorkerPool, conn: psycopg.Connection[Any]
) -> None:
    # a worker row, so that registering fits in a page the table has; the claims' first
    # write (how commits are acknowledged: an empty table's first row) needs a new one
    conn.execute(
        "SELECT * FROM runledger.register_worker_v2('someone', 'host', 1, %s, false)",
        ([f"{FLOW}@1"],),
    )
    small_disk.fill()
    disk_workers.start(1, args=["--log-json"])

    def failed_claims() -> list[dict[str, Any]]:
        lines = _json_lines(disk_workers.log(0))
        return [x for x in lines if x["msg"].startswith("claim failed")]

    claims = wait_for(
        lambda: (f := failed_claims()) and len(f) >= 5 and f,
        timeout=90,
        what="five failed claims",
    )[:5]
    for line in claims:
        assert line["level"] == "WARNING", line
        assert line["msg"].startswith("claim failed: disk full: could not extend file"), line
        assert "(SQLSTATE 53100)" in line["msg"], line
        assert "exc" not in line, line  # the traceback is at debug level only
    assert "Traceback" not in disk_workers.log(0)
    assert [x["failures"] for x in claims] == [1, 2, 3, 4, 5]
    waits = [x["retry_in"] for x in claims]
    assert all(b > a for a, b in itertools.pairwise(waits)), waits
    assert waits[-1] > 4 * waits[0], waits
    # and it waited at least that long before each next claim (no claim at every poll)
    gaps = [_at(b) - _at(a) for a, b in itertools.pairwise(claims)]
    assert all(gap >= wait - 0.01 for gap, wait in zip(gaps, waits, strict=False)), (gaps, waits)

    # space is back: the claims go through again, and a run submitted now is done
    small_disk.free()
    submit(conn, "after-full", [[{"tool": "send_email", "args": {"to": "a@example.com"}}]], FLOW)
    wait_status(conn, "after-full", ("succeeded",), timeout=90)


def _mail_run(conn: psycopg.Connection[Any], provider: ProviderProcess, run_id: str) -> str:
    """Submit a run that sends one e-mail, held at the provider's gate once sent: its
    call's key, dispatched (committed) and the e-mail on its way."""
    plan = [[{"tool": "send_email", "args": {"to": "ops@example.com", "gate": "g"}}]]
    submit(conn, run_id, plan, FLOW)
    provider.client.wait_for_held("g")
    [call] = call_rows(conn, run_id)
    assert call["status"] == "dispatched"
    return str(call["idempotency_key"])


def _completions_failed(pool: WorkerPool, count: int) -> None:
    wait_for(
        lambda: pool.log(0).count("complete_call failed: disk full") >= count,
        timeout=60,
        what=f"{count} failed completions of the e-mail's result",
    )


def _sent_once(conn: psycopg.Connection[Any], provider: ProviderProcess, run_id: str) -> None:
    """Journaled as sent, with the message the tool returned; never unknown, no person
    asked; one e-mail at the provider."""
    [call] = call_rows(conn, run_id)
    assert call["status"] == "succeeded", call
    assert call["result"]["message"] == message(call["idempotency_key"])
    kinds = [e["kind"] for e in events(conn, run_id)]
    assert "call_unknown" not in kinds and "run_paused" not in kinds, kinds
    assert run_row(conn, run_id)["pause_reason"] is None
    assert len(provider.client.effects(call["idempotency_key"])) == 1


def test_a_result_the_disk_refused_is_journaled_by_its_lease_once_space_returns(
    small_disk: Any,
    disk_workers: WorkerPool,
    provider: ProviderProcess,
    conn: psycopg.Connection[Any],
) -> None:
    disk_workers.start(1)
    key = _mail_run(conn, provider, "mail-1")
    small_disk.fill()
    provider.client.open_gate("g")  # the e-mail is sent; its result does not fit
    _completions_failed(disk_workers, 2)
    assert run_row(conn, "mail-1")["status"] == "running"
    small_disk.free()
    wait_status(conn, "mail-1", ("succeeded", "paused", "failed"), timeout=60)
    assert run_row(conn, "mail-1")["status"] == "succeeded"
    _sent_once(conn, provider, "mail-1")
    [call] = call_rows(conn, "mail-1")
    # by the lease that sent it: never taken over, nothing released
    assert call["completed_token"] == call["dispatched_token"] == 1
    assert run_row(conn, "mail-1")["claims"] == 1
    assert events(conn, "mail-1", "send_released") == []
    assert key == call["idempotency_key"]


def test_a_result_held_past_its_lease_is_handed_to_the_next_holder(
    small_disk: Any,
    disk_workers: WorkerPool,
    provider: ProviderProcess,
    conn: psycopg.Connection[Any],
) -> None:
    disk_workers.start(1)
    _mail_run(conn, provider, "mail-2")
    small_disk.fill()
    provider.client.open_gate("g")
    _completions_failed(disk_workers, 1)
    # the worker is held up past its lease (by the database's clock) with the result
    disk_workers.stop(0)
    try:
        wait_for(
            lambda: (
                conn.execute(
                    "SELECT lease_expires_at <= runledger.now() FROM runledger.runs"
                    " WHERE run_id = 'mail-2'"
                ).fetchone()
                == (True,)
            ),
            timeout=60,
            what="the lease to expire",
        )
    finally:
        disk_workers.cont(0)
    # it hands the result over; the disk refuses that too, and it is sent again
    wait_for(
        lambda: "release_call failed: disk full" in disk_workers.log(0),
        timeout=60,
        what="a release with the result refused by the full disk",
    )
    # and the run is taken over while the disk is still full (a claim's small rows fit
    # in pages the tables have): its next holder finds the e-mail in flight, unreleased
    wait_for(
        lambda: run_row(conn, "mail-2")["fencing_token"] == 2,
        timeout=60,
        what="the run taken over on the full disk",
    )
    small_disk.free()
    wait_status(conn, "mail-2", ("succeeded", "paused", "failed"), timeout=90)
    assert run_row(conn, "mail-2")["status"] == "succeeded", disk_workers.log(0)[-4000:]
    _sent_once(conn, provider, "mail-2")
    [call] = call_rows(conn, "mail-2")
    # journaled by the run's next holder, from the release that carried the result
    assert call["dispatched_token"] == 1 and call["completed_token"] > 1, call
    [released] = events(conn, "mail-2", "send_released")
    assert released["detail"]["ended"] == "returned"
    assert released["detail"]["result"]["message"] == message(call["idempotency_key"])
    assert released["detail"]["sender_token"] == 1
    assert disk_workers.alive(0)  # the worker lived through it
