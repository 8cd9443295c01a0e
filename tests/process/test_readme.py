"""The README's first example runs as shown: its python block is written to the file its
first line names, and its bash block runs in bash in that directory, with the database
URL of its ``export`` line pointed at a fresh test database (nothing else changed)."""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
from pathlib import Path
from typing import Any

import psycopg
import pytest

from runledger.testing import wait_for

pytestmark = pytest.mark.process

README = Path(__file__).resolve().parents[2] / "README.md"
EXPORT = re.compile(r"^export RUNLEDGER_DATABASE_URL=\S+$", re.M)


def first_example() -> tuple[str, str, str]:
    """(file name, python code, bash script): the README's first two code blocks."""
    text = README.read_text(encoding="utf-8")
    blocks = re.findall(r"^```(\w+)\n(.*?)^```", text, re.S | re.M)
    (lang1, code), (lang2, script) = blocks[:2]
    assert (lang1, lang2) == ("python", "bash"), (lang1, lang2)
    name = re.fullmatch(r"# (\w+\.py)", code.splitlines()[0])
    assert name, f"the python block does not start with its file name: {code.splitlines()[0]!r}"
    return name.group(1), code, script


def test_the_first_example_is_short_and_complete() -> None:
    _, code, script = first_example()
    assert len(code.splitlines()) + len(script.splitlines()) <= 20
    assert "@flow.tool(" in code and "@flow.policy" in code
    assert len(EXPORT.findall(script)) == 1
    assert re.search(r"^runledger worker .*&$", script, re.M)
    assert re.search(r"^runledger submit ", script, re.M)


def test_the_first_example_runs_as_shown(
    tmp_path: Path, database_url: str, admin_conn: psycopg.Connection[Any]
) -> None:
    name, code, script = first_example()
    (tmp_path / name).write_text(code)
    script = EXPORT.sub(f"export RUNLEDGER_DATABASE_URL={database_url}", script)
    env = {k: v for k, v in os.environ.items() if not k.startswith(("RUNLEDGER_", "PYTHON"))}
    env["PATH"] = f"{Path(sys.executable).parent}{os.pathsep}{env.get('PATH', '')}"
    with (tmp_path / "out").open("w") as out, (tmp_path / "err").open("w") as err:
        shell = subprocess.Popen(
            ["bash", "-e", "-c", script],
            cwd=tmp_path,
            env=env,
            stdout=out,  # files, not pipes: the worker left running keeps its output open
            stderr=err,
            start_new_session=True,  # and it stays in this process group
        )
        try:
            shell.wait(timeout=120)
        finally:
            os.killpg(shell.pid, signal.SIGTERM)  # the worker started with `&`
            wait_for(lambda: not _live(shell.pid), timeout=30, what="the worker to stop")
    output = (tmp_path / "out").read_text() + (tmp_path / "err").read_text()
    assert shell.returncode == 0, output
    assert "r1 succeeded" in output, output
    row = admin_conn.execute(
        "SELECT tool, status, result FROM runledger.run_calls WHERE run_id = 'r1'"
    ).fetchall()
    assert row == [("create_ticket", "succeeded", {"title": "Login fails", "key": "r1:0:c0"})]


def _live(pgid: int) -> list[int]:
    """The processes of group ``pgid`` that have not exited (a zombie has; nothing may
    reap an orphan here)."""
    found = []
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            fields = stat.read_text().rsplit(")", 1)[1].split()
        except OSError:
            continue  # gone meanwhile
        if int(fields[2]) == pgid and fields[0] != "Z":
            found.append(int(stat.parent.name))
    return found
