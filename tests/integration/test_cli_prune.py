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


def _count(conn: psycopg.Connection[Any], table: str) -> int:
    row = conn.execute(f"SELECT count(*) AS n FROM runledger.{table}").fetchone()  # type: ignore[arg-type]
    assert row is not None
    return int(row["n"])


def test_prune_bounds_the_chain_records_of_hundreds_of_checkpoints_and_audit_passes(
    invoke: Any, database_url: str
) -> None:
    """200 runs an hour apart, each checkpointed, and a paused run from the start. A prune
    keeping events leaves the checkpoints of the last two days and one that carries the
    heads still pinning a chain; a later prune with --events deletes the chains kept,
    and the chains verify throughout."""
    with psycopg.connect(database_url, autocommit=True, row_factory=dict_row) as conn:
        ex = conn.execute

        def ended(run_id: str, status: str) -> None:
            ex("SELECT runledger.submit_run(%s, 'prune', '1', '{}'::jsonb)", (run_id,))
            c = ex(
                "SELECT * FROM runledger.claim_runs_v4('w', ARRAY['prune@1'], '1 hour', 1)"
            ).fetchone()
            assert c is not None and c["run_id"] == run_id
            ex(
                "SELECT runledger.finish_run(%s, %s, %s, %s, NULL, 'done')",
                (run_id, c["lease_id"], c["fencing_token"], status),
            )

        def hours(n: int) -> None:
            ex(
                "UPDATE runledger.settings SET clock_offset = clock_offset + %s * interval '1h'",
                (n,),
            )

        def checkpoint() -> None:
            ex("SELECT * FROM runledger.checkpoint_events('test', interval '0')")

        ex("SELECT runledger.register_worker_v2('w-old', 'h', 1, ARRAY['prune@1'], false)")
        ex("SELECT runledger.heartbeat_worker('w-old', true)")
        ended("paused", "paused")
        for i in range(200):
            hours(1)
            ended(f"r-{i}", "succeeded")
            checkpoint()
        assert (_count(conn, "event_checkpoints"), _count(conn, "event_checkpoint_heads")) == (
            201,
            201,
        )

        result = invoke("prune", "--older-than", "2d", "--batch", "40", "--json")
        assert result.exit_code == 0, result.output
        out = json.loads(result.output[result.output.index("{") :])
        assert out["runs"] == 152  # r-0..r-151 finished more than 48 hours ago
        # checkpoint 0, the last two days', and one per batch carrying the heads of the
        # chains kept
        assert _count(conn, "event_checkpoints") == 1 + 48 + 4
        assert _count(conn, "event_checkpoint_heads") == 48 + 152 + 1
        assert _count(conn, "workers") == 0
        records = out["records"]
        assert records["checkpoints"] == 152  # 1..152: made before the cutoff
        assert records["carried"] == 153  # r-0..r-151 (events kept) and the paused run
        assert (records["chains"], records["workers"]) == (0, 1)
        assert out["record_batches"] == 4  # 40 heads a batch
        audited = invoke("audit")
        assert audited.exit_code == 0, audited.output

        hours(72)
        ended("r-late", "succeeded")
        checkpoint()
        again = invoke("prune", "--older-than", "2d", "--events")
        assert again.exit_code == 0, again.output
        lines = again.output.splitlines()
        assert lines[0].startswith("pruned 48 run(s)")  # r-152..r-199
        assert lines[1].startswith("pruned 52 checkpoint(s) of the event chains made before ")
        assert "(1 still pinning a chain, carried into a new checkpoint)" in lines[1]
        assert "the events of 152 run(s) pruned earlier" in lines[1]
        # checkpoint 0, r-late's, and the one carrying the paused run's head
        assert _count(conn, "event_checkpoints") == 3
        assert _count(conn, "event_checkpoint_heads") == 2
        left = conn.execute("SELECT DISTINCT run_id FROM runledger.run_events ORDER BY 1")
        assert [r["run_id"] for r in left] == ["paused", "r-late"]
        assert _count(conn, "event_chain_prunes") == 200  # made now: kept for two days
        audited = invoke("audit")
        assert audited.exit_code == 0, audited.output
