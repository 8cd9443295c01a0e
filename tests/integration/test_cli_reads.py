"""The operator's read commands (``list``, ``show``, ``workers``, ``unknown``, ``events``)
against a real database holding a run in every state an on-call engineer meets:

- ``r-ok`` succeeded, ``r-unknown`` paused on an unknown call, ``r-approve`` paused on a
  call awaiting approval: driven by an in-process worker (``ops-worker``), then stopped;
- ``r-queued``: a flow no worker runs;
- ``r-dead``: running, claimed by ``w-dead``, whose heartbeat and lease the database
  clock then leaves behind (the clock is moved, nothing sleeps): "lease expired, no live
  worker";
- ``r-live``: running, claimed by ``w-live`` after the move: a live lease, a live holder.

``--json`` is parsed and asserted; the terminal output's key lines too; bad input is a
one-line usage error (exit 2) and an unknown run one line and exit 1 (``cli.run``).
"""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import time
from dataclasses import dataclass
from typing import Any

import psycopg
import pytest
from click.testing import CliRunner, Result

from runledger import cli
from runledger.flows import Flow, ToolCall
from runledger.testing import DbClock
from tests.integration.conftest import Db, StartWorker

pytestmark = pytest.mark.timeout(90)


@dataclass
class World:
    url: str
    runner: CliRunner

    def invoke(self, *args: str) -> Result:
        return self.runner.invoke(
            cli.main,
            list(args),
            env={"RUNLEDGER_DATABASE_URL": self.url, "USER": "carol", "COLUMNS": "200"},
        )

    def json(self, *args: str) -> Any:
        result = self.invoke(*args, "--json")
        assert result.exit_code == 0, (result.output, result.exception)
        return json.loads(result.stdout)


def _ops_flow() -> Flow:
    flow = Flow("ops", "1")
    pokes: list[str] = []

    @flow.tool(safety="unsafe")
    def poke(ctx: Any) -> str:
        pokes.append(ctx.idempotency_key)
        raise ConnectionResetError("no answer")  # ambiguous: unsafe -> unknown, pause

    @flow.tool(safety="unsafe", approval=True)
    def pay(ctx: Any, amount: int) -> dict[str, Any]:
        return {"paid": amount}

    @flow.policy
    def decide(ctx: Any, history: list[Any]) -> list[ToolCall]:
        if history:
            return []
        mode = ctx.input["mode"]
        if mode == "unknown":
            return [ToolCall("poke", {})]
        if mode == "approve":
            return [ToolCall("pay", {"amount": 5})]
        return []

    return flow


def _claim(conn: psycopg.Connection[Any], worker: str, flow: str, run_id: str) -> None:
    name, version = flow.split("@")
    conn.execute(
        "SELECT runledger.register_worker_v2(%s, %s, %s, %s, false)",
        (worker, f"host-{worker}", 4242, [flow]),
    )
    conn.execute("SELECT * FROM runledger.submit_run(%s, %s, %s, '{}')", (run_id, name, version))
    claimed = conn.execute(
        "SELECT run_id FROM runledger.claim_runs_v4(%s, %s, interval '30 seconds', 1)",
        (worker, [flow]),
    ).fetchall()
    assert claimed == [(run_id,)]


@pytest.fixture
async def world(
    database_url: str,
    db: Db,
    start_worker: StartWorker,
    admin_conn: psycopg.Connection[Any],
    db_clock: DbClock,
) -> World:
    flow = _ops_flow()
    worker = await start_worker(flow, worker_id="ops-worker")
    for run_id, mode in (("r-ok", "ok"), ("r-unknown", "unknown"), ("r-approve", "approve")):
        await db.submit(run_id, flow, {"mode": mode})
    await db.wait_status("r-ok", "succeeded")
    await db.wait_status("r-unknown", "paused")
    await db.wait_status("r-approve", "paused")
    await worker.stop()
    await db.submit("r-queued", Flow("idle", "1"))
    _claim(admin_conn, "w-dead", "manual@1", "r-dead")
    db_clock.advance(120)  # w-dead's heartbeat and lease are now 2 minutes old
    _claim(admin_conn, "w-live", "manual@2", "r-live")
    return World(database_url, CliRunner())


# -- list ------------------------------------------------------------------------------


