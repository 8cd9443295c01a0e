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
    assert data["run"]["pause_reason"] == (
        "call cli-3:0:c0 is unknown: reconcile it with "
        "`runledger resolve cli-3:0:c0 applied|not_applied|abandoned`"
    )
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


# -- one env rule: RUNLEDGER_<OPTION>, through real invocations ----------------------------


def test_submit_reads_its_options_from_runledger_option(database_url: str, admin_conn: Any) -> None:
    result = CliRunner().invoke(
        cli.main,
        ["submit", "nobody@1"],
        env={
            "RUNLEDGER_DATABASE_URL": database_url,
            "RUNLEDGER_INPUT": '{"from": "env"}',
            "RUNLEDGER_RUN_ID": "env-1",
            "RUNLEDGER_PRIORITY": "7",
            "RUNLEDGER_JSON": "1",
        },
    )
    assert result.exit_code == 0, result.output
    assert json.loads(result.stdout) == {"run_id": "env-1", "created": True}
    row = admin_conn.execute(
        "SELECT run_id, input, priority FROM runledger.runs ORDER BY run_id"
    ).fetchall()
    assert row == [("env-1", {"from": "env"}, 7)]


def test_a_flag_beats_its_env_var(database_url: str, admin_conn: Any) -> None:
    result = CliRunner().invoke(
        cli.main,
        ["submit", "nobody@1", "--input", '{"from": "flag"}', "--run-id", "flag-1"],
        env={
            "RUNLEDGER_DATABASE_URL": database_url,
            "RUNLEDGER_INPUT": '{"from": "env"}',
            "RUNLEDGER_RUN_ID": "env-1",
        },
    )
    assert result.exit_code == 0, result.output
    assert admin_conn.execute("SELECT run_id, input FROM runledger.runs").fetchall() == [
        ("flag-1", {"from": "flag"})
    ]


def test_database_url_falls_back_to_database_url(database_url: str, admin_conn: Any) -> None:
    result = CliRunner().invoke(
        cli.main,
        ["submit", "nobody@1", "--run-id", "via-fallback"],
        env={"RUNLEDGER_DATABASE_URL": None, "DATABASE_URL": database_url},
    )
    assert result.exit_code == 0, result.output
    assert admin_conn.execute("SELECT run_id FROM runledger.runs").fetchall() == [("via-fallback",)]


def test_env_names_click_used_to_derive_change_nothing(
    invoke: Any, database_url: str, admin_conn: Any
) -> None:
    # click's auto_envvar_prefix read these from the parameter names (as_json, input_json)
    stale = {
        "RUNLEDGER_DATABASE_URL": database_url,
        "RUNLEDGER_AS_JSON": "1",
        "RUNLEDGER_INPUT_JSON": '{"stale": true}',
    }
    runner = CliRunner()
    submitted = runner.invoke(cli.main, ["submit", "nobody@1", "--run-id", "plain"], env=stale)
    assert submitted.exit_code == 0, submitted.output
    assert submitted.stdout == "plain submitted\n"
    assert admin_conn.execute("SELECT input FROM runledger.runs").fetchall() == [({},)]
    status = runner.invoke(cli.main, ["status", "plain"], env=stale)
    assert status.exit_code == 0, status.output
    assert "plain" in status.stdout and "queued" in status.stdout
    with pytest.raises(ValueError):
        json.loads(status.stdout)
    as_json = runner.invoke(cli.main, ["status", "plain"], env={**stale, "RUNLEDGER_JSON": "1"})
    assert json.loads(as_json.stdout)["run"]["status"] == "queued"


