"""Poison runs with real worker processes: one claim batch with undecodable runs in it
finishes its good runs; a run that kills the worker while its journal loads ends as
``crash_loop`` instead of being claimed forever.

The poison rows are written as an old release (before the database's nesting limit)
could have left them: see ``tests/integration/test_poison_runs.py``.
"""

from __future__ import annotations

from typing import Any

import pytest

from tests.integration.test_poison_runs import DEEP, TOO_DEEP, plant_run
from tests.process.conftest import LEASE, events, run_row, submit, wait_status

pytestmark = pytest.mark.process

TICKET = [[{"tool": "ticket", "args": {"title": "fine"}}]]
MAX_STALLED = 2


def test_a_claim_batch_with_poison_runs_finishes_its_good_runs(
    workers: Any,
    provider: Any,
    admin_conn: Any,
    database_url: str,
    lease_args: list[str],
) -> None:
    plant_run(database_url, "poison-input", "scripted", input=DEEP)
    plant_run(database_url, "poison-state", "scripted", input='{"plan": []}', state=DEEP)
    submit(admin_conn, "good-1", TICKET)
    submit(admin_conn, "good-2", TICKET)
    runs = ("poison-input", "poison-state", "good-1", "good-2")

    (w0,) = workers.start(1, args=[*lease_args, "--concurrency", "4"])
    final = {r: wait_status(admin_conn, r, ("succeeded", "failed", "paused")) for r in runs}

    assert [final[r]["status"] for r in runs] == ["failed", "failed", "succeeded", "succeeded"]
    assert len(provider.client.effects("good-1:0:c0")) == 1
    assert len(provider.client.effects("good-2:0:c0")) == 1
    # one claim batch, one claim each
    claimed = [events(admin_conn, r, "claimed") for r in runs]
    assert [len(c) for c in claimed] == [1, 1, 1, 1]
    assert len({c[0]["detail"]["lease_expires_at"] for c in claimed}) == 1
    for run_id, what in (("poison-input", "input"), ("poison-state", "state")):
        error = admin_conn.execute(
            "SELECT error FROM runledger.runs WHERE run_id = %s", (run_id,)
        ).fetchone()[0]
        found = error.pop("found")
        assert error == {"reason": "undecodable_run", "what": what}
        assert [(f["at"], f["error"]) for f in found] == [(what, TOO_DEEP)]
        [failed] = events(admin_conn, run_id, "run_failed")
        assert failed["actor"] == "w0" and failed["detail"] == {"reason": "undecodable_run"}
    assert "undecodable" in workers.log(w0)
    assert "Traceback" not in workers.log(w0)
    assert workers.alive(w0)


def test_a_run_that_kills_the_worker_while_loading_ends_as_crash_loop(
    workers: Any, provider: Any, admin_conn: Any, db_clock: Any, lease_args: list[str]
) -> None:
    submit(admin_conn, "crashy", TICKET)
    args = [*lease_args, "--max-stalled-claims", str(MAX_STALLED)]
    (w0,) = workers.start(1, env={"RUNLEDGER_CRASH_AT": "load_journal:crashy"}, args=args)

    # every claim kills the worker while it loads the journal; each restart takes over
    for claim in range(1, MAX_STALLED + 1):
        assert workers.wait(w0, timeout=30) == -9, workers.log(w0)
        row = run_row(admin_conn, "crashy")
        assert (row["status"], row["claims"]) == ("running", claim)
        db_clock.advance(LEASE + 1)  # the dead worker's lease is over by the database clock
        workers.restart(w0)

    # claim MAX_STALLED + 1 gives up before loading anything: the worker lives on
    done = wait_status(admin_conn, "crashy", ("succeeded", "failed", "paused"))
    assert done["status"] == "failed" and done["claims"] == MAX_STALLED + 1
    error = admin_conn.execute("SELECT error FROM runledger.runs WHERE run_id = 'crashy'")
    assert error.fetchone()[0] == {
        "reason": "crash_loop",
        "claims_without_progress": MAX_STALLED + 1,
    }
    assert len(events(admin_conn, "crashy", "takeover")) == MAX_STALLED
    assert provider.client.effects("crashy:0:c0") == []
    assert workers.alive(w0)
    # and the same worker goes on with other runs
    submit(admin_conn, "after-crashy", TICKET)
    assert wait_status(admin_conn, "after-crashy", ("succeeded",))["status"] == "succeeded"
