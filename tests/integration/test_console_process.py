"""``runledger console`` as a command: its start-up refusals are one line with the exit
codes of ``runledger --help`` (nothing served), and, as a real process, its live stream:
server-sent events driven by ``LISTEN runledger_events``, one run's only when asked,
and a resync after the listening connection is cut.
"""

from __future__ import annotations

import asyncio
import json
import os
import re
import shlex
import signal
import socket
import subprocess
import sys
import threading
import time
from collections.abc import AsyncIterator, Iterator
from pathlib import Path
from typing import Any

import click
import httpx
import psycopg
import pytest

from runledger import cli
from tests.integration.conftest import DEADLINE

pytestmark = pytest.mark.timeout(90)

TOKEN = "process-test-token-0123456789"


def as_role(url: str, role: str) -> str:
    return url + ("&" if "?" in url else "?") + f"options=-crole%3D{role}"


def run_cli(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str], *args: str
) -> tuple[int, str]:
    monkeypatch.setattr(sys, "argv", ["runledger", "console", *args])
    with pytest.raises(SystemExit) as exit_:
        cli.run()
    code = exit_.value.code
    assert isinstance(code, int)
    return code, capsys.readouterr().err


@pytest.fixture
def clean_env(monkeypatch: pytest.MonkeyPatch) -> None:
    for name in list(os.environ):
        if name.startswith("RUNLEDGER_") or name == "DATABASE_URL":
            monkeypatch.delenv(name)


@pytest.mark.usefixtures("clean_env")
def test_start_up_refusals_are_one_line(
    database_url: str, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    auditor = as_role(database_url, "runledger_auditor")
    operator = as_role(database_url, "runledger_operator")
    cases: list[tuple[list[str], dict[str, str], int, str]] = [
        ([], {}, 2, "no database URL"),
        (
            ["--database-url", auditor, "--allow-actions", "--operator-url", operator],
            {},
            2,
            "--allow-actions needs a login token in RUNLEDGER_CONSOLE_TOKEN",
        ),
        (
            ["--database-url", auditor, "--allow-actions"],
            {"RUNLEDGER_CONSOLE_TOKEN": TOKEN},
            2,
            "--allow-actions needs --operator-url",
        ),
        (
            ["--database-url", auditor, "--allow-actions", "--operator-url", operator],
            {"RUNLEDGER_CONSOLE_TOKEN": "short"},
            2,
            "at least 16 characters",
        ),
        (["--database-url", auditor, "--actor", " "], {}, 2, "must not be empty"),
        (["--database-url", auditor, "--port", "70000"], {}, 2, "70000 is not in the range"),
        # the operator URL must be able to act: an auditor login cannot
        (
            ["--database-url", auditor, "--allow-actions", "--operator-url", auditor],
            {"RUNLEDGER_CONSOLE_TOKEN": TOKEN},
            1,
            "the --operator-url role may not execute runledger.resolve_call",
        ),
        (
            ["--database-url", "postgresql://nobody@127.0.0.1:1/x", "--connect-timeout", "1"],
            {},
            3,
            "DatabaseUnavailable: cannot reach PostgreSQL at 127.0.0.1:1",
        ),
    ]
    for args, env, want_code, message in cases:
        for name, value in env.items():
            monkeypatch.setenv(name, value)
        code, err = run_cli(monkeypatch, capsys, *args)
        for name in env:
            monkeypatch.delenv(name)
        assert (code, len(err.splitlines())) == (want_code, 1), (args, err)
        assert message in err, (args, err)
        assert "Traceback" not in err


@pytest.mark.usefixtures("clean_env")
def test_a_port_in_use_is_one_line(
    database_url: str, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen(1)
        port = taken.getsockname()[1]
        code, err = run_cli(
            monkeypatch,
            capsys,
            "--database-url",
            as_role(database_url, "runledger_auditor"),
            "--port",
            str(port),
        )
    assert code == 2, err
    assert err.strip().endswith(f"cannot listen on 127.0.0.1:{port}: Address already in use")


# -- the live stream, from a real process -----------------------------------------------


class Served:
    def __init__(self, url: str) -> None:
        env = {k: v for k, v in os.environ.items() if not k.startswith("RUNLEDGER_")}
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "runledger", "console", "--database-url", url, "--port", "0"],
            env=env,
            stdout=subprocess.DEVNULL,
            stderr=subprocess.PIPE,
            text=True,
        )
        self.lines: list[str] = []
        self.base: str | None = None
        self.started = threading.Event()
        threading.Thread(target=self._read, daemon=True).start()

    def _read(self) -> None:
        assert self.proc.stderr is not None
        for line in self.proc.stderr:
            self.lines.append(line.rstrip("\n"))
            m = re.match(r"runledger console: (http://\S+?)/ ", line)
            if m:
                self.base = m.group(1)
                self.started.set()
        self.started.set()

    def stop(self) -> int:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
        return self.proc.wait(15)


