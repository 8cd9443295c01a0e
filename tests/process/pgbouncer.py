"""A real PgBouncer (Debian's ``pgbouncer`` package) in front of a test cluster.

:func:`pgbouncer` starts one on a free loopback port, in ``pool_mode`` ``session`` or
``transaction``, trusting every client (``auth_type = trust``; the clusters trust the
loopback too), with ``*`` pointed at the cluster, so every database of the cluster is
reached through it under its own name. PgBouncer refuses to run as root: as root it runs
as the ``postgres`` user, as the clusters do. It runs in the foreground, its log in its
directory; everything is removed when the context ends.

No ``pgbouncer`` binary: the test is skipped, saying how to install it, except under
``CI=true``, where it fails (``scripts/test`` installs it).
"""

from __future__ import annotations

import contextlib
import os
import pwd
import shutil
import signal
import socket
import subprocess
import tempfile
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import psycopg
import pytest
from psycopg.conninfo import conninfo_to_dict

from runledger.testing import wait_for
from runledger.testing.postgres import url_with_dbname

BINARY = (
    os.environ.get("RUNLEDGER_TEST_PGBOUNCER")
    or shutil.which("pgbouncer")
    or ("/usr/sbin/pgbouncer")
)


def require_binary() -> str:
    """The pgbouncer binary; a skip without it, a failure under CI (``CI=true``)."""
    if os.access(BINARY, os.X_OK):
        return BINARY
    why = (
        f"no pgbouncer at {BINARY}: apt-get install pgbouncer (scripts/test does), or set "
        "RUNLEDGER_TEST_PGBOUNCER"
    )
    if os.environ.get("CI", "").lower() in ("1", "true", "yes"):
        pytest.fail(why)
    pytest.skip(why)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _user() -> pwd.struct_passwd | None:
    if os.geteuid() != 0:
        return None
    for name in ("postgres", "runledger_pg"):
        with contextlib.suppress(KeyError):
            return pwd.getpwnam(name)
    pytest.fail("running as root and no postgres user to run pgbouncer as")


@dataclass
class Bouncer:
    mode: str
    port: int
    base: Path
    proc: subprocess.Popen[bytes]
    binary: str = ""
    spawn: dict[str, Any] | None = None  # how it was started (its user), to start again

    def kill(self) -> None:
        """SIGKILL: every client connection drops at once, as in a crash."""
        self.proc.kill()
        self.proc.wait(timeout=10)

    def start(self) -> None:
        """Start it again, on its port with its settings (after :meth:`kill`)."""
        out = (self.base / "stdout.log").open("ab")
        self.proc = subprocess.Popen(
            [self.binary, str(self.base / "pgbouncer.ini")],
            stdout=out,
            stderr=subprocess.STDOUT,
            start_new_session=True,
            **(self.spawn or {}),
        )
        out.close()

    def url(self, database_url: str) -> str:
        """``database_url``'s database, user and parameters, through this PgBouncer."""
        info = {k: str(v) for k, v in conninfo_to_dict(database_url).items()}
        info["host"], info["port"] = "127.0.0.1", str(self.port)
        dbname = info.pop("dbname")
        rebuilt = " ".join(f"{k}='{v}'" for k, v in info.items())
        return url_with_dbname(rebuilt, dbname)

    def log(self) -> str:
        path = self.base / "pgbouncer.log"
        return path.read_text(errors="replace") if path.exists() else ""


@contextlib.contextmanager
def pgbouncer(server_url: str, mode: str, *, pool_size: int = 100) -> Iterator[Bouncer]:
    """A PgBouncer in ``mode`` in front of the server of ``server_url`` (any database)."""
    binary = require_binary()
    target = conninfo_to_dict(server_url)
    user = _user()
    base = Path(tempfile.mkdtemp(prefix="runledger-pgbouncer-"))
    port = _free_port()
    (base / "users.txt").write_text('"postgres" ""\n')
    (base / "pgbouncer.ini").write_text(
        "[databases]\n"
        f"* = host={target.get('host', '127.0.0.1')} port={target.get('port', '5432')}\n"
        "[pgbouncer]\n"
        "listen_addr = 127.0.0.1\n"
        f"listen_port = {port}\n"
        "unix_socket_dir =\n"
        "auth_type = trust\n"
        f"auth_file = {base / 'users.txt'}\n"
        f"logfile = {base / 'pgbouncer.log'}\n"
        f"pidfile = {base / 'pgbouncer.pid'}\n"
        f"pool_mode = {mode}\n"
        "max_client_conn = 2000\n"
        f"default_pool_size = {pool_size}\n"
        "reserve_pool_size = 0\n"
        "server_reset_query = DISCARD ALL\n"
        "ignore_startup_parameters = extra_float_digits\n"
        "log_connections = 0\n"
        "log_disconnections = 0\n"
    )
    kwargs: dict[str, Any] = {}
    if user is not None:
        os.chmod(base, 0o755)
        for path in (base, *base.iterdir()):
            os.chown(path, user.pw_uid, user.pw_gid)
        kwargs = {"user": user.pw_uid, "group": user.pw_gid, "extra_groups": []}
    out = (base / "stdout.log").open("wb")
    proc = subprocess.Popen(
        [binary, str(base / "pgbouncer.ini")],
        stdout=out,
        stderr=subprocess.STDOUT,
        start_new_session=True,
        **kwargs,
    )
    out.close()
    bouncer = Bouncer(mode=mode, port=port, base=base, proc=proc, binary=binary, spawn=kwargs)
    try:
        probe = bouncer.url(url_with_dbname(server_url, "postgres"))

        def answers() -> bool:
            if bouncer.proc.poll() is not None:
                raise AssertionError(
                    f"pgbouncer exited ({bouncer.proc.returncode}): "
                    f"{(base / 'stdout.log').read_text(errors='replace')}{bouncer.log()}"
                )
            try:
                with psycopg.connect(probe, autocommit=True, connect_timeout=2) as conn:
                    conn.execute("SELECT 1")
                    return True
            except psycopg.OperationalError:
                return False

        wait_for(answers, timeout=30, interval=0.1, what=f"pgbouncer ({mode}) to answer")
        yield bouncer
    finally:
        proc = bouncer.proc  # the one running now, if it was started again
        if proc.poll() is None:
            proc.send_signal(signal.SIGTERM)  # immediate shutdown (SIGINT waits for clients)
            try:
                proc.wait(timeout=10)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait(timeout=10)
        shutil.rmtree(base, ignore_errors=True)