@pytest.mark.timeout(30)  # before the fix, a NaN deadline was never reached: a busy loop
@pytest.mark.parametrize(
    ("argv", "env", "named"),
    [
        (
            ["wait", "queued-run", "--timeout", "nan"],
            {},
            "'--timeout' (env var: RUNLEDGER_TIMEOUT)",
        ),
        (["wait", "queued-run"], {"RUNLEDGER_TIMEOUT": "inf"}, "RUNLEDGER_TIMEOUT"),
        (["submit", "nobody@1"], {"RUNLEDGER_PRIORITY": "high"}, "RUNLEDGER_PRIORITY"),
        (["submit", "nobody@1", "--priority", str(2**31)], {}, "'--priority'"),
        (["status", "queued-run"], {"RUNLEDGER_JSON": "maybe"}, "RUNLEDGER_JSON"),
    ],
    ids=["timeout-nan", "timeout-inf-env", "priority-env", "priority-int32", "json-env"],
)
def test_a_bad_value_is_exit_2_and_one_line(
    database_url: str,
    admin_conn: Any,
    monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture[str],
    argv: list[str],
    env: dict[str, str],
    named: str,
) -> None:
    admin_conn.execute("SELECT * FROM runledger.submit_run('queued-run', 'nobody', '1', '{}')")
    monkeypatch.setenv("RUNLEDGER_DATABASE_URL", database_url)
    for name, value in env.items():
        monkeypatch.setenv(name, value)
    monkeypatch.setattr(sys, "argv", ["runledger", *argv])
    with pytest.raises(SystemExit) as exit_:
        cli.run()
    assert exit_.value.code == 2
    out, err = capsys.readouterr()
    assert out == ""
    errors = [line for line in err.splitlines() if line.startswith("error:")]
    assert len(errors) == 1, err
    assert named in errors[0]
    assert "Traceback" not in err
    assert admin_conn.execute("SELECT run_id FROM runledger.runs").fetchall() == [("queued-run",)]


# -- one prefix for every error: `error: `, as git and the compilers print it ---------------

FAILING = [
    # (argv, environment over the test database's, exit code)
    (["status"], {}, 2),  # click: a missing argument
    (["nosuch"], {}, 2),  # click: no such command
    (["resolve", "k:0:c0", "sideways"], {}, 2),  # click: not a choice
    (["list", "--limit", "0"], {}, 2),
    (["submit", "nobody@1", "--input", "[1"], {}, 2),  # not JSON
    (["status", "r"], {"RUNLEDGER_DATABASE_URL": "", "DATABASE_URL": ""}, 2),  # no URL
    (["status", "r"], {"RUNLEDGER_DATABASE_URL": "notaurl"}, 2),  # ConfigurationError
    (["demo", "--stop", "/nonexistent"], {}, 2),
    (["status", "no-such-run"], {}, 1),  # RunNotFound
    (["wait", "queued-run", "--timeout", "0.1"], {}, 1),  # still queued: a check failed
    (["demo"], {"RUNLEDGER_TEST_POSTGRES": "url", "RUNLEDGER_TEST_DATABASE_URL": ""}, 1),
    (["list", "--connect-timeout", "2"], {"RUNLEDGER_DATABASE_URL": "CLOSED"}, 3),
]


@pytest.mark.parametrize(
    ("argv", "env", "code"), FAILING, ids=[" ".join(a)[:30] + str(e)[:20] for a, e, _ in FAILING]
)
def test_every_error_starts_with_lowercase_error(
    database_url: str,
    admin_conn: Any,
    monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture[str],
    argv: list[str],
    env: dict[str, str],
    code: int,
) -> None:
    """Click's usage errors said ``Error:``, runledger's own ``error:``: now one prefix,
    whatever the kind of error and its exit code. The demo's list of what it tried
    comes after its ``error:`` line."""
    import socket

    admin_conn.execute("SELECT * FROM runledger.submit_run('queued-run', 'nobody', '1', '{}')")
    monkeypatch.setenv("RUNLEDGER_DATABASE_URL", database_url)
    for name, value in env.items():
        if value == "CLOSED":
            with socket.socket() as sock:
                sock.bind(("127.0.0.1", 0))
                value = f"postgresql://u@127.0.0.1:{sock.getsockname()[1]}/db"
        if value:
            monkeypatch.setenv(name, value)
        else:
            monkeypatch.delenv(name, raising=False)
    monkeypatch.setattr(sys, "argv", ["runledger", *argv])
    with pytest.raises(SystemExit) as exit_:
        cli.run()
    out, err = capsys.readouterr()
    assert (exit_.value.code, out) == (code, ""), err
    lines = err.splitlines()
    assert lines[0].startswith("error: "), err
    assert len(lines) == 1 or argv == ["demo"], err
    assert not any(line.startswith("Error") for line in lines), err
    assert "Traceback" not in err, err