@pytest.fixture
def served(database_url: str) -> Iterator[Served]:
    s = Served(database_url)  # the superuser: the console warns that this role may act
    try:
        assert s.started.wait(30) and s.base, s.lines
        yield s
    finally:
        if s.proc.poll() is None:
            s.proc.kill()
        s.proc.wait()


async def sse(base: str, path: str) -> AsyncIterator[tuple[str, dict[str, Any]]]:
    async with (
        httpx.AsyncClient(timeout=None) as client,
        client.stream("GET", base + path) as response,
    ):
        assert response.status_code == 200
        assert response.headers["content-type"].startswith("text/event-stream")
        name = None
        async for line in response.aiter_lines():
            if line.startswith("event: "):
                name = line[len("event: ") :]
            elif line.startswith("data: ") and name is not None:
                yield name, json.loads(line[len("data: ") :])
                name = None


async def next_event(stream: AsyncIterator[tuple[str, dict[str, Any]]], *names: str) -> Any:
    async with asyncio.timeout(DEADLINE):
        async for name, data in stream:
            if name in names:
                return name, data
    raise AssertionError(f"the stream ended before {names}")


async def test_the_stream_sends_each_change_and_only_its_runs_when_asked(
    served: Served, admin_conn: psycopg.Connection[Any]
) -> None:
    assert served.base is not None
    assert any("the read URL's role may act" in line for line in served.lines), served.lines
    for run_id in ("s-one", "s-two"):
        admin_conn.execute("SELECT * FROM runledger.submit_run(%s, 'idle', '1', '{}')", (run_id,))
    one = sse(served.base, "/api/stream?run=s-one")
    every = sse(served.base, "/api/stream")
    assert (await next_event(one, "ready"))[1] == {"run_id": "s-one"}
    assert (await next_event(every, "ready"))[1] == {"run_id": None}

    admin_conn.execute("SELECT runledger.cancel_run('s-two', 'tester', 'x')")
    admin_conn.execute("SELECT runledger.cancel_run('s-one', 'tester', 'y')")
    (last,) = admin_conn.execute(
        "SELECT event_id FROM runledger.run_events WHERE run_id = 's-one' "
        "AND kind = 'run_cancelled'"
    ).fetchone()
    # one run's stream: only s-one's event; the other stream: both, in commit order
    assert await next_event(one, "change") == (
        "change",
        {"event_id": last, "run_id": "s-one", "kind": "run_cancelled"},
    )
    seen = [(await next_event(every, "change"))[1]["run_id"] for _ in range(2)]
    assert seen == ["s-two", "s-one"]

    # the listening connection is cut: the stream says offline, then ready and resync
    admin_conn.execute(
        "SELECT pg_terminate_backend(pid) FROM pg_stat_activity "
        "WHERE application_name = 'runledger-console-listen'"
    )
    assert (await next_event(one, "offline", "resync"))[0] == "offline"
    assert (await next_event(one, "resync"))[0] == "resync"
    assert (await next_event(every, "resync"))[0] == "resync"
    # listening again: a new event comes through
    admin_conn.execute("SELECT * FROM runledger.submit_run('s-three', 'idle', '1', '{}')")
    _, data = await next_event(every, "change")
    assert (data["run_id"], data["kind"]) == ("s-three", "submitted")
    await one.aclose()
    # a stream still open when the console is told to stop ends, and the console exits
    # at once, with nothing on stderr past its start-up lines
    lines_before = len(served.lines)
    started = time.monotonic()
    # uvicorn shuts down gracefully, then raises the signal again: killed by SIGTERM
    assert served.stop() in (0, -signal.SIGTERM)
    assert time.monotonic() - started < 4.0  # its graceful-shutdown timeout is 5 s
    async with asyncio.timeout(DEADLINE):
        rest = [name async for name, _ in every]
    assert "change" not in rest
    assert served.lines[lines_before:] == []


