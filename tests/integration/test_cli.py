"""The ``runledger`` command against a real database, runs driven by an in-process Worker.

``CliRunner`` invokes ``runledger.cli.main`` (click's standalone mode: usage errors exit
2, other exceptions land in ``result.exception``); ``runledger.cli.run`` -- the console
entry point, which turns a RunLedgerError into exit 1 and one line on stderr -- is
called directly with ``sys.argv`` set.
"""

from __future__ import annotations

import json
import sys
from typing import Any

import pytest
from click.testing import CliRunner, Result

from runledger import cli
from runledger.errors import InvalidInput
from runledger.flows import Flow, ToolCall
from tests.integration.conftest import Db, Recorder, StartWorker


@pytest.fixture
def invoke(database_url: str) -> Any:
    runner = CliRunner()

    def run(*args: str) -> Result:
        return runner.invoke(
            cli.main, list(args), env={"RUNLEDGER_DATABASE_URL": database_url, "USER": "carol"}
        )

    return run


def _modes_flow(rec: Recorder) -> Flow:
    """input["mode"]: ok -> succeeds; fail -> invalid decision; pause -> unknown call."""
    flow = Flow("modes", "1")

    @flow.tool(safety="unsafe")
    def poke(ctx: Any) -> str:
        rec.tool(ctx)
        if len(rec.calls_of("poke")) == 1:
            raise ConnectionResetError("no answer")
        return "poked"

    @flow.policy
    def decide(ctx: Any, history: list[Any]) -> list[ToolCall]:
        rec.policy(ctx, history)
        mode = ctx.input["mode"]
        if history:
            return []
        if mode == "fail":
            return [ToolCall("missing_tool", {})]
        if mode == "pause":
            return [ToolCall("poke", {})]
        return []

    return flow


def test_submit_of_a_flow_no_worker_registered_warns_but_submits(
    invoke: Any, admin_conn: Any
) -> None:
    result = invoke("submit", "nobody@3", "--input", '{"a": 1}', "--run-id", "cli-1")
    assert result.exit_code == 0, result.output
    assert "warning: no worker has registered nobody@3 yet" in result.stderr
    assert result.stdout == "cli-1 submitted\n"
    row = admin_conn.execute(
        "SELECT flow, flow_version, status, input FROM runledger.runs WHERE run_id = 'cli-1'"
    ).fetchone()
    assert row == ("nobody", "3", "queued", {"a": 1})

    again = invoke("submit", "nobody@3", "--input", '{"a": 1}', "--run-id", "cli-1")
    assert again.exit_code == 0
    assert again.stdout == "cli-1 already exists (no-op)\n"


async def test_submit_json_and_status_json(invoke: Any, db: Db, start_worker: StartWorker) -> None:
    rec = Recorder()
    flow = _modes_flow(rec)
    await start_worker(flow, worker_id="cli-worker")

    result = invoke("submit", "modes@1", "--input", '{"mode": "ok"}', "--run-id", "cli-2", "--json")
    assert result.exit_code == 0, result.output
    assert result.stderr == ""  # a worker registered modes@1: no warning
    assert json.loads(result.stdout) == {"run_id": "cli-2", "created": True}
    again = invoke("submit", "modes@1", "--input", '{"mode": "ok"}', "--run-id", "cli-2", "--json")
    assert json.loads(again.stdout) == {"run_id": "cli-2", "created": False}
    conflict = invoke("submit", "modes@1", "--input", '{"mode": "fail"}', "--run-id", "cli-2")
    assert conflict.exit_code == 1
    assert type(conflict.exception).__name__ == "RunConflict"

    await db.wait_status("cli-2", "succeeded")
    status = invoke("status", "cli-2", "--json")
    assert status.exit_code == 0, status.output
    data = json.loads(status.stdout)
    assert data["run"]["run_id"] == "cli-2"
    assert data["run"]["status"] == "succeeded"
    assert data["run"]["result"] == {"turns": 1, "calls": 0}
    assert data["run"]["fencing_token"] == 1
    assert data["calls"] == []

    await db.submit("cli-3", flow, {"mode": "pause"})
    await db.wait_status("cli-3", "paused")
    data = json.loads(invoke("status", "cli-3", "--json").stdout)
    assert data["run"]["status"] == "paused"
    assert data["run"]["pause_reason"] == "call cli-3:0:c0 is unknown: reconcile it"
    assert [(c["idempotency_key"], c["status"], c["attempts"]) for c in data["calls"]] == [
        ("cli-3:0:c0", "unknown", 1)
    ]

    human = invoke("status", "cli-3")
    assert human.exit_code == 0
    assert "cli-3" in human.stdout and "paused" in human.stdout


async def test_wait_exit_codes(invoke: Any, db: Db, start_worker: StartWorker) -> None:
    rec = Recorder()
    flow = _modes_flow(rec)
    for mode in ("ok", "fail", "pause"):
        await db.submit(f"w-{mode}", flow, {"mode": mode})
    await start_worker(flow)
    for mode, status in (("ok", "succeeded"), ("fail", "failed"), ("pause", "paused")):
        assert (await db.wait_status(f"w-{mode}", "succeeded", "failed", "paused"))[
            "status"
        ] == status

    ok = invoke("wait", "w-ok", "--timeout", "5")
    assert (ok.exit_code, ok.stdout) == (0, "w-ok succeeded\n")
    failed = invoke("wait", "w-fail", "--timeout", "5")
    assert (failed.exit_code, failed.stdout) == (1, "w-fail failed\n")
    paused = invoke("wait", "w-pause", "--timeout", "5", "--json")
    assert paused.exit_code == 1
    assert json.loads(paused.stdout)["status"] == "paused"

    await db.submit("w-nobody", Flow("nobody", "1"))
    timed_out = invoke("wait", "w-nobody", "--timeout", "0.2")
    assert timed_out.exit_code == 1
    assert "still queued" in timed_out.stderr