def test_runledger_alone_shows_its_help(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    """Not the help folded into one ``Error:`` line: the help, as click shows it (exit 2)."""
    monkeypatch.setattr(sys, "argv", ["runledger"])
    with pytest.raises(SystemExit) as exit_:
        cli.run()
    out, err = capsys.readouterr()
    assert (exit_.value.code, out) == (2, "")
    assert err.startswith("Usage: runledger [OPTIONS] COMMAND [ARGS]...\n"), err
    assert "\nCommands:\n" in err and "Exit codes" in err
    assert "error" not in err.lower().split("exit codes")[0], err


# A flow the worker command can import by name.
ENV_FLOW = Flow("env-flow", "1")


@ENV_FLOW.policy
def _env_decide(ctx: Any, history: list[Any]) -> list[ToolCall]:
    return []


async def test_the_worker_command_makes_its_worker_from_settings(
    database_url: str, db: Db, monkeypatch: pytest.MonkeyPatch
) -> None:
    import runledger.worker as worker_module
    from runledger.worker import Worker
    from tests.integration.conftest import RunningWorker

    made: list[Worker] = []
    loops: list[str] = []
    logging_args: list[tuple[str, bool]] = []

    def run_worker(w: Worker, event_loop: str) -> None:
        made.append(w)
        loops.append(event_loop)

    monkeypatch.setattr(worker_module, "run_worker", run_worker)
    monkeypatch.setattr(
        worker_module, "configure_logging", lambda level, js: logging_args.append((level, js))
    )
    result = CliRunner().invoke(
        cli.main,
        ["worker", "--concurrency", "2", "--tool-timeout", "12"],
        env={
            "RUNLEDGER_DATABASE_URL": database_url,
            "RUNLEDGER_FLOWS": "tests.integration.test_cli:ENV_FLOW",
            "RUNLEDGER_WORKER_ID": "env-worker",
            "RUNLEDGER_CONCURRENCY": "5",  # the flag wins
            "RUNLEDGER_LEASE_SECONDS": "7",
            "RUNLEDGER_POLL_SECONDS": "0.05",
            "RUNLEDGER_GRACE_SECONDS": "1.5",
            "RUNLEDGER_MAX_TURNS": "9",
            "RUNLEDGER_LOG_LEVEL": "warning",
            "RUNLEDGER_LOG_JSON": "true",
        },
    )
    assert result.exit_code == 0, result.output
    [w] = made
    assert loops == ["auto"]
    assert logging_args == [("WARNING", True)]
    assert list(w.flows) == ["env-flow@1"]
    assert (w.worker_id, w.concurrency, w.lease_seconds, w.poll_seconds, w.grace_seconds) == (
        "env-worker",
        2,
        7.0,
        0.05,
        1.5,
    )
    assert (w.limits.max_turns, w.limits.tool_timeout, w.limits.max_calls) == (9, 12.0, 200)

    # and that worker, run for real, holds its runs under those settings
    running = RunningWorker(w)
    try:
        await running.started()
        await db.submit("env-run", ENV_FLOW)
        await db.wait_status("env-run", "succeeded")
    finally:
        await running.stop()
    [claimed] = await db.events("env-run", "claimed")
    assert claimed["actor"] == "env-worker"
    lease = await db.rows(
        "SELECT (detail->>'lease_expires_at')::timestamptz - at AS lease "
        "FROM runledger.run_events WHERE run_id = %s AND kind = 'claimed'",
        "env-run",
    )
    assert lease[0]["lease"].total_seconds() == 7.0


# -- status prints keys, the pause reason and the resolve lines whole ------------------------


async def test_status_prints_long_keys_and_the_resolve_line_whole_at_80_columns(
    database_url: str, db: Db, start_worker: StartWorker
) -> None:
    rec = Recorder()
    flow = _modes_flow(rec)
    run_id = "r" + "-long" * 25 + "-x"  # 128 characters: the longest run id there is
    assert len(run_id) == 128
    key = f"{run_id}:0:c0"
    await db.submit(run_id, flow, {"mode": "pause"})
    await start_worker(flow)
    paused = await db.wait_status(run_id, "paused")
    result = CliRunner().invoke(
        cli.main,
        ["status", run_id],
        env={"RUNLEDGER_DATABASE_URL": database_url, "COLUMNS": "80"},
    )
    assert result.exit_code == 0, result.output
    lines = result.stdout.splitlines()
    assert "…" not in result.stdout and "..." not in result.stdout
    assert f"pause reason: {paused['pause_reason']}" in lines
    assert f"  runledger resolve {key} applied|not_applied|abandoned" in lines
    assert lines[0].startswith(f"{run_id} modes@1 paused ")
    # the key is whole on one line of the table, never folded over lines: the table is
    # wider than 80 columns then, the terminal wraps its lines and a copy is whole
    assert any(line.startswith(f"│ {key} │ poke ") for line in lines), result.stdout


def _piped(database_url: str, *args: str) -> list[str]:
    """``runledger ARGS | cat``: a real process, stdout a pipe, no COLUMNS."""
    import os
    import subprocess

    env = {k: v for k, v in os.environ.items() if k != "COLUMNS"}
    env["RUNLEDGER_DATABASE_URL"] = database_url
    done = subprocess.run(
        [sys.executable, "-m", "runledger", *args],
        env=env,
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert (done.returncode, done.stderr) == (0, ""), done.stderr
    return done.stdout.splitlines()


def _row(lines: list[str], first: str) -> list[str]:
    """The cells of the table line whose first cell is ``first`` (the whole row: a
    piped table has a line per row)."""
    [row] = [line for line in lines if line.startswith(f"│ {first} │")]
    return [cell.strip() for cell in row.split("│")[1:-1]]


async def test_whole_keys_when_piped_and_the_tools_error(
    database_url: str, db: Db, start_worker: StartWorker
) -> None:
    """Piped, rich would assume 80 columns: status folded the key over lines, show and
    unknown squeezed the other columns to nothing. Each row is one line now, its key
    whole to copy into ``runledger resolve``. The tool raised on every attempt: each
    command says what it raised (status showed ``null``, unknown ``(retries exhausted)``)."""
    flow = Flow("tickets", "1")

    @flow.tool(safety="idempotent", max_attempts=3)
    def create_ticket(ctx: Any) -> str:
        raise RuntimeError("ticket service exploded")

    @flow.policy
    def decide(ctx: Any, history: list[Any]) -> list[ToolCall]:
        return [] if history else [ToolCall("create_ticket", {})]

    run_id = "r" + "-long" * 25 + "-x"  # 128 characters: the longest run id there is
    key = f"{run_id}:0:c0"
    await db.submit(run_id, flow)
    await start_worker(flow, worker_id="w-err")
    await db.wait_status(run_id, "paused")
    error = "retries exhausted: RuntimeError: ticket service exploded"

    status = _piped(database_url, "status", run_id)
    assert _row(status, key) == [key, "create_ticket", "unknown", "3", "null", "null", error]
    show = _piped(database_url, "show", run_id)
    assert _row(show, key) == [key, "create_ticket", "unknown", "3", "w-err (1)", "", error]
    unknown = _piped(database_url, "unknown")
    header = next(line for line in unknown if line.startswith("┃ key "))
    assert [h.strip() for h in header.split("┃")[1:-1]] == [
        "key",
        "run status",  # it was "run", over the run's status
        "tool",
        "waits for",
        "attempts",
        "sent by (token)",
    ]
    assert _row(unknown, key) == [key, "paused", "create_ticket", "unknown", "3", "w-err (1)"]
    assert f"  {key} ({error})" in unknown
    assert f"    runledger resolve {key} applied|not_applied|abandoned" in unknown


async def test_status_prints_no_resolve_line_without_unknown_calls(
    invoke: Any, db: Db, start_worker: StartWorker
) -> None:
    rec = Recorder()
    flow = _modes_flow(rec)
    await db.submit("cli-ok", flow, {"mode": "ok"})
    await start_worker(flow)
    await db.wait_status("cli-ok", "succeeded")
    out = invoke("status", "cli-ok").stdout
    assert "runledger resolve" not in out and "pause reason" not in out


# -- hostile arguments against a real database: one line, exit 2, nothing written -----------


def _usage_cases() -> list[tuple[list[str], str]]:
    from tests.unit.test_cli_options import USAGE

    return [(argv, named) for argv, named in USAGE if argv[0] in ("submit", "resolve")]


@pytest.mark.parametrize(
    ("argv", "named"), _usage_cases(), ids=[" ".join(a)[:40] for a, _ in _usage_cases()]
)
def test_hostile_cli_arguments_write_nothing(
    database_url: str,
    admin_conn: Any,
    monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture[str],
    argv: list[str],
    named: str,
) -> None:
    from tests.integration.test_hostile_client import snapshot

    admin_conn.execute("SELECT * FROM runledger.submit_run('k', 'nobody', '1', '{}')")
    before = snapshot(admin_conn)
    monkeypatch.setenv("RUNLEDGER_DATABASE_URL", database_url)
    monkeypatch.setattr(sys, "argv", ["runledger", *argv])
    with pytest.raises(SystemExit) as exit_:
        cli.run()
    out, err = capsys.readouterr()
    assert (exit_.value.code, out) == (2, "")
    [line] = err.splitlines()
    assert named in line and "Traceback" not in err
    assert snapshot(admin_conn) == before


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["submit", "nobody@1", "--run-id", "bad id!"], "InvalidInput"),
        (["submit", "nobody@1", "--run-id", "r" * 129], "InvalidInput"),
        (["submit", "nobody@1", "--run-id", "a\x01b"], "InvalidInput"),
        (["resolve", "nope:0:c0", "applied"], "RunNotFound"),
        (["cancel", "no-such-run"], "RunNotFound"),
        (["retry", "no-such-run"], "RunNotFound"),
        (["status", "no-such-run"], "RunNotFound"),
        (["resolve", "k:0:c0", "applied", "--note", "x\x00y"], "NUL"),
    ],
)
def test_refusals_are_one_line_exit_1_and_write_nothing(
    database_url: str,
    admin_conn: Any,
    monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture[str],
    argv: list[str],
    message: str,
) -> None:
    from tests.integration.test_hostile_client import snapshot

    argv = [a.encode().decode("unicode_escape") for a in argv]
    admin_conn.execute("SELECT * FROM runledger.submit_run('k', 'nobody', '1', '{}')")
    before = snapshot(admin_conn)
    monkeypatch.setenv("RUNLEDGER_DATABASE_URL", database_url)
    monkeypatch.setattr(sys, "argv", ["runledger", *argv])
    with pytest.raises(SystemExit) as exit_:
        cli.run()
    out, err = capsys.readouterr()
    assert (exit_.value.code, out) == (1, ""), err
    [line] = err.splitlines()
    assert line.startswith("error: ") and message in line, line
    assert snapshot(admin_conn) == before


