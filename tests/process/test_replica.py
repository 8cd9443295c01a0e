"""A read replica: every command pointed at a real hot standby (a streaming
``pg_basebackup -R`` copy of a primary, local binaries: :mod:`tests.process.replication`).

The read commands work there as on the primary. Each write command answers with one line,
``error: ReadOnly: <what was refused> ...; <host:port> is a standby (in recovery): point
writes at the primary``, and exit 1; ``runledger worker`` exits 3 (a worker can do
nothing there, as on a database it cannot reach); none prints a traceback. The console
says "read replica: no live updates" instead of ``offline``: a standby hears no NOTIFY.

One standby for the module: the commands only read it, and it refuses every write.
"""

from __future__ import annotations

import asyncio
import os
import re
import subprocess
import sys
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

import httpx
import psycopg
import pytest
from click.testing import CliRunner

from runledger import cli
from runledger.db import migrate
from runledger.testing import wait_for
from tests.conftest import DEMO_FLOWS
from tests.contract import helpers
from tests.integration.test_console_process import Served, next_event, sse
from tests.process.replication import Pair, start_pair

pytestmark = [pytest.mark.process]

ROOT = Path(__file__).resolve().parents[2]


@dataclass(frozen=True)
class Standby:
    pair: Pair
    url: str  # the standby's runledger database
    unknown_key: str  # a call of a paused run, unknown: resolvable
    approval_keys: tuple[str, str]  # two calls of a paused run awaiting approval

    @property
    def where(self) -> str:
        return f"127.0.0.1:{self.pair.standby.port}"


def _replayed(standby_url: str, lsn: str) -> bool:
    """Whether the standby has replayed up to ``lsn``: asked of its ``postgres`` database,
    which exists before the standby has replayed the test's CREATE DATABASE."""
    with psycopg.connect(standby_url, autocommit=True, connect_timeout=5) as conn:
        row = conn.execute("SELECT pg_last_wal_replay_lsn() >= %s::pg_lsn", (lsn,)).fetchone()
    return bool(row and row[0])


@pytest.fixture(scope="module")
def standby() -> Iterator[Standby]:
    """A migrated primary with runs in every state an operator acts on, and its standby
    once it has replayed them."""
    pair = start_pair()
    try:
        with pair.primary.connect() as admin:
            admin.execute("CREATE DATABASE replica")
        primary_url = pair.primary.url("replica")
        migrate.upgrade(primary_url)
        with psycopg.connect(primary_url, autocommit=True) as conn:
            [unknown] = helpers.paused_on_unknown(conn, helpers.submit_and_claim(conn, "r-unknown"))
            lease = helpers.submit_and_claim(conn, "r-approval")
            first, second = helpers.paused_awaiting_approval(conn, lease, ("c1", "c2"))
            helpers.submit(conn, "r-queued")
            row = conn.execute("SELECT pg_current_wal_lsn()::text").fetchone()
            assert row is not None
        replay = pair.standby.url("postgres")
        wait_for(lambda: _replayed(replay, row[0]), timeout=30, what="the standby to replay")
        url = pair.standby.url("replica")
        yield Standby(pair, url, unknown, (first, second))
    finally:
        pair.stop()


def _cli(url: str, *args: str) -> subprocess.CompletedProcess[str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("RUNLEDGER_")}
    env["PYTHONPATH"] = os.pathsep.join([str(ROOT), *sys.path])
    return subprocess.run(
        [sys.executable, "-m", "runledger", *args, "--database-url", url],
        capture_output=True,
        text=True,
        timeout=90,
        env=env,
        cwd=str(ROOT),
        check=False,
    )


