"""A full disk at the command line: every command that writes fails with one line that
names SQLSTATE 53100 (exit 1), and ``runledger doctor`` says the database takes no
write, while every read still works. The disk is real: a tablespace on a small
filesystem, filled to the last byte (tests/small_disk.py)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from typing import Any

import psycopg
from click.testing import CliRunner

from runledger.cli import main
from runledger.cli.exits import EXIT_FAILED
from runledger.doctor import run_doctor


def _runledger(url: str, *argv: str) -> subprocess.CompletedProcess[str]:
    """The command as a user runs it: its own process, its stderr as printed."""
    env = {**os.environ, "RUNLEDGER_DATABASE_URL": url}
    return subprocess.run(
        [sys.executable, "-m", "runledger", *argv],
        capture_output=True,
        text=True,
        env=env,
        timeout=90,
    )


def test_submit_on_a_full_disk_is_one_line_naming_the_sqlstate(small_disk: Any) -> None:
    small_disk.fill()
    done = _runledger(small_disk.url, "submit", "scripted@1", "--run-id", "full-1")
    assert done.returncode == EXIT_FAILED, done.stderr
    assert done.stdout == ""
    lines = done.stderr.splitlines()
    assert len(lines) == 1, done.stderr
    assert lines[0].startswith("error: ServerError: disk full: could not extend file"), lines[0]
    assert lines[0].endswith("(SQLSTATE 53100)"), lines[0]
    assert "Check free disk space" in lines[0]
    assert "Traceback" not in done.stderr
    # nothing was written; a read still works on the full disk
    listed = _runledger(small_disk.url, "list", "--json")
    assert listed.returncode == 0, listed.stderr
    assert json.loads(listed.stdout)["runs"] == []
    # and once space is freed, the same command submits
    small_disk.free()
    again = _runledger(small_disk.url, "submit", "scripted@1", "--run-id", "full-1")
    assert again.returncode == 0, again.stderr
    with psycopg.connect(small_disk.url, autocommit=True) as conn:
        assert conn.execute("SELECT status FROM runledger.runs").fetchall() == [("queued",)]


def test_doctor_fails_the_write_check_on_a_full_disk(small_disk: Any) -> None:
    before = {r.check: r for r in run_doctor(small_disk.url, connect_timeout=5)}
    assert before["write"].ok, before["write"]
    small_disk.fill()
    results = {r.check: r for r in run_doctor(small_disk.url, connect_timeout=5)}
    write = results["write"]
    assert write.status == "fail", write
    assert write.data["sqlstate"] == "53100"
    assert write.detail.startswith("the database takes no write: disk full: "), write.detail
    assert "(SQLSTATE 53100)" in write.detail
    # the reads of every other check still work
    assert all(r.ok for name, r in results.items() if name != "write"), results
    result = CliRunner().invoke(main, ["doctor", "--database-url", small_disk.url])
    assert result.exit_code == EXIT_FAILED, result.output
    assert "fail write: the database takes no write: disk full" in result.output
    small_disk.free()
    after = {r.check: r for r in run_doctor(small_disk.url, connect_timeout=5)}
    assert after["write"].ok, after["write"]
    # the check left nothing behind
    with psycopg.connect(small_disk.url, autocommit=True) as conn:
        left = conn.execute(
            "SELECT count(*) FROM pg_class WHERE relname = 'runledger_doctor_write'"
        ).fetchone()
        assert left == (0,)
