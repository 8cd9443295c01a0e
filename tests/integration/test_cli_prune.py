"""`runledger prune`: finished runs older than a duration, by the database clock, deleted
in batches; queued, running and paused runs are left; events kept unless --events."""

from __future__ import annotations

import json
from typing import Any

import psycopg
import pytest
from click.testing import CliRunner, Result
from psycopg.rows import dict_row

from runledger import cli


@pytest.fixture
def invoke(database_url: str) -> Any:
    runner = CliRunner()

    def run(*args: str) -> Result:
        return runner.invoke(cli.main, list(args), env={"RUNLEDGER_DATABASE_URL": database_url})

    return run


def _world(url: str) -> psycopg.Connection[Any]:
    """7 runs: 5 finished long ago (succeeded x3, failed, cancelled), 1 paused and 1
    running as old, 1 succeeded just now; each with events."""
    conn = psycopg.connect(url, autocommit=True, row_factory=dict_row)
    ex = conn.execute

    def claimed(run_id: str, flow: str = "prune") -> dict[str, Any]:
        ex("SELECT runledger.submit_run(%s, %s, '1', '{}'::jsonb)", (run_id, flow))
        row = ex(
            "SELECT * FROM runledger.claim_runs_v4('w', ARRAY[%s || '@1'], '1 hour', 1)", (flow,)
        ).fetchone()
        assert row is not None and row["run_id"] == run_id
        return row

    def finished(run_id: str, status: str, flow: str = "prune") -> None:
        c = claimed(run_id, flow)
        ex(
            "SELECT runledger.finish_run(%s, %s, %s, %s, NULL, 'done')",
            (run_id, c["lease_id"], c["fencing_token"], status),
        )

    for i, status in enumerate(["succeeded", "succeeded", "failed", "succeeded"]):
        finished(f"old-{i}", status)
    ex("SELECT runledger.submit_run('old-cancelled', 'prune', '1', '{}'::jsonb)")
    ex("SELECT runledger.cancel_run('old-cancelled', 'carol', 'no longer needed')")
    finished("old-paused", "paused")
    claimed("old-running")
    ex("UPDATE runledger.settings SET clock_offset = interval '40 days'")
    finished("new-done", "succeeded", "prune-new")  # old-running's lease has expired
    return conn


def _runs(conn: psycopg.Connection[Any]) -> list[str]:
    return [r["run_id"] for r in conn.execute("SELECT run_id FROM runledger.runs ORDER BY 1")]


def test_dry_run_counts_and_deletes_nothing(invoke: Any, database_url: str) -> None:
    with _world(database_url) as conn:
        before = _runs(conn)
        result = invoke("prune", "--older-than", "30d", "--dry-run", "--json")
        assert result.exit_code == 0, result.output
        out = json.loads(result.output)
        assert (out["dry_run"], out["runs"]) == (True, 5)
        assert _runs(conn) == before
        text = invoke("prune", "--older-than", "30d", "--dry-run")
        assert text.output.startswith("5 finished run(s) finished before ")


def test_prune_deletes_old_finished_runs_in_batches_and_keeps_events(
    invoke: Any, database_url: str
) -> None:
    with _world(database_url) as conn:
        result = invoke("prune", "--older-than", "30d", "--batch", "2", "--json")
        assert result.exit_code == 0, result.output
        out = json.loads(result.output[result.output.index("{") :])
        assert (out["runs"], out["batches"], out["events_deleted"]) == (5, 3, False)
        # queued/running/paused never; a run finished within 30 days stays
        assert _runs(conn) == ["new-done", "old-paused", "old-running"]
        kept = conn.execute(
            "SELECT count(*) AS n FROM runledger.run_events WHERE run_id = 'old-0'"
        ).fetchone()
        assert kept is not None and kept["n"] > 0
        again = invoke("prune", "--older-than", "30d")
        assert again.exit_code == 0 and again.output.startswith("pruned 0 run(s)"), again.output


def test_prune_with_events_deletes_them_too(invoke: Any, database_url: str) -> None:
    with _world(database_url) as conn:
        result = invoke("prune", "--older-than", "30d", "--events")
        assert result.exit_code == 0, result.output
        assert "their events deleted with them" in result.output
        gone = conn.execute(
            "SELECT count(*) AS n FROM runledger.run_events WHERE run_id LIKE 'old-_'"
        ).fetchone()
        assert gone is not None and gone["n"] == 0
        left = conn.execute(
            "SELECT count(*) AS n FROM runledger.run_events WHERE run_id = 'old-paused'"
        ).fetchone()
        assert left is not None and left["n"] > 0


@pytest.mark.parametrize(
    "args",
    [
        ["--older-than", "30x"],
        ["--older-than", "-3d"],
        ["--older-than", "0d"],
        ["--older-than", "30d", "--batch", "0"],
        ["--older-than", "30d", "--batch", "10001"],
        [],
    ],
)
def test_bad_input_is_one_usage_line_and_deletes_nothing(
    args: list[str], invoke: Any, database_url: str
) -> None:
    with _world(database_url) as conn:
        before = _runs(conn)
        result = invoke("prune", *args)
        assert result.exit_code == 2, result.output
        assert "Traceback" not in result.output
        assert _runs(conn) == before