def _commands(
    standby: Standby,
) -> tuple[dict[str, tuple[list[str], int, str]], dict[str, list[str]]]:
    """The write commands (arguments, exit code, what the line names as refused) and the
    read commands, each on a run it applies to."""
    unknown, (approve_key, deny_key) = standby.unknown_key, standby.approval_keys
    writes: dict[str, tuple[list[str], int, str]] = {
        "submit": (["submit", "demo@1", "--input", "{}"], 1, "runledger.submit_run"),
        "resolve": (["resolve", unknown, "applied"], 1, "runledger.resolve_call"),
        "cancel": (["cancel", "r-queued"], 1, "runledger.cancel_run"),
        "retry": (["retry", "r-unknown"], 1, "runledger.retry_run"),
        "approve": (["approve", approve_key], 1, "runledger.approve_call"),
        "deny": (["deny", deny_key, "--reason", "no"], 1, "runledger.deny_call"),
        "prune": (["prune", "--older-than", "1d"], 1, "runledger.prune_runs"),
        "checkpoint": (["checkpoint"], 1, "runledger.checkpoint_events"),
        "migrate": (["migrate"], 1, "the migration"),
        "worker": (["worker", "--flows", *DEMO_FLOWS], 3, "runledger.register_worker"),
    }
    reads: dict[str, list[str]] = {
        "status": ["status", "r-unknown"],
        "show": ["show", "r-approval", "--json"],
        "list": ["list", "--json"],
        "unknown": ["unknown", "--json"],
        "workers": ["workers"],
        "events": ["events", "--json"],
        "audit": ["audit"],
        "migrate --check": ["migrate", "--check"],
        "prune --dry-run": ["prune", "--older-than", "1d", "--dry-run"],
    }
    return writes, reads


@pytest.mark.timeout(240)
def test_on_a_standby_reads_work_every_write_is_one_line_and_the_console_says_so(
    standby: Standby,
) -> None:
    """One test, so that one standby serves it all whatever worker of pytest-xdist runs it;
    the console starts first and comes up while the commands run."""
    served = Served(standby.url)
    try:
        writes, reads = _commands(standby)
        with ThreadPoolExecutor(max_workers=4) as pool:  # each write: a process of its own
            done = dict(
                zip(
                    writes,
                    pool.map(lambda w: _cli(standby.url, *w[0]), writes.values()),
                    strict=True,
                )
            )

        # every write command: one line, its exit code, what was refused and where to go
        said = f"{standby.where} is a standby (in recovery): point writes at the primary"
        wrong = {}
        for name, (_, code, refused) in writes.items():
            got = done[name]
            lines = got.stderr.splitlines()
            ok = (
                got.returncode == code
                and len(lines) == 1
                and "Traceback" not in got.stderr
                and lines[0].startswith(f"error: ReadOnly: {refused}")
                and said in lines[0]
            )
            if not ok:
                wrong[name] = (got.returncode, got.stderr[-600:])
        assert wrong == {}, wrong
        assert (
            done["worker"]
            .stderr.rstrip()
            .endswith(
                "a worker needs the primary: list every host with target_session_attrs=read-write "
                "(docs/failover.md)"
            )
        )

        # every read command works there as on the primary (in this process: they are
        # many, and none of them changed)
        runner = CliRunner()
        read = {
            name: runner.invoke(cli.main, [*args, "--database-url", standby.url])
            for name, args in reads.items()
        }
        failed_reads = {
            name: (got.exit_code, got.output[-600:], repr(got.exception))
            for name, got in read.items()
            if got.exit_code != 0 or not got.stdout
        }
        assert failed_reads == {}, failed_reads
        assert "r-unknown" in read["status"].stdout
        assert read["migrate --check"].stdout.startswith("up to date: ")

        # the console: "read replica", not offline
        assert served.started.wait(30) and served.base, served.lines
        asyncio.run(_console_says_replica(served.base))
        assert any("the database is a standby" in line for line in served.lines), served.lines
        assert not any("lost LISTEN" in line for line in served.lines), served.lines
    finally:
        served.stop()


async def _console_says_replica(base: str) -> None:
    every = sse(base, "/api/stream")
    one = sse(base, "/api/stream?run=r-unknown")
    # the first state a page's stream gives: not offline (after 15 s), and not ready
    assert await next_event(every, "ready", "replica", "offline") == (
        "replica",
        {"run_id": None, "poll": 5},
    )
    assert await next_event(one, "ready", "replica", "offline") == (
        "replica",
        {"run_id": "r-unknown", "poll": 5},
    )
    await every.aclose()  # type: ignore[attr-defined]
    await one.aclose()  # type: ignore[attr-defined]
    async with httpx.AsyncClient(base_url=base, timeout=30) as client:
        page = await client.get("/runs")
        runs = await client.get("/api/runs")
    # the header says so from the first paint, and the reads work
    assert page.status_code == 200
    badge = re.search(r'<span id="live-state"[^>]*>([^<]*)</span>', page.text)
    assert badge is not None and badge.group(1) == "read replica: no live updates"
    assert runs.status_code == 200
    assert {r["run_id"] for r in runs.json()["runs"]} == {"r-unknown", "r-approval", "r-queued"}
