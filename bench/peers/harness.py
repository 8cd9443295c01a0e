"""Worker processes, one measured batch, and what is computed from it.

One batch: a fresh database, ``runs`` runs submitted, then the workers started. While
they work, a monitor connection reads the progress every ``--sample-seconds`` and the
CPU counters are read with it. When every run is finished, the workers are stopped
(SIGTERM, then SIGKILL) and the counters are read once more:

- calls/s: from the database's own completion timestamps of the tool calls (steps),
  ``0.8 * calls / (t[90 %] - t[10 %])``, so neither the start-up of the workers nor the
  tail of the last runs is counted;
- CPU per call: the worker processes (``/proc/<pid>/stat`` utime + stime, all threads)
  and the cluster (postmaster, every child, and the exited children's time the
  postmaster reaped), between the first samples at or past 10 % and 90 % of the calls;
- transactions per call: the database's ``xact_commit + xact_rollback``
  (``pg_stat_database``) from just before the workers start to just after the last of
  their sessions has gone, less the monitor's own statements, over all the calls.
"""

from __future__ import annotations

import contextlib
import itertools
import os
import shutil
import signal
import statistics
import subprocess
import tempfile
import time
import uuid
from collections.abc import Sequence
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any, Protocol

import psycopg

from _common import machine_busy, postgres_cpu, proc_cpu, say, shielded
from peers.cluster import Cluster

CALLS_PER_RUN = 9  # 3 turns x 3 tool calls (steps)
BENCH_DIR = Path(__file__).resolve().parent.parent