async def test_list_json_newest_first_with_lease_states(world: World) -> None:
    data = world.json("list")
    runs = {r["run_id"]: r for r in data["runs"]}
    assert [r["run_id"] for r in data["runs"]] == [
        "r-live",
        "r-dead",
        "r-queued",
        "r-approve",
        "r-unknown",
        "r-ok",
    ]
    assert runs["r-dead"]["status"] == "running"
    assert runs["r-dead"]["lease_state"] == "lease expired, no live worker"
    assert runs["r-dead"]["expires_in_seconds"] < 0
    assert runs["r-live"]["lease_state"] == "live"
    assert runs["r-live"]["lease_owner"] == "w-live"
    assert runs["r-live"]["expires_in_seconds"] > 0
    assert runs["r-ok"]["lease_state"] is None
    assert runs["r-unknown"]["pause_reason"].startswith("call r-unknown:0:c0 is unknown")
    assert (runs["r-unknown"]["unknown_calls"], runs["r-unknown"]["awaiting_approval"]) == (1, 0)
    assert (runs["r-approve"]["unknown_calls"], runs["r-approve"]["awaiting_approval"]) == (0, 1)

    paused = world.json("list", "--status", "paused", "--status", "queued")
    assert [r["run_id"] for r in paused["runs"]] == ["r-queued", "r-approve", "r-unknown"]
    assert [r["run_id"] for r in world.json("list", "--flow", "manual")["runs"]] == [
        "r-live",
        "r-dead",
    ]
    assert [r["run_id"] for r in world.json("list", "--flow", "manual@2")["runs"]] == ["r-live"]
    assert [r["run_id"] for r in world.json("list", "--limit", "2")["runs"]] == [
        "r-live",
        "r-dead",
    ]
    # --since by the database clock: it was moved 120 s on after the first five runs
    assert [r["run_id"] for r in world.json("list", "--since", "1m")["runs"]] == ["r-live"]
    assert len(world.json("list", "--since", "1d")["runs"]) == 6
    future = world.json("list", "--since", "2999-01-01T00:00:00")
    assert future["runs"] == []


async def test_list_terminal_output(world: World) -> None:
    result = world.invoke("list")
    assert result.exit_code == 0, result.output
    lines = result.stdout.splitlines()
    dead = next(line for line in lines if "r-dead" in line)
    # ages grow with the time the test takes: only their form is asserted
    assert re.search(r"w-dead: expired \d+m \d+s ago, no live worker", dead), dead
    live = next(line for line in lines if "r-live" in line)
    assert re.search(r"w-live: expires in \d+s ", live), live
    assert "│ 1 unknown " in next(line for line in lines if "r-unknown" in line)
    assert "│ 1 approval " in next(line for line in lines if "r-approve" in line)
    empty = world.invoke("list", "--status", "cancelled")
    assert (empty.exit_code, empty.stdout) == (0, "no runs\n")


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["--since", "yesterday"], "neither a duration (30m, 2h, 7d) nor an ISO timestamp"),
        (["--since", "5w"], "neither a duration"),
        (["--status", "done"], "'done' is not one of"),
        (["--limit", "0"], "0 is not in the range"),
        (["--limit", "100001"], "is not in the range"),
        (["--flow", "@1"], "give a name or name@version"),
    ],
)
def test_list_bad_input_is_a_usage_error(
    database_url: str,
    monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture[str],
    args: list[str],
    message: str,
) -> None:
    monkeypatch.setenv("RUNLEDGER_DATABASE_URL", database_url)
    monkeypatch.setattr(sys, "argv", ["runledger", "list", *args])
    with pytest.raises(SystemExit) as exit_:
        cli.run()
    assert exit_.value.code == 2
    captured = capsys.readouterr()
    assert captured.out == ""
    assert message in captured.err
    assert len(captured.err.strip().splitlines()) == 1
    assert "Traceback" not in captured.err


# -- show ------------------------------------------------------------------------------


async def test_show_a_run_whose_worker_died(world: World) -> None:
    data = world.json("show", "r-dead")
    assert data["run"]["status"] == "running"
    lease = data["lease"]
    assert lease["owner"] == "w-dead"
    assert lease["fencing_token"] == 1
    assert lease["expired"] is True and lease["expires_in_seconds"] < 0
    assert lease["verdict"] == "lease expired, no live worker"
    assert lease["holder"]["liveness"] == "silent"
    assert lease["holder"]["heartbeat_age_seconds"] >= 120
    assert [e["kind"] for e in data["timeline"]] == ["submitted", "claimed"]
    assert data["timeline"][1]["actor"] == "w-dead"

    text = world.invoke("show", "r-dead")
    assert text.exit_code == 0, text.output
    assert "r-dead manual@1 running token=1" in text.stdout
    assert "lease: lease expired, no live worker: owner w-dead, token 1" in text.stdout
    assert re.search(
        r"holder w-dead \(host-w-dead pid 4242\): silent, last heartbeat \d+m \d+s ago", text.stdout
    )
    assert "the next worker of manual@1 to poll takes it over" in text.stdout