def test_a_write_in_a_read_only_session_is_one_line_naming_the_session(
    database_url: str,
    admin_conn: Any,
    monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture[str],
) -> None:
    """SQLSTATE 25006 on a primary: the session is read-only (a role or URL with
    default_transaction_read_only), not a standby, and the line says which
    (tests/process/test_replica.py has the standby)."""
    from tests.integration.test_hostile_client import snapshot

    admin_conn.execute("SELECT * FROM runledger.submit_run('ro-1', 'nobody', '1', '{}')")
    before = snapshot(admin_conn)
    sep = "&" if "?" in database_url else "?"
    read_only = f"{database_url}{sep}options=-cdefault_transaction_read_only%3Don"
    monkeypatch.setenv("RUNLEDGER_DATABASE_URL", read_only)
    monkeypatch.setattr(sys, "argv", ["runledger", "cancel", "ro-1"])
    with pytest.raises(SystemExit) as exit_:
        cli.run()
    out, err = capsys.readouterr()
    assert (exit_.value.code, out) == (1, ""), err
    [line] = err.splitlines()
    assert line.startswith("error: ReadOnly: runledger.cancel_run refused: cannot execute "), line
    assert line.endswith(
        "in a read-only transaction; the session on "
        f"{admin_conn.info.host}:{admin_conn.info.port} is read-only "
        "(default_transaction_read_only): writes need a read-write session"
    ), line
    assert snapshot(admin_conn) == before