def test_the_listener_names_tcp_so_asyncio_sets_nodelay() -> None:
    from runledger.cli.console import listening_socket

    sock = listening_socket("127.0.0.1", 0)
    try:
        assert sock.proto == socket.IPPROTO_TCP
    finally:
        sock.close()


# -- the docs say what the command takes -------------------------------------------------

ROOT = Path(__file__).resolve().parents[2]


def _console_lines(text: str) -> list[str]:
    """Each ``runledger console ...`` command of the bash blocks, continuations joined and
    leading ``VAR=value`` assignments dropped."""
    found = []
    for block in re.findall(r"```bash\n(.*?)```", text, re.S):
        for command in block.replace("\\\n", " ").splitlines():
            words = shlex.split(command, comments=True)
            while words and re.fullmatch(r"[A-Z_]+=.*", words[0]):
                words.pop(0)
            if words[:2] == ["runledger", "console"]:
                found.append(words)
    return found


def test_the_console_lines_of_the_docs_parse() -> None:
    on_call = (ROOT / "docs" / "on-call.md").read_text(encoding="utf-8")
    section = on_call[on_call.index("## Console") :]
    section = section[: section.index("\n## ")]
    docs = (ROOT / "docs" / "console.md").read_text(encoding="utf-8")
    lines = _console_lines(section) + _console_lines(docs)
    assert len(lines) >= 4, lines
    command = cli.main.commands["console"]
    for words in lines:
        command.make_context("console", words[2:])  # an unknown option or bad value raises
    for param in command.params:
        if isinstance(param, click.Option):
            assert any(f"`{o}`" in docs for o in param.opts), param.opts
            assert f"`{param.envvar}`" in docs or param.envvar == [
                "RUNLEDGER_DATABASE_URL",
                "DATABASE_URL",
            ], param.envvar


def test_docs_name_every_api_route() -> None:
    from runledger.console.pages import API_INDEX

    docs = (ROOT / "docs" / "console.md").read_text(encoding="utf-8")
    for route in API_INDEX:
        assert f"`{route}`" in docs or f"`{route.split()[1]}`" in docs, route


@pytest.mark.slow
def test_the_wheel_ships_the_templates_and_static_files(tmp_path: Path) -> None:
    import zipfile

    subprocess.run(
        [sys.executable, "-m", "pip", "wheel", "--no-deps", "-q", "-w", str(tmp_path), str(ROOT)],
        check=True,
        capture_output=True,
        timeout=300,
    )
    (wheel,) = tmp_path.glob("runledger_pg-*.whl")
    with zipfile.ZipFile(wheel) as zf:
        names = set(zf.namelist())
    package = ROOT / "service" / "runledger" / "console"
    shipped = {
        f"runledger/console/{p.relative_to(package).as_posix()}"
        for folder in ("templates", "static")
        for p in (package / folder).iterdir()
    }
    assert len(shipped) >= 9
    assert shipped <= names, sorted(shipped - names)