async def test_show_a_live_lease_and_a_stopped_holder(
    world: World, admin_conn: psycopg.Connection[Any]
) -> None:
    live = world.json("show", "r-live")
    assert live["lease"]["verdict"] == "live"
    assert live["lease"]["holder"]["liveness"] == "alive"
    assert 0 < live["lease"]["expires_in_seconds"] <= 30

    # the holder says it stopped (a drain that left a lease behind): its lease, once
    # expired, has no live worker, whatever its heartbeat
    admin_conn.execute("SELECT runledger.heartbeat_worker('w-live', true)")
    assert world.json("show", "r-live")["lease"]["holder"]["liveness"] == "stopped"
    assert world.json("show", "r-live", "--lease-seconds", "600")["lease"]["verdict"] == "live"


async def test_show_turns_calls_and_the_resolve_line(world: World) -> None:
    data = world.json("show", "r-unknown")
    assert data["lease"] is None
    assert data["run"]["status"] == "paused"
    [turn] = data["turns"]
    [call] = turn["calls"]
    assert call["idempotency_key"] == "r-unknown:0:c0"
    assert (call["status"], call["attempts"], call["dispatched_by"]) == (
        "unknown",
        1,
        "ops-worker",
    )
    kinds = [e["kind"] for e in data["timeline"]]
    assert kinds[:2] == ["submitted", "claimed"]
    assert "call_unknown" in kinds and kinds[-1] == "run_paused"

    text = world.invoke("show", "r-unknown").stdout
    assert "turn 0 (token 1" in text
    assert "  runledger resolve r-unknown:0:c0 applied|not_applied|abandoned\n" in text

    ok = world.json("show", "r-ok")
    assert ok["run"]["result"] == {"turns": 1, "calls": 0}
    assert ok["turns"][0]["calls"] == []


