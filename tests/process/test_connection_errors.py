"""``python -m runledger`` against databases that are not there, as a user would run it:
one line on stderr, no traceback, the documented exit code, within the connect timeout.
"""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import time
from collections.abc import Iterator

import pytest
from psycopg.conninfo import make_conninfo

from runledger.testing.postgres import Databases, url_with_dbname

pytestmark = pytest.mark.process

TIMEOUT = 3.0
MARGIN = 6.0  # interpreter start-up included


def _closed_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


@pytest.fixture
def silent_server() -> Iterator[int]:
    """A port that accepts TCP connections and never answers (a hung server)."""
    with socket.socket() as listener:
        listener.bind(("127.0.0.1", 0))
        listener.listen(16)
        yield int(listener.getsockname()[1])


@pytest.fixture
def empty_database(runledger_databases: Databases) -> Iterator[str]:
    url = runledger_databases.create("rl_empty", migrated=False)
    try:
        yield url
    finally:
        runledger_databases.drop(url)


def runledger(*argv: str, url: str, timeout: float = 60) -> tuple[int, str, str, float]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("RUNLEDGER_")}
    env.update(RUNLEDGER_DATABASE_URL=url, RUNLEDGER_CONNECT_TIMEOUT=str(TIMEOUT))
    started = time.monotonic()
    done = subprocess.run(
        [sys.executable, "-m", "runledger", *argv],
        env=env,
        capture_output=True,
        text=True,
        timeout=timeout,
    )
    return done.returncode, done.stdout, done.stderr, time.monotonic() - started


COMMANDS = [
    ["status", "r-1"],
    ["submit", "f@1", "--run-id", "r-1"],
    ["wait", "r-1", "--timeout", "1"],
    ["resolve", "r-1:0:c0", "abandoned"],
    ["cancel", "r-1"],
    ["retry", "r-1"],
    ["audit"],
    ["migrate"],
    ["worker", "--flows", "runledger.demo.flows:flows"],
]


def _cases(database_url: str, empty: str) -> dict[str, tuple[str, int, str]]:
    port = _closed_port()
    return {
        "refused": (
            f"postgresql://postgres@127.0.0.1:{port}/app",
            3,
            f"error: DatabaseUnavailable: cannot reach PostgreSQL at 127.0.0.1:{port}",
        ),
        "no-database": (
            url_with_dbname(database_url, "rl_missing"),
            3,
            "createdb rl_missing",
        ),
        "no-role": (
            make_conninfo(database_url, user="rl_nobody"),
            3,
            "refused role 'rl_nobody'",
        ),
        "notaurl": ("notaurl", 2, "error: ConfigurationError: the database URL is not"),
        "unmigrated": (empty, 3, "error: SchemaMissing: "),
    }


PAIRS = [
    (case, argv)
    for case in ("refused", "no-database", "no-role", "notaurl", "unmigrated")
    for argv in COMMANDS
    if not (case == "unmigrated" and argv[0] == "migrate")  # what migrate is for: see below
]


@pytest.mark.parametrize(("case", "argv"), PAIRS, ids=[f"{c}-{a[0]}" for c, a in PAIRS])
def test_every_command_fails_in_one_line(
    database_url: str, empty_database: str, case: str, argv: list[str]
) -> None:
    url, code, message = _cases(database_url, empty_database)[case]
    rc, out, err, elapsed = runledger(*argv, url=url)
    assert rc == code, (rc, err)
    assert out == ""
    [line] = err.splitlines()
    assert message in line, line
    assert "Traceback" not in err
    assert elapsed < TIMEOUT + MARGIN, elapsed


@pytest.mark.parametrize("argv", [["status", "r-1"], ["migrate"], ["worker", "--flows", "m:f"]])
def test_a_server_that_never_answers_is_one_line_within_the_timeout(
    silent_server: int, argv: list[str]
) -> None:
    if argv[0] == "worker":
        argv = ["worker", "--flows", "runledger.demo.flows:flows"]
    rc, _, err, elapsed = runledger(*argv, url=f"postgresql://u@127.0.0.1:{silent_server}/app")
    assert rc == 3, err
    [line] = err.splitlines()
    assert "no answer from PostgreSQL at 127.0.0.1" in line and "within 3 s" in line, line
    assert TIMEOUT - 0.5 <= elapsed < TIMEOUT + MARGIN, elapsed


def test_migrate_on_an_empty_database_then_every_command_works(empty_database: str) -> None:
    rc, out, err, _ = runledger("status", "r-1", url=empty_database)
    assert rc == 3 and "run `runledger migrate`" in err
    rc, out, err, _ = runledger("migrate", url=empty_database)
    assert rc == 0, err
    assert out.startswith("migrated: empty -> ")
    rc, out, err, _ = runledger("submit", "f@1", "--run-id", "r-1", url=empty_database)
    assert (rc, out) == (0, "r-1 submitted\n"), err
