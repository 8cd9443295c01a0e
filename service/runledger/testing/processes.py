"""Real processes for tests: worker processes you can kill, pause and restart, and the
fake provider in its own process. Waiting is always on a condition with a deadline.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import IO, TYPE_CHECKING, Any, TypeVar

import psycopg

from runledger.db import harness

if TYPE_CHECKING:
    from runledger.testing.provider import ProviderClient

PROVIDER_SCRIPT = Path(__file__).with_name("provider.py")

T = TypeVar("T")


def wait_for(
    predicate: Callable[[], T], timeout: float = 30.0, interval: float = 0.02, what: str = ""
) -> T:
    """Poll ``predicate`` until it returns something truthy; fail after ``timeout`` s."""
    deadline = time.monotonic() + timeout
    last: Any = None
    while True:
        last = predicate()
        if last:
            return last  # type: ignore[no-any-return]
        if time.monotonic() >= deadline:
            raise AssertionError(
                f"timed out after {timeout} s waiting for {what or predicate} (last value {last!r})"
            )
        time.sleep(interval)


class ProviderProcess:
    """The fake provider (:mod:`runledger.testing.provider`) in its own process, on a free port.

    It runs the module's file as a script: it needs only the standard library, and that
    skips importing runledger (a second off every test that starts one).
    """

    def __init__(
        self, host: str = "127.0.0.1", *, log: Path | None = None, new_session: bool = False
    ) -> None:
        """``log``: where its stderr goes (default: a temporary file, removed by
        :meth:`stop`); ``new_session``: in a session of its own, out of reach of the
        terminal's Ctrl-C and hang-up (for a provider that may outlive its starter, see
        :meth:`detach`)."""
        self.log: IO[str] = (
            log.open("w+")
            if log is not None
            else tempfile.NamedTemporaryFile(  # noqa: SIM115 - lives as long as the process
                "w+", prefix="runledger-provider-", delete=False
            )
        )
        self.detached = False
        self.proc = subprocess.Popen(
            [sys.executable, "-u", "-I", str(PROVIDER_SCRIPT), "--host", host, "--port", "0"],
            stdout=subprocess.PIPE,
            stderr=self.log,
            text=True,
            start_new_session=new_session,
        )
        assert self.proc.stdout is not None
        line = self.proc.stdout.readline()
        if "listening on" not in line:
            self.proc.kill()
            raise RuntimeError(f"provider did not start: {line!r}")
        self.url = line.rsplit(" ", 1)[1].strip()
        from runledger.testing.provider import ProviderClient

        self.client: ProviderClient = ProviderClient(self.url)

    def stop(self) -> None:
        """Kill it and remove its log; once :meth:`detach` was called, nothing."""
        if self.detached:
            return
        if self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait(timeout=10)
        if self.proc.stdout is not None:
            self.proc.stdout.close()
        self.log.close()
        with contextlib.suppress(OSError):
            os.unlink(self.log.name)

    def detach(self) -> int:
        """Leave it running when this process ends (it writes nothing more to the pipe it
        was started with); :meth:`stop` does nothing after. Returns its pid: whoever keeps
        it must end it."""
        self.detached = True
        if self.proc.stdout is not None:
            self.proc.stdout.close()
        self.log.close()
        return self.proc.pid


class WorkerPool:
    """N ``runledger worker`` processes against one database.

    ``kill(i)`` SIGKILL, ``stop(i)`` SIGSTOP, ``cont(i)`` SIGCONT, ``terminate(i)``
    SIGTERM, ``restart(i)`` starts worker *i* again (same worker id). Each worker's
    stderr goes to a log file (``log(i)``). ``holder(run_id)`` is the index of the
    worker holding a run's lease, ``kill_holder(run_id)`` SIGKILLs it.
    """

    def __init__(
        self,
        database_url: str,
        flows: Sequence[str],
        *,
        env: dict[str, str] | None = None,
        args: Sequence[str] = (),
        cwd: str | None = None,
    ) -> None:
        self.database_url = database_url
        self.flows = list(flows)
        self.env = dict(env or {})
        self.args = list(args)
        self.cwd = cwd
        self.procs: list[subprocess.Popen[bytes]] = []
        self.logs: list[Path] = []
        self.extra_env: list[dict[str, str]] = []
        self.extra_args: list[list[str]] = []
        self._dir = Path(tempfile.mkdtemp(prefix="runledger-workers-"))

    def worker_id(self, i: int) -> str:
        return f"w{i}"

    def start(
        self, n: int = 1, *, env: dict[str, str] | None = None, args: Sequence[str] = ()
    ) -> list[int]:
        """Start ``n`` more workers; returns their indexes."""
        if not self.flows:
            raise ValueError(
                "no flows for the workers: set pool.flows = ['myapp.flows:flow'] "
                "(or override the runledger_flows fixture) before starting them"
            )
        started = []
        for _ in range(n):
            i = len(self.procs)
            self.extra_env.append(dict(env or {}))
            self.extra_args.append(list(args))
            self.logs.append(self._dir / f"worker-{i}.log")
            self.procs.append(self._spawn(i))
            started.append(i)
        return started

    def _spawn(self, i: int) -> subprocess.Popen[bytes]:
        cmd = [sys.executable, "-m", "runledger", "worker", "--worker-id", self.worker_id(i)]
        for spec in self.flows:
            cmd += ["--flows", spec]
        cmd += self.args + self.extra_args[i]
        env = {
            **os.environ,
            **self.env,
            **self.extra_env[i],
            "RUNLEDGER_DATABASE_URL": self.database_url,
            "PYTHONUNBUFFERED": "1",
            "RUNLEDGER_TESTING": "1",  # crash points are honoured only in tests
        }
        log = self.logs[i].open("ab")
        try:
            return subprocess.Popen(
                cmd, env=env, stdout=log, stderr=log, cwd=self.cwd, start_new_session=True
            )
        finally:
            log.close()

    def pid(self, i: int) -> int:
        return self.procs[i].pid

    def signal(self, i: int, sig: signal.Signals) -> None:
        if self.procs[i].poll() is None:
            os.kill(self.procs[i].pid, sig)

    def kill(self, i: int) -> None:
        self.signal(i, signal.SIGKILL)
        self.procs[i].wait(timeout=30)

    def stop(self, i: int) -> None:
        self.signal(i, signal.SIGSTOP)

    def cont(self, i: int) -> None:
        self.signal(i, signal.SIGCONT)

    def terminate(self, i: int) -> None:
        self.signal(i, signal.SIGTERM)

    def alive(self, i: int) -> bool:
        return self.procs[i].poll() is None

    def returncode(self, i: int) -> int | None:
        return self.procs[i].poll()

    def wait(self, i: int, timeout: float = 30.0) -> int:
        return self.procs[i].wait(timeout=timeout)

    def restart(self, i: int, *, env: dict[str, str] | None = None) -> None:
        """Start worker ``i`` again with its id and arguments (killing it first if alive)."""
        if self.alive(i):
            self.kill(i)
        if env is not None:
            self.extra_env[i] = dict(env)
        self.procs[i] = self._spawn(i)

    def holder(
        self,
        run_id: str,
        conn: psycopg.Connection[Any] | str | None = None,
        *,
        timeout: float = 30.0,
    ) -> int:
        """The index of the live worker of this pool that holds ``run_id``.

        Waits (up to ``timeout`` s) until the run is ``running`` with ``runs.lease_owner``
        the id of one of this pool's workers that is still alive. ``conn`` is a psycopg
        connection or a URL; by default the pool's database.
        """
        by_id = {self.worker_id(i): i for i in range(len(self.procs))}

        def current(c: psycopg.Connection[Any]) -> int | None:
            owner = harness.running_holder(c, run_id)
            i = by_id.get(owner) if owner is not None else None
            return i if i is not None and self.alive(i) else None

        def find(c: psycopg.Connection[Any]) -> int:
            def held() -> tuple[int, ...]:
                i = current(c)
                return () if i is None else (i,)  # a tuple: worker 0 is truthy too

            return wait_for(
                held, timeout=timeout, what=f"a live worker of this pool holding run {run_id}"
            )[0]

        if isinstance(conn, psycopg.Connection):
            return find(conn)
        with psycopg.connect(conn or self.database_url, autocommit=True) as c:
            return find(c)

    def kill_holder(
        self,
        run_id: str,
        conn: psycopg.Connection[Any] | str | None = None,
        *,
        timeout: float = 30.0,
    ) -> int:
        """SIGKILL the worker holding ``run_id`` (see :meth:`holder`); returns its index."""
        i = self.holder(run_id, conn, timeout=timeout)
        self.kill(i)
        return i

    def log(self, i: int) -> str:
        return self.logs[i].read_text(errors="replace") if self.logs[i].exists() else ""

    def close(self) -> None:
        """Kill every worker still running and remove the logs."""
        for proc in self.procs:
            if proc.poll() is None:
                os.kill(proc.pid, signal.SIGCONT)
                os.kill(proc.pid, signal.SIGKILL)
                proc.wait(timeout=30)
        shutil.rmtree(self._dir, ignore_errors=True)