def test_show_an_unknown_run_is_one_line_and_exit_1(
    database_url: str, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    monkeypatch.setenv("RUNLEDGER_DATABASE_URL", database_url)
    monkeypatch.setattr(sys, "argv", ["runledger", "show", "ticket-77"])
    with pytest.raises(SystemExit) as exit_:
        cli.run()
    assert exit_.value.code == 1
    captured = capsys.readouterr()
    assert captured.err == "error: RunNotFound: run ticket-77 not found\n"
    assert captured.out == ""


def test_an_unreachable_database_is_one_line_and_exit_3(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    # port 9 (discard) on localhost: nothing listens there
    monkeypatch.setenv("RUNLEDGER_DATABASE_URL", "postgresql://nobody@127.0.0.1:9/nothing")
    for command in (["list"], ["show", "r-1"], ["workers"], ["unknown"], ["events"]):
        monkeypatch.setattr(sys, "argv", ["runledger", *command, "--connect-timeout", "2"])
        with pytest.raises(SystemExit) as exit_:
            cli.run()
        assert exit_.value.code == 3, command
        err = capsys.readouterr().err
        assert err.startswith("error: DatabaseUnavailable: "), err
        assert len(err.splitlines()) == 1


# -- workers ---------------------------------------------------------------------------


async def test_workers_alive_silent_stopped(world: World) -> None:
    data = world.json("workers")
    assert data["silent_after_seconds"] == 30.0
    rows = {w["worker_id"]: w for w in data["workers"]}
    assert [w["worker_id"] for w in data["workers"]] == ["w-live", "w-dead", "ops-worker"]
    assert (rows["w-live"]["liveness"], rows["w-live"]["runs_held"]) == ("alive", 1)
    assert (rows["w-dead"]["liveness"], rows["w-dead"]["runs_held"]) == ("silent", 0)
    assert rows["w-dead"]["heartbeat_age_seconds"] >= 120
    assert rows["ops-worker"]["liveness"] == "stopped"
    assert rows["w-live"]["flows"] == ["manual@2"]
    # the threshold is the workers' lease length: a longer one makes w-dead alive again
    longer = {
        w["worker_id"]: w["liveness"]
        for w in world.json("workers", "--lease-seconds", "3600")["workers"]
    }
    assert longer["w-dead"] == "alive"
    only = world.json("workers", "--liveness", "silent")
    assert [w["worker_id"] for w in only["workers"]] == ["w-dead"]

    text = world.invoke("workers").stdout
    assert next(line for line in text.splitlines() if "w-dead" in line).count("silent") == 1
    assert "silent: no heartbeat for 30 s (--lease-seconds)" in text


# -- unknown ---------------------------------------------------------------------------


async def test_unknown_lists_every_call_waiting_with_its_command(world: World) -> None:
    data = world.json("unknown")
    calls = {c["idempotency_key"]: c for c in data["calls"]}
    assert set(calls) == {"r-unknown:0:c0", "r-approve:0:c0"}
    unknown = calls["r-unknown:0:c0"]
    assert (unknown["waits_for"], unknown["run_status"], unknown["tool"]) == (
        "unknown",
        "paused",
        "poke",
    )
    assert (unknown["attempts"], unknown["dispatched_token"], unknown["dispatched_by"]) == (
        1,
        1,
        "ops-worker",
    )
    assert unknown["commands"] == ["runledger resolve r-unknown:0:c0 applied|not_applied|abandoned"]
    approval = calls["r-approve:0:c0"]
    assert (approval["waits_for"], approval["approval"], approval["attempts"]) == (
        "approval",
        "pending",
        0,
    )
    assert approval["commands"] == [
        "runledger approve r-approve:0:c0",
        'runledger deny r-approve:0:c0 --reason "..."',
    ]

    text = world.invoke("unknown").stdout
    assert "  runledger resolve r-unknown:0:c0 applied|not_applied|abandoned\n" in text
    assert "  runledger approve r-approve:0:c0\n" in text


async def test_unknown_after_resolving_and_in_finished_runs(
    world: World, admin_conn: psycopg.Connection[Any]
) -> None:
    admin_conn.execute("SELECT runledger.cancel_run('r-unknown', 'carol', 'gave up')")
    assert [c["idempotency_key"] for c in world.json("unknown")["calls"]] == ["r-approve:0:c0"]
    # a cancelled run's unknown call is still unreconciled: --include-finished shows it
    finished = world.json("unknown", "--include-finished")
    call = next(c for c in finished["calls"] if c["idempotency_key"] == "r-unknown:0:c0")
    assert call["run_status"] == "cancelled"
    assert call["commands"] == ["runledger resolve r-unknown:0:c0 applied|not_applied|abandoned"]

    admin_conn.execute("SELECT runledger.deny_call('r-approve:0:c0', 'carol', 'too much')")
    assert world.json("unknown")["calls"] == []
    assert world.invoke("unknown").stdout == "no call is waiting for a person\n"


# -- events ----------------------------------------------------------------------------


async def test_events_filters_newest_last(world: World) -> None:
    data = world.json("events", "--run", "r-dead")
    assert [(e["run_id"], e["kind"]) for e in data["events"]] == [
        ("r-dead", "submitted"),
        ("r-dead", "claimed"),
    ]
    assert data["events"][1]["actor"] == "w-dead"
    every = world.json("events", "--limit", "1000")["events"]
    ids = [e["event_id"] for e in every]
    assert ids == sorted(ids) and len(ids) > 10
    last_two = world.json("events", "--limit", "2")["events"]
    assert [e["event_id"] for e in last_two] == ids[-2:]
    claims = world.json("events", "--kind", "claimed", "--kind", "takeover")["events"]
    assert {e["run_id"] for e in claims} == {"r-ok", "r-unknown", "r-approve", "r-dead", "r-live"}
    assert [e["run_id"] for e in world.json("events", "--since", "1m")["events"]] == [
        "r-live",
        "r-live",
    ]
    text = world.invoke("events", "--run", "r-live").stdout
    assert " r-live claimed by w-live token=1 " in text


# How the command is started: as the suite was (a terminal's foreground job has SIGINT at
# its default), and as a background job of a script (`runledger events --follow &` in a
# non-interactive shell: the shell sets SIGINT to ignored, and Python then installs no
# KeyboardInterrupt handler). `trap "" INT; exec` is that shell's doing, made explicit.
LAUNCH = {
    "as-started": [],
    "sigint-ignored": ["sh", "-c", 'trap "" INT; exec "$0" "$@"'],
}


@pytest.mark.parametrize("launch", list(LAUNCH))
def test_events_follow_prints_new_events_until_ctrl_c(
    database_url: str, admin_conn: psycopg.Connection[Any], launch: str
) -> None:
    """A real process: it prints as JSON lines, sees an event written after it started,
    and exits 0 without a traceback on SIGINT (Ctrl-C), however it was started."""
    admin_conn.execute("SELECT * FROM runledger.submit_run('f-1', 'idle', '1', '{}')")
    env = {**os.environ, "RUNLEDGER_DATABASE_URL": database_url}
    proc = subprocess.Popen(
        [*LAUNCH[launch], sys.executable, "-m", "runledger", "events", "--follow", "--json"],
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    try:
        assert proc.stdout is not None
        first = json.loads(proc.stdout.readline())
        assert (first["run_id"], first["kind"]) == ("f-1", "submitted")
        admin_conn.execute("SELECT * FROM runledger.submit_run('f-2', 'idle', '1', '{}')")
        second = json.loads(proc.stdout.readline())  # blocks until printed (test timeout)
        assert (second["run_id"], second["kind"]) == ("f-2", "submitted")
        assert second["event_id"] > first["event_id"]
        proc.send_signal(signal.SIGINT)
        deadline = time.monotonic() + 20
        while proc.poll() is None and time.monotonic() < deadline:
            time.sleep(0.05)
        assert proc.returncode == 0
        assert proc.stderr is not None
        err = proc.stderr.read()
        assert "Traceback" not in err
        assert proc.stdout.read() == ""
    finally:
        if proc.poll() is None:
            proc.kill()
        proc.wait()


def test_event_follower_sees_an_event_committed_out_of_order(database_url: str) -> None:
    """Ids are taken at insert and commits land in any order: an id skipped by one poll
    (its transaction still open) is printed by a later one, once."""
    from runledger.db.event_log import EventFollower, last_event_id
    from runledger.db.inspect import read_connection

    with (
        psycopg.connect(database_url, autocommit=True) as admin,
        psycopg.connect(database_url) as slow,
        read_connection(database_url, 5) as conn,
    ):
        follower = EventFollower(conn, after=last_event_id(conn))
        slow.execute("SELECT * FROM runledger.submit_run('late', 'idle', '1', '{}')")  # open
        admin.execute("SELECT * FROM runledger.submit_run('early', 'idle', '1', '{}')")
        assert [e["run_id"] for e in follower.poll()] == ["early"]
        assert follower.gaps  # the open transaction's id
        slow.commit()
        assert [e["run_id"] for e in follower.poll()] == ["late"]
        assert follower.poll() == []
        assert not follower.gaps


def test_events_of_a_malformed_run_id_is_refused(database_url: str) -> None:
    result = CliRunner().invoke(
        cli.main, ["events", "--run", "bad id!"], env={"RUNLEDGER_DATABASE_URL": database_url}
    )
    assert result.exit_code == 1
    assert type(result.exception).__name__ == "InvalidInput"


def test_a_running_runs_unknown_call_and_an_expired_lease_whose_holder_is_alive(
    database_url: str, admin_conn: psycopg.Connection[Any], db_clock: DbClock
) -> None:
    """A worker marked a call unknown and has not paused the run yet (or died first): the
    call is listed without a command, since resolve_call refuses a running run. Its lease
    then expires while the worker still heartbeats: 'expired, holder alive'."""
    world = World(database_url, CliRunner())
    _claim(admin_conn, "w-slow", "manual@1", "r-running")
    lease_id, token = admin_conn.execute(
        "SELECT lease_id, fencing_token FROM runledger.runs WHERE run_id = 'r-running'"
    ).fetchone()  # type: ignore[misc]
    calls = '[{"call_id": "c0", "tool": "charge", "args": {}}]'
    admin_conn.execute(
        "SELECT runledger.record_turn_v4('r-running', %s, %s, 0, %s::jsonb"
        ", NULL, NULL, NULL, NULL, false, NULL)",
        (lease_id, token, calls),
    )
    admin_conn.execute(
        "SELECT runledger.dispatch_call('r-running', %s, %s, 'r-running:0:c0')", (lease_id, token)
    )
    admin_conn.execute(
        "SELECT runledger.complete_call('r-running', %s, %s, 'r-running:0:c0', 'unknown', "
        "NULL, NULL)",
        (lease_id, token),
    )
    [call] = world.json("unknown")["calls"]
    assert (call["idempotency_key"], call["run_status"], call["commands"]) == (
        "r-running:0:c0",
        "running",
        [],
    )
    assert call["note"].startswith("the run is running")
    text = world.invoke("unknown").stdout
    assert "runledger resolve" not in text
    assert "    the run is running: its worker pauses it" in text

    db_clock.advance(31)  # past the 30 s lease
    admin_conn.execute("SELECT runledger.heartbeat_worker('w-slow')")  # still heartbeating
    lease = world.json("show", "r-running")["lease"]
    assert (lease["expired"], lease["verdict"]) == (True, "expired, holder alive")
    assert lease["holder"]["liveness"] == "alive"
    [run] = world.json("list")["runs"]
    assert run["lease_state"] == "expired, holder alive"
    held = world.json("workers")["workers"]
    assert [(w["worker_id"], w["runs_held"]) for w in held] == [("w-slow", 0)]
    shown = world.invoke("show", "r-running").stdout
    assert "r-running:0:c0: the run is running" in shown


def test_events_follow_stops_quietly_when_its_reader_goes_away(
    database_url: str, admin_conn: psycopg.Connection[Any]
) -> None:
    """``runledger events --follow | head -1``: each poll's lines are flushed at once, and
    the write after the reader left ends the command, exit 0, no traceback."""
    admin_conn.execute("SELECT * FROM runledger.submit_run('p-1', 'idle', '1', '{}')")
    env = {**os.environ, "RUNLEDGER_DATABASE_URL": database_url}
    proc = subprocess.Popen(
        [sys.executable, "-m", "runledger", "events", "--follow"],
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    try:
        assert proc.stdout is not None and proc.stderr is not None
        assert " p-1 submitted " in proc.stdout.readline()
        admin_conn.execute("SELECT * FROM runledger.submit_run('p-2', 'idle', '1', '{}')")
        assert " p-2 submitted " in proc.stdout.readline()  # flushed by its poll
        proc.stdout.close()
        admin_conn.execute("SELECT * FROM runledger.submit_run('p-3', 'idle', '1', '{}')")
        code = proc.wait(timeout=20)
        err = proc.stderr.read()
        assert code == 0, err
        assert "Traceback" not in err
    finally:
        if proc.poll() is None:
            proc.kill()
        proc.wait()


def _as_role(url: str, role: str) -> str:
    """The URL of a session that takes ``role`` at its start (libpq ``options``)."""
    return url + ("&" if "?" in url else "?") + f"options=-crole%3D{role}"


async def test_the_operator_role_reads_everything_and_a_missing_grant_is_one_line(
    world: World,
    database_url: str,
    monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture[str],
) -> None:
    operator = World(_as_role(database_url, "runledger_operator"), CliRunner())
    assert len(operator.json("list")["runs"]) == 6
    assert operator.json("show", "r-dead")["lease"]["verdict"] == "lease expired, no live worker"
    assert len(operator.json("unknown")["calls"]) == 2
    assert len(operator.json("workers")["workers"]) == 3
    assert operator.json("events", "--run", "r-live")["events"][-1]["kind"] == "claimed"

    # runledger_auditor reads the tables and, since revision 0012, the database clock
    auditor = World(_as_role(database_url, "runledger_auditor"), CliRunner())
    assert len(auditor.json("list")["runs"]) == 6
    assert auditor.json("show", "r-dead")["lease"]["verdict"] == "lease expired, no live worker"
    assert len(auditor.json("unknown")["calls"]) == 2

    # a role without a grant it needs gets one line, exit 1: PUBLIC may not read the clock
    with psycopg.connect(database_url, autocommit=True) as admin:
        admin.execute("DROP ROLE IF EXISTS rl_reads_nobody")
        admin.execute("CREATE ROLE rl_reads_nobody NOLOGIN")
        admin.execute("GRANT USAGE ON SCHEMA runledger TO rl_reads_nobody")
        admin.execute("GRANT SELECT ON ALL TABLES IN SCHEMA runledger TO rl_reads_nobody")
    monkeypatch.setenv("RUNLEDGER_DATABASE_URL", _as_role(database_url, "rl_reads_nobody"))
    monkeypatch.setattr(sys, "argv", ["runledger", "list"])
    with pytest.raises(SystemExit) as exit_:
        cli.run()
    err = capsys.readouterr().err
    assert exit_.value.code == 1, err
    assert err.startswith("error: RunLedgerError: the database refused the read: permission denied")
    assert "EXECUTE on runledger.now()" in err
    assert len(err.splitlines()) == 1
