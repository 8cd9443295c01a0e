"""Every command that acts takes --actor (or RUNLEDGER_ACTOR), and the actor is the one
recorded in run_events: resolve, cancel and retry as approve and deny already did."""

from __future__ import annotations

from typing import Any

import psycopg
from click.testing import CliRunner
from psycopg.rows import dict_row

from runledger.cli import main
from tests.contract.helpers import complete, dispatched_call, finish, submit_and_claim


def _runs(url: str) -> str:
    """act-1 and act-2 paused on an unknown call, act-3 failed; the key of act-1's call."""
    with psycopg.connect(url, autocommit=True, row_factory=dict_row) as w:
        w.execute("SET ROLE runledger_worker")
        keys = []
        for run_id in ("act-1", "act-2"):
            lease = submit_and_claim(w, run_id, "w1")
            keys.append(dispatched_call(w, lease))
            complete(w, lease, keys[-1], "unknown", None, None)
            finish(w, lease, "paused", None, reason="a call is unknown")
        lease = submit_and_claim(w, "act-3", "w1")
        key = dispatched_call(w, lease)
        complete(w, lease, key, "failed", None, None)
        finish(w, lease, "failed", None, reason="the call failed")
    return keys[0]


def _actors(conn: psycopg.Connection[Any], run_id: str, kind: str) -> list[str]:
    return [
        r[0]
        for r in conn.execute(
            "SELECT actor FROM runledger.run_events WHERE run_id = %s AND kind = %s"
            " ORDER BY event_id",
            (run_id, kind),
        )
    ]


def test_resolve_cancel_and_retry_record_the_actor(
    database_url: str, admin_conn: psycopg.Connection[Any]
) -> None:
    runner = CliRunner()
    key = _runs(database_url)
    out = runner.invoke(
        main,
        ["resolve", key, "applied", "--actor", "alice", "--database-url", database_url],
    )
    assert out.exit_code == 0, out.output
    assert _actors(admin_conn, "act-1", "call_resolved") == ["alice"]
    out = runner.invoke(
        main,
        ["cancel", "act-2", "--database-url", database_url],
        env={"RUNLEDGER_ACTOR": "bob"},
    )
    assert out.exit_code == 0, out.output
    assert _actors(admin_conn, "act-2", "run_cancelled") == ["bob"]
    out = runner.invoke(
        main, ["retry", "act-3", "--actor", "carol", "--database-url", database_url]
    )
    assert out.exit_code == 0, out.output
    assert _actors(admin_conn, "act-3", "run_requeued") == ["carol"]


def test_an_empty_actor_is_refused_in_one_line(database_url: str) -> None:
    out = CliRunner().invoke(
        main, ["cancel", "nope", "--actor", "", "--database-url", database_url]
    )
    assert out.exit_code == 2
    assert "must not be empty" in out.output and "Traceback" not in out.output
