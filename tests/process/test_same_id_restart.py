"""A worker killed with a call in flight and started again under its own ``--worker-id``
(the guide's ``runledger worker --worker-id w1``, run again): its new process takes the
run over at once (the old one's session ended), and its old process is proved gone by
the process that claimed the run under the sender's token (the claim's event records
it), not by the worker id's registration, which the restart replaced. The call is
released then and there, as for a sender that came back under another id, instead of
waiting out the old lease."""

from __future__ import annotations

import datetime as dt
from typing import Any

import pytest

from runledger.testing import wait_for
from tests.process.conftest import call_rows, submit, wait_status

pytestmark = pytest.mark.process

LEASE = 60  # s: a wait for the old lease would show as a gap of most of it


def _timeline(conn: Any, run_id: str) -> list[dict[str, Any]]:
    cur = conn.execute(
        "SELECT kind, actor, at, detail FROM runledger.run_events"
        " WHERE run_id = %s ORDER BY event_id",
        (run_id,),
    )
    names = [d.name for d in cur.description or []]
    return [dict(zip(names, r, strict=True)) for r in cur.fetchall()]


def test_a_worker_restarted_under_its_own_id_releases_its_earlier_calls_at_once(
    workers: Any, provider: Any, admin_conn: Any
) -> None:
    # the worker kills itself once the lookup tool's call is dispatched (committed)
    args = ["--lease-seconds", str(LEASE), "--poll-seconds", "0.2"]
    (w0,) = workers.start(1, args=args, env={"RUNLEDGER_CRASH_AT": "after_dispatch:charge"})
    submit(admin_conn, "again", [[{"tool": "charge", "args": {"amount": 4}}]])
    assert workers.wait(w0, timeout=60) == -9, workers.log(w0)
    [sent] = call_rows(admin_conn, "again")
    assert sent["status"] == "dispatched"
    first = admin_conn.execute(
        "SELECT process FROM runledger.workers WHERE worker_id = 'w0'"
    ).fetchone()[0]
    assert first is not None  # the killed process, as this host names it

    workers.restart(w0, env={})  # the same command again: the same id, no crash point
    wait_status(admin_conn, "again", ("succeeded",), timeout=2 * LEASE)
    assert workers.alive(w0), workers.log(w0)
    again = admin_conn.execute(
        "SELECT process FROM runledger.workers WHERE worker_id = 'w0'"
    ).fetchone()[0]
    assert again not in (None, first)  # the registration is the new process's

    timeline = _timeline(admin_conn, "again")
    kinds = [e["kind"] for e in timeline]
    i = kinds.index("takeover")
    takeover, after = timeline[i], timeline[i + 1]
    assert takeover["actor"] == "w0" and takeover["detail"]["previous_owner"] == "w0"
    assert takeover["detail"]["holder"] == "session_ended"
    # the first thing the new process does with the run: release the old process's call
    assert after["kind"] == "send_released", kinds
    assert after["detail"]["ended"] == "process_gone"
    assert after["detail"]["process"] == first
    assert after["detail"]["by"] == "holder" and after["detail"]["sender"] == "w0"
    # at once, by the database's clock: not when the old lease ran out (60 s after the
    # claim); the bound is generous for a busy machine and still far below the lease
    until = dt.datetime.fromisoformat(takeover["detail"]["previous_lease_expires_at"])
    assert after["at"] - takeover["at"] < dt.timedelta(seconds=10), (takeover, after)
    assert after["at"] < until - dt.timedelta(seconds=LEASE / 2)
    print(f"takeover to send_released: {(after['at'] - takeover['at']).total_seconds():.3f} s")
    # recovered as a lookup call: not found (the worker died before sending), sent once
    [call] = call_rows(admin_conn, "again")
    assert call["status"] == "succeeded" and call["attempts"] == 2
    assert len(provider.client.effects("again:0:c0")) == 1
    wait_for(lambda: "Traceback" not in workers.log(w0), what="a clean log")