class Procs:
    """Worker processes of one batch, each with its log file."""

    def __init__(self, name: str) -> None:
        self.name = name
        self.procs: list[subprocess.Popen[bytes]] = []
        self._dir = Path(tempfile.mkdtemp(prefix=f"peers-{name}-"))

    def start(self, cmd: Sequence[str], env: dict[str, str] | None = None) -> None:
        log = (self._dir / f"{len(self.procs)}.log").open("ab")
        path = os.pathsep.join(filter(None, [str(BENCH_DIR), os.environ.get("PYTHONPATH")]))
        full_env = {**os.environ, "PYTHONUNBUFFERED": "1", "PYTHONPATH": path}
        try:
            self.procs.append(
                subprocess.Popen(
                    list(cmd),
                    env={**full_env, **(env or {})},
                    stdout=log,
                    stderr=log,
                    cwd=BENCH_DIR,
                    start_new_session=True,  # Ctrl-C reaches the benchmark, not them
                )
            )
        finally:
            log.close()

    def log(self, i: int) -> str:
        path = self._dir / f"{i}.log"
        return path.read_text(errors="replace") if path.exists() else ""

    def check(self) -> None:
        for i, p in enumerate(self.procs):
            if p.poll() is not None:
                raise RuntimeError(
                    f"{self.name} worker {i} exited with {p.returncode}:\n{self.log(i)[-3000:]}"
                )

    def cpu(self) -> float:
        return sum(proc_cpu(p.pid) for p in self.procs)

    def rss_mb(self) -> float:
        """The largest resident set of one worker process now, in MB (VmRSS)."""
        largest = 0.0
        for p in self.procs:
            with contextlib.suppress(OSError):
                for line in Path(f"/proc/{p.pid}/status").read_text().splitlines():
                    if line.startswith("VmRSS:"):
                        largest = max(largest, int(line.split()[1]) / 1024)
        return largest

    def stop(self, timeout: float = 10.0) -> None:
        for p in self.procs:
            if p.poll() is None:
                with contextlib.suppress(ProcessLookupError):
                    os.kill(p.pid, signal.SIGTERM)
        deadline = time.monotonic() + timeout
        for p in self.procs:
            try:
                p.wait(timeout=max(0.1, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                with contextlib.suppress(ProcessLookupError):
                    os.kill(p.pid, signal.SIGKILL)
                p.wait(timeout=10)
        shutil.rmtree(self._dir, ignore_errors=True)


class Side(Protocol):
    """One system under test."""

    name: str

    def setup(self, sequential: bool) -> str: ...

    def prepare(self, cluster: Cluster) -> None: ...

    def fresh(self, cluster: Cluster) -> tuple[str, str]:
        """A new database for one batch: (name, URL)."""
        ...

    def submit(self, url: str, runs: int) -> None: ...

    def start(self, url: str, sequential: bool, procs: Procs) -> None: ...

    def progress(self, conn: psycopg.Connection[Any]) -> tuple[int, int]:
        """(completed calls, finished runs), in exactly one statement."""
        ...

    def call_times(self, conn: psycopg.Connection[Any]) -> list[tuple[str, float]]:
        """(run, epoch seconds) at which each completed call was recorded."""
        ...

    def failures(self, conn: psycopg.Connection[Any]) -> int: ...


@dataclass
class Sample:
    at: float
    calls: int
    workers: float
    postgres: float
    me: float
    busy: float
    total: float
    rss_mb: float


@dataclass
class Batch:
    system: str
    rep: int
    kind: str  # "throughput" or "sequential"
    setup: str
    runs: int
    calls: int
    calls_per_s: float
    cycle_ms_per_call: float  # sequential batches: the median run, per call
    xacts: int
    xact_per_call: float
    worker_ms_per_call: float
    postgres_ms_per_call: float
    other_cores: float
    wall_s: float
    submit_s: float
    worker_rss_mb: float = float("nan")  # the largest worker process's peak VmRSS

    def as_dict(self) -> dict[str, Any]:
        return asdict(self)


def rate_10_90(times: Sequence[float]) -> float:
    """Calls per second between the 10 % and the 90 % completed call."""
    t = sorted(times)
    if len(t) < 10:
        raise RuntimeError(f"only {len(t)} completion timestamps")
    i, j = round(0.1 * (len(t) - 1)), round(0.9 * (len(t) - 1))
    span = t[j] - t[i]
    return (j - i) / span if span > 0 else float("nan")


def cycle_ms_per_call(times: Sequence[tuple[str, float]]) -> float:
    """Median time from one run's last call to the next run's last call, per call.

    Only meaningful for one run at a time: that interval is one whole run (claim,
    decisions, calls, finish). The median ignores a stall of the shared machine that a
    rate over the whole batch would spread over every call."""
    last: dict[str, float] = {}
    for run, t in times:
        last[run] = max(t, last.get(run, t))
    ends = sorted(last.values())
    gaps = [b - a for a, b in itertools.pairwise(ends)]
    return statistics.median(gaps) / CALLS_PER_RUN * 1000 if gaps else float("nan")


def window(samples: Sequence[Sample], calls: int) -> tuple[Sample, Sample]:
    """The first samples at or past 10 % and 90 % of the calls."""
    lo = next(s for s in samples if s.calls >= 0.1 * calls)
    hi = next(s for s in samples if s.calls >= 0.9 * calls)
    if hi.calls <= lo.calls:  # all in one sample interval: take the whole batch
        lo, hi = samples[0], samples[-1]
    return lo, hi


def sample(calls: int, procs: Procs, postmaster: int) -> Sample:
    busy, total = machine_busy()
    return Sample(
        at=time.monotonic(),
        calls=calls,
        workers=procs.cpu(),
        postgres=postgres_cpu(postmaster),
        me=proc_cpu(os.getpid()),
        busy=busy,
        total=total,
        rss_mb=procs.rss_mb(),
    )


def measure(
    side: Side,
    cluster: Cluster,
    *,
    rep: int,
    runs: int,
    sequential: bool,
    sample_seconds: float,
) -> Batch:
    dbname, url = side.fresh(cluster)
    t0 = time.monotonic()
    side.submit(url, runs)
    submit_s = time.monotonic() - t0
    expected = runs * CALLS_PER_RUN
    procs = Procs(side.name)
    with psycopg.connect(url, autocommit=True) as mon:
        me = mon.info.backend_pid
        cluster.wait_no_clients(dbname, keep=me)
        mon.execute("SELECT pg_stat_force_next_flush()")  # counted in x0
        x0 = cluster.xacts(dbname)
        own = 0
        samples: list[Sample] = []
        started = time.monotonic()
        deadline = started + 120 + runs * CALLS_PER_RUN / 20
        try:
            side.start(url, sequential, procs)
            while True:
                procs.check()
                calls, finished = side.progress(mon)
                own += 1
                samples.append(sample(calls, procs, cluster.postmaster))
                if finished >= runs:
                    break
                if time.monotonic() > deadline:
                    raise RuntimeError(
                        f"{side.name}: {finished} of {runs} runs finished in "
                        f"{time.monotonic() - started:.0f} s"
                    )
                time.sleep(sample_seconds)
        finally:
            wall = time.monotonic() - started
            with shielded():
                procs.stop()
        cluster.wait_no_clients(dbname, keep=me)
        mon.execute("SELECT pg_stat_force_next_flush()")
        own += 1
        x1 = cluster.xacts(dbname)
        times = side.call_times(mon)
        bad = side.failures(mon)
    if bad:
        raise RuntimeError(f"{side.name}: {bad} run(s) did not succeed")
    if len(times) != expected:
        raise RuntimeError(f"{side.name}: {len(times)} completed calls, expected {expected}")
    lo, hi = window(samples, expected)
    n = max(hi.calls - lo.calls, 1)
    wall_w = max(hi.at - lo.at, 1e-9)
    machine = (hi.busy - lo.busy) / max(hi.total - lo.total, 1e-9) * (os.cpu_count() or 1)
    ours = (hi.workers - lo.workers) + (hi.postgres - lo.postgres) + (hi.me - lo.me)
    xacts = x1 - x0 - own
    batch = Batch(
        system=side.name,
        rep=rep,
        kind="sequential" if sequential else "throughput",
        setup=side.setup(sequential),
        runs=runs,
        calls=expected,
        calls_per_s=rate_10_90([t for _, t in times]),
        cycle_ms_per_call=cycle_ms_per_call(times) if sequential else float("nan"),
        xacts=xacts,
        xact_per_call=xacts / expected,
        worker_ms_per_call=(hi.workers - lo.workers) / n * 1000,
        postgres_ms_per_call=(hi.postgres - lo.postgres) / n * 1000,
        other_cores=max(0.0, machine - ours / wall_w),
        wall_s=wall,
        submit_s=submit_s,
        worker_rss_mb=max(s.rss_mb for s in samples),
    )
    say(
        f"  {batch.kind}: {batch.calls_per_s:.0f} calls/s, {batch.xact_per_call:.2f} xact/call, "
        f"CPU {batch.worker_ms_per_call:.2f} + {batch.postgres_ms_per_call:.2f} ms/call, "
        f"other jobs {batch.other_cores:.2f} cores, worker RSS {batch.worker_rss_mb:.0f} MB, "
        f"{wall:.1f} s"
    )
    cluster.drop(dbname)
    return batch


def unique(prefix: str) -> str:
    return f"{prefix}_{uuid.uuid4().hex[:8]}"
