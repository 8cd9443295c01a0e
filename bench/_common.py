"""Shared pieces of the benchmarks: a database, worker processes, CPU counters, tables.

Run by hand, never from pytest. The database is ``RUNLEDGER_DATABASE_URL`` when set
(migrated in place; the benchmark's runs stay there, under a unique run-id prefix),
otherwise a throwaway cluster from :func:`runledger.testing.postgres.acquire_server`.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import signal
import statistics
import sys
import time
import uuid
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from typing import Any

import psycopg

from runledger.config import normalize_url
from runledger.db.migrate import upgrade
from runledger.testing.postgres import Databases, acquire_server
from runledger.testing.processes import ProviderProcess, WorkerPool, wait_for

FLOWS = ["runledger.demo.flows:flows"]
# What a worker loaded with FLOWS registers (sorted), so a baseline claims the same way.
FLOW_REFS = ["scripted@1", "ticket-triage@1"]


def say(msg: str) -> None:
    print(msg, file=sys.stderr, flush=True)


@dataclass
class Database:
    url: str
    source: str  # "throwaway cluster" or "RUNLEDGER_DATABASE_URL"
    version: str
    postmaster: int | None = None  # local server's postmaster pid, for CPU accounting
    databases: Databases | None = None  # set for the throwaway cluster

    def fresh(self, prefix: str = "runledger_bench") -> str:
        """An empty migrated database for one scenario, so no scenario runs on the rows
        of the previous ones; on RUNLEDGER_DATABASE_URL, that same database."""
        if self.databases is None:
            return self.url
        return self.databases.create(prefix)


@contextlib.contextmanager
def database() -> Iterator[Database]:
    """A migrated database: RUNLEDGER_DATABASE_URL if set, else a throwaway cluster."""
    url = os.environ.get("RUNLEDGER_DATABASE_URL")
    if url:
        url = normalize_url(url)
        upgrade(url)
        yield Database(
            url=url,
            source="RUNLEDGER_DATABASE_URL",
            version=server_version(url),
            postmaster=postmaster_pid(url),
        )
        return
    say("no RUNLEDGER_DATABASE_URL: starting a throwaway PostgreSQL cluster")
    server = acquire_server()
    try:
        databases = Databases(server)
        databases.ensure_template()  # migrated once; each fresh() clones it
        db = databases.create("runledger_bench")
        yield Database(
            url=db,
            source=f"throwaway cluster ({server.backend}; fsync=off, synchronous_commit=off)",
            version=server.version,
            postmaster=postmaster_pid(db),
            databases=databases,
        )
    finally:
        with shielded():
            server.stop()


def server_version(url: str) -> str:
    with psycopg.connect(url, autocommit=True) as conn:
        row = conn.execute("SHOW server_version").fetchone()
        return str(row[0]) if row else "?"


def tag() -> str:
    """A short unique prefix for run ids and worker ids of one benchmark invocation."""
    return uuid.uuid4().hex[:6]


class BenchPool(WorkerPool):
    """WorkerPool with ids unique to this invocation (a shared database keeps old rows)."""

    def __init__(self, database_url: str, name: str, **kwargs: Any) -> None:
        super().__init__(database_url, FLOWS, **kwargs)
        self.name = name

    def worker_id(self, i: int) -> str:
        return f"{self.name}-w{i}"

    def kill_now(self, i: int) -> None:
        """SIGKILL without waiting for the exit (the caller reads the DB clock first)."""
        os.kill(self.procs[i].pid, signal.SIGKILL)

    def close(self) -> None:
        with shielded():
            try:
                super().close()
            finally:
                for p in self.procs:
                    with contextlib.suppress(Exception):
                        if p.poll() is None:
                            p.kill()
                            p.wait(timeout=10)
                shutil.rmtree(self._dir, ignore_errors=True)


def wait_ready(
    conn: psycopg.Connection[Any], pool: BenchPool, indexes: Sequence[int], timeout: float = 60.0
) -> None:
    """Until each worker has registered (with its current pid) and its listener is LISTENing.

    A worker that is registered but not yet listening would see a submit only at its next
    poll, which would add up to --poll-seconds to what is measured.
    """

    def ready() -> bool:
        for i in indexes:
            if not pool.alive(i):
                raise RuntimeError(f"worker {pool.worker_id(i)} exited:\n{pool.log(i)[-3000:]}")
            row = conn.execute(
                """
                SELECT EXISTS (
                    SELECT 1 FROM pg_stat_activity a
                    WHERE a.application_name = left('runledger-listener:' || w.worker_id, 63)
                      AND a.pid = w.session_pid  -- the session it registered on
                      AND (a.query ILIKE 'LISTEN%%' OR a.query LIKE '%%heartbeat_listener%%'))
                FROM runledger.workers w
                WHERE w.worker_id = %s AND w.pid = %s AND w.stopped_at IS NULL
                """,
                (pool.worker_id(i), pool.pid(i)),
            ).fetchone()
            if not (row and row[0]):
                return False
        return True

    wait_for(ready, timeout=timeout, interval=0.05, what="workers registered and listening")


@contextlib.contextmanager
def provider() -> Iterator[ProviderProcess]:
    p = ProviderProcess()
    try:
        yield p
    finally:
        with shielded():
            p.stop()
            p.log.close()
            with contextlib.suppress(OSError):
                os.unlink(p.log.name)


def stop_on_sigterm() -> None:
    """SIGTERM unwinds like Ctrl-C, so workers, provider and cluster are cleaned up."""

    def handler(signum: int, frame: object) -> None:
        signal.signal(signal.SIGTERM, signal.SIG_IGN)  # one is enough: let cleanup finish
        raise KeyboardInterrupt(f"signal {signum}")

    signal.signal(signal.SIGTERM, handler)


@contextlib.contextmanager
def shielded() -> Iterator[None]:
    """Cleanup that a SIGTERM (or Ctrl-C) arriving meanwhile must not cut short."""
    old_term = signal.signal(signal.SIGTERM, signal.SIG_IGN)
    old_int = signal.signal(signal.SIGINT, signal.SIG_IGN)
    try:
        yield
    finally:
        signal.signal(signal.SIGTERM, old_term)
        signal.signal(signal.SIGINT, old_int)


# -- CPU accounting (Linux /proc; zero where unavailable) ------------------------------

_TICK = os.sysconf("SC_CLK_TCK") if hasattr(os, "sysconf") else 100


def proc_cpu(pid: int, *, children: bool = False) -> float:
    """CPU seconds (user + system, all threads) of one process; with ``children``, also
    of its exited and reaped children (how the postmaster keeps closed backends' time)."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            fields = f.read().rsplit(")", 1)[1].split()
        return sum(int(x) for x in fields[11 : 15 if children else 13]) / _TICK
    except (OSError, IndexError, ValueError):
        return 0.0


def postmaster_pid(url: str) -> int | None:
    """The local postmaster serving ``url``, or None when the server is not on this machine."""
    try:
        with psycopg.connect(url, autocommit=True) as conn:
            row = conn.execute("SELECT pg_backend_pid()").fetchone()
        backend = int(row[0]) if row else 0
        with open(f"/proc/{backend}/comm") as f:
            if f.read().strip() != "postgres":
                return None
        with open(f"/proc/{backend}/stat") as f:
            return int(f.read().rsplit(")", 1)[1].split()[1])
    except (OSError, ValueError, psycopg.Error):
        return None


def postgres_cpu(postmaster: int | None) -> float:
    """CPU seconds of one local cluster: the postmaster, its live children, and (through the
    postmaster's cutime) its exited ones. Other clusters on the machine are not counted."""
    if postmaster is None:
        return 0.0
    total = proc_cpu(postmaster, children=True)
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/stat") as f:
                if int(f.read().rsplit(")", 1)[1].split()[1]) != postmaster:
                    continue
        except (OSError, ValueError, IndexError):
            continue
        total += proc_cpu(int(entry))
    return total


def machine_busy() -> tuple[float, float]:
    """(busy, total) CPU seconds of the whole machine since boot."""
    with open("/proc/stat") as f:
        parts = [int(x) for x in f.readline().split()[1:]]
    idle = parts[3] + (parts[4] if len(parts) > 4 else 0)
    total = sum(parts[:8])
    return (total - idle) / _TICK, total / _TICK


@dataclass
class CpuSnapshot:
    at: float
    workers: float
    postgres: float
    me: float
    extra: float
    busy: float
    total: float


def cpu_snapshot(
    pids: Sequence[int], postmaster: int | None, extra: Sequence[int] = ()
) -> CpuSnapshot:
    busy, total = machine_busy()
    return CpuSnapshot(
        at=time.monotonic(),
        workers=sum(proc_cpu(p) for p in pids),
        postgres=postgres_cpu(postmaster),
        me=proc_cpu(os.getpid()),
        extra=sum(proc_cpu(p) for p in extra),
        busy=busy,
        total=total,
    )


def cpu_delta(a: CpuSnapshot, b: CpuSnapshot) -> dict[str, float]:
    """Cores used over the interval, per consumer (1.0 = one core busy all the time)."""
    wall = max(b.at - a.at, 1e-9)
    ncpu = os.cpu_count() or 1
    return {
        "workers": (b.workers - a.workers) / wall,
        "postgres": (b.postgres - a.postgres) / wall,
        "me": (b.me - a.me) / wall,
        "extra": (b.extra - a.extra) / wall,
        "machine": (b.busy - a.busy) / max(b.total - a.total, 1e-9) * ncpu,
    }


def others(cpu: dict[str, float]) -> float:
    """Cores used by processes that are not part of this benchmark (other jobs)."""
    return max(0.0, cpu["machine"] - cpu["workers"] - cpu["postgres"] - cpu["me"] - cpu["extra"])


def background_load(seconds: float = 2.0) -> float:
    """Cores busy on the machine over ``seconds`` before the benchmark starts anything."""
    busy0, total0 = machine_busy()
    time.sleep(seconds)
    busy1, total1 = machine_busy()
    return (busy1 - busy0) / max(total1 - total0, 1e-9) * (os.cpu_count() or 1)


def load_note(cores: float) -> str:
    note = f"machine busy before start: {cores:.2f} of {os.cpu_count()} cores"
    if cores > 0.2:
        note += " (other jobs are running: expect lower and noisier numbers)"
    return note


# -- output ------------------------------------------------------------------------------


def table(headers: Sequence[str], rows: Sequence[Sequence[Any]]) -> str:
    """A GitHub-markdown table (pastes straight into bench/README.md)."""
    cells = [[str(h) for h in headers]] + [[str(c) for c in r] for r in rows]
    widths = [max(len(r[i]) for r in cells) for i in range(len(headers))]
    lines = [
        "| " + " | ".join(c.ljust(w) for c, w in zip(cells[0], widths, strict=True)) + " |",
        "|" + "|".join("-" * (w + 2) for w in widths) + "|",
    ]
    for r in cells[1:]:
        lines.append("| " + " | ".join(c.rjust(w) for c, w in zip(r, widths, strict=True)) + " |")
    return "\n".join(lines)


def summary(values: Sequence[float]) -> tuple[float, float, float]:
    return min(values), statistics.median(values), max(values)
