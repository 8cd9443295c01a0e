from __future__ import annotations

import multiprocessing
import multiprocessing.process
import os
import subprocess
import sys
from collections.abc import Iterator
from typing import Any

import psycopg
import pytest

from runledger.testing import WorkerPool, wait_for

LEASE = 5.0


def run_row(conn: psycopg.Connection[Any], run_id: str) -> dict[str, Any]:
    cur = conn.execute(
        "SELECT status, fencing_token, lease_owner, pause_reason, claims FROM runledger.runs "
        "WHERE run_id = %s",
        (run_id,),
    )
    row = cur.fetchone()
    assert row is not None, f"no run {run_id}"
    return dict(zip([d.name for d in cur.description or []], row, strict=True))


def call_rows(conn: psycopg.Connection[Any], run_id: str) -> list[dict[str, Any]]:
    cur = conn.execute(
        "SELECT idempotency_key, tool, status, attempts, result, receipt, error, "
        "dispatched_token, completed_token, completed_by FROM runledger.run_calls "
        "WHERE run_id = %s ORDER BY turn, position",
        (run_id,),
    )
    names = [d.name for d in cur.description or []]
    return [dict(zip(names, r, strict=True)) for r in cur.fetchall()]


def events(
    conn: psycopg.Connection[Any], run_id: str, kind: str | None = None
) -> list[dict[str, Any]]:
    cur = conn.execute(
        "SELECT kind, actor, fencing_token, detail FROM runledger.run_events "
        "WHERE run_id = %s AND (%s::text IS NULL OR kind = %s) ORDER BY event_id",
        (run_id, kind, kind),
    )
    names = [d.name for d in cur.description or []]
    return [dict(zip(names, r, strict=True)) for r in cur.fetchall()]


def submit(
    conn: psycopg.Connection[Any],
    run_id: str,
    plan: list[list[dict[str, Any]]],
    flow: str = "scripted",
) -> None:
    from psycopg.types.json import Jsonb

    conn.execute(
        "SELECT * FROM runledger.submit_run(%s, %s, '1', %s)", (run_id, flow, Jsonb({"plan": plan}))
    )


def wait_status(
    conn: psycopg.Connection[Any], run_id: str, statuses: tuple[str, ...], timeout: float = 30.0
) -> dict[str, Any]:
    return wait_for(
        lambda: (r := run_row(conn, run_id))["status"] in statuses and r,
        timeout=timeout,
        what=f"run {run_id} in {statuses}",
    )


def listening_backend(conn: psycopg.Connection[Any], worker_id: str) -> int | None:
    """The backend pid of ``worker_id``'s listener session once the worker has started
    on it: registered, its LISTEN answered or its heartbeat begun (a session ended before
    that is a failed start, exit 3, not a lost listener)."""
    row = conn.execute(
        "SELECT pid FROM pg_stat_activity WHERE application_name = 'runledger-listener:' || %s"
        " AND ((query = 'LISTEN runledger_runs' AND state = 'idle')"
        " OR query LIKE '%%heartbeat_listener%%')",
        (worker_id,),
    ).fetchone()
    return None if row is None else int(row[0])


@pytest.fixture
def lease_args() -> list[str]:
    return ["--lease-seconds", str(LEASE)]


# -- workers forked from a preloaded server -------------------------------------------------

# What the fork server imports once: a worker forked from it starts without paying for
# these (about 2 s of CPU each with Pydantic AI, 3 s with the Agents SDK, on the CI's two
# cores).
FORK_PRELOAD = [
    "pytest",
    "runledger.cli",
    "runledger.testing",
    "runledger.worker.process",
    "runledger.integrations.pydantic_ai",
    "pydantic_ai.models.function",
    "runledger.integrations.openai_agents",
]


class _Forked:
    """A forked worker, with the part of ``subprocess.Popen`` that WorkerPool uses."""

    def __init__(self, proc: multiprocessing.process.BaseProcess) -> None:
        self.proc = proc

    @property
    def pid(self) -> int:
        assert self.proc.pid is not None
        return self.proc.pid

    def poll(self) -> int | None:
        return self.proc.exitcode

    def wait(self, timeout: float | None = None) -> int:
        self.proc.join(timeout)
        if self.proc.exitcode is None:
            raise subprocess.TimeoutExpired(f"worker {self.pid}", timeout or 0)
        return self.proc.exitcode


def _forked_worker(argv: list[str], env: dict[str, str], log: str, cwd: str | None) -> None:
    """In the forked process: what ``python -m runledger worker ...`` would do, detached
    (its own session), its output in ``log``, its environment exactly ``env``."""
    os.setsid()
    fd = os.open(log, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
    os.dup2(fd, 1)
    os.dup2(fd, 2)
    os.close(fd)
    os.environ.clear()
    os.environ.update(env)
    if cwd:
        os.chdir(cwd)
    sys.argv = ["runledger", *argv]
    from runledger.cli import run

    run()


class ForkedWorkerPool(WorkerPool):
    """A :class:`WorkerPool` whose workers are forked from multiprocessing's fork server,
    which imported :data:`FORK_PRELOAD` once. Each worker is still its own process
    running the ``runledger worker`` command (SIGKILL, SIGSTOP, exit codes as for the
    exec'd ones); only the imports are shared, copy-on-write. ``preload``: what the fork
    server imports, when this pool is the first to start it in this process."""

    preload: list[str] = FORK_PRELOAD

    def _spawn(self, i: int) -> Any:
        argv = ["worker", "--worker-id", self.worker_id(i)]
        for spec in self.flows:
            argv += ["--flows", spec]
        argv += self.args + self.extra_args[i]
        env = {
            **os.environ,
            **self.env,
            **self.extra_env[i],
            "RUNLEDGER_DATABASE_URL": self.database_url,
            "PYTHONUNBUFFERED": "1",
            "RUNLEDGER_TESTING": "1",
        }
        ctx = multiprocessing.get_context("forkserver")
        ctx.set_forkserver_preload(self.preload)
        proc = ctx.Process(
            target=_forked_worker,
            args=(argv, env, str(self.logs[i]), self.cwd),
            name=self.worker_id(i),
        )
        proc.start()
        return _Forked(proc)


def forked_like(base: WorkerPool, env: dict[str, str], preload: list[str]) -> ForkedWorkerPool:
    """A :class:`ForkedWorkerPool` with ``base``'s database, settings and directory, more
    environment (``env``), and a fork server that imports ``preload`` (when it is the
    first to start one in this process); no flows until the test sets them."""
    pool = ForkedWorkerPool(
        base.database_url, [], env={**base.env, **env}, args=base.args, cwd=base.cwd
    )
    pool.preload = preload
    return pool


@pytest.fixture
def forked_workers(workers: WorkerPool) -> Iterator[ForkedWorkerPool]:
    """The ``workers`` pool's settings (database, provider URL, poll interval), its
    workers forked (:class:`ForkedWorkerPool`); no flows until the test sets them."""
    pool = ForkedWorkerPool(
        workers.database_url, [], env=workers.env, args=workers.args, cwd=workers.cwd
    )
    try:
        yield pool
    finally:
        pool.close()