async def test_resolve_from_the_command_line(
    invoke: Any, db: Db, start_worker: StartWorker
) -> None:
    rec = Recorder()
    flow = _modes_flow(rec)
    await db.submit("cli-r", flow, {"mode": "pause"})
    await start_worker(flow)
    await db.wait_status("cli-r", "paused")

    bad = invoke("resolve", "cli-r:0:c0", "applied", "--receipt", "{not json")
    assert bad.exit_code == 2
    assert "--receipt is not JSON" in bad.output
    wrong = invoke("resolve", "cli-r:0:c0", "maybe")
    assert wrong.exit_code == 2

    result = invoke(
        "resolve",
        "cli-r:0:c0",
        "applied",
        "--receipt",
        '{"ack": "A1"}',
        "--note",
        "seen on the device",
    )
    assert result.exit_code == 0, result.output
    assert result.stdout == "cli-r:0:c0 resolved as applied\n"
    run = await db.wait_status("cli-r", "succeeded", "failed")
    assert run["status"] == "succeeded"
    [call] = await db.calls("cli-r")
    assert (call["status"], call["receipt"], call["resolved_by"], call["resolution_note"]) == (
        "succeeded",
        {"ack": "A1"},
        "cli:carol",
        "seen on the device",
    )
    assert len(rec.calls_of("poke")) == 1

    again = invoke("resolve", "cli-r:0:c0", "abandoned")
    assert again.exit_code == 1
    assert type(again.exception).__name__ == "InvalidTransition"


async def test_cancel_and_retry_from_the_command_line(
    invoke: Any, db: Db, start_worker: StartWorker
) -> None:
    rec = Recorder()
    flow = _modes_flow(rec)
    await db.submit("cli-c", Flow("nobody", "1"))
    result = invoke("cancel", "cli-c", "--reason", "not needed")
    assert (result.exit_code, result.stdout) == (0, "cli-c cancelled\n")
    run = await db.run("cli-c")
    assert (run["status"], run["error"]) == (
        "cancelled",
        {"reason": "cancelled", "note": "not needed"},
    )

    await db.submit("cli-f", flow, {"mode": "fail"})
    await start_worker(flow)
    await db.wait_status("cli-f", "failed")
    result = invoke("retry", "cli-f")
    assert (result.exit_code, result.stdout) == (0, "cli-f queued\n")
    [requeued] = await db.events("cli-f", "run_requeued")
    assert requeued["actor"] == "cli:carol"
    run = await db.wait_status("cli-f", "failed", timeout=15)
    assert run["claims"] == 2  # claimed again (and fails again: the decision is still bad)


def test_bad_input_json_is_a_usage_error(invoke: Any, admin_conn: Any) -> None:
    result = invoke("submit", "nobody@1", "--input", "{oops")
    assert result.exit_code == 2
    assert "--input is not JSON" in result.output
    assert admin_conn.execute("SELECT count(*) FROM runledger.runs").fetchone() == (0,)
    missing = invoke("submit")
    assert missing.exit_code == 2


def test_bad_run_id_is_refused_with_invalid_input(invoke: Any, admin_conn: Any) -> None:
    # Through main() in click's standalone mode the RunLedgerError is left to the caller.
    result = invoke("submit", "nobody@1", "--run-id", "bad id!")
    assert result.exit_code == 1
    assert isinstance(result.exception, InvalidInput)
    assert admin_conn.execute("SELECT count(*) FROM runledger.runs").fetchone() == (0,)


@pytest.mark.parametrize(
    "argv",
    [["submit", "nobody@1", "--run-id", "bad id!"], ["cancel", "bad id!"]],
    ids=["submit", "cancel"],
)
def test_entry_point_maps_runledger_errors_to_exit_1(
    database_url: str,
    monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture[str],
    argv: list[str],
) -> None:
    monkeypatch.setenv("RUNLEDGER_DATABASE_URL", database_url)
    monkeypatch.setattr(sys, "argv", ["runledger", *argv])
    with pytest.raises(SystemExit) as exit_:
        cli.run()
    assert exit_.value.code == 1
    err = capsys.readouterr().err
    assert "error: InvalidInput:" in err
    assert "bad id!" in err


def test_entry_point_maps_usage_errors_to_exit_2(
    database_url: str,
    monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture[str],
) -> None:
    monkeypatch.setenv("RUNLEDGER_DATABASE_URL", database_url)
    monkeypatch.setattr(sys, "argv", ["runledger", "submit", "nobody@1", "--input", "[1,"])
    with pytest.raises(SystemExit) as exit_:
        cli.run()
    assert exit_.value.code == 2
    assert "--input is not JSON" in capsys.readouterr().err
