"""A dedicated, durable throwaway PostgreSQL cluster for the peer benchmark.

Unlike the test clusters of :mod:`runledger.testing.postgres` (``fsync=off``), this one
keeps PostgreSQL's durable defaults: ``fsync``, ``synchronous_commit`` and
``full_page_writes`` on, so every commit waits for its WAL flush, as in production.
As root, the cluster runs as the ``postgres`` user (PostgreSQL refuses to run as root).
"""

from __future__ import annotations

import contextlib
import os
import pwd
import shutil
import socket
import subprocess
import tempfile
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import psycopg
from psycopg import sql

from runledger.testing.postgres import url_with_dbname

from _common import shielded

DEFAULT_BIN = Path("/usr/lib/postgresql/15/bin")
SETTINGS = (
    "fsync=on",
    "synchronous_commit=on",
    "full_page_writes=on",
    "max_connections=200",
    "shared_buffers=128MB",
    "log_min_messages=warning",
)


@dataclass
class Cluster:
    admin_url: str
    version: str
    postmaster: int
    pgdata: Path
    bin_dir: Path
    _created: list[str] = field(default_factory=list)

    def url_for(self, dbname: str) -> str:
        return url_with_dbname(self.admin_url, dbname)

    def admin(self) -> psycopg.Connection[Any]:
        return psycopg.connect(self.admin_url, autocommit=True)

    def create(self, name: str, template: str | None = None) -> str:
        """A new database (a copy of ``template`` when given); returns its URL."""
        stmt = sql.SQL("CREATE DATABASE {}").format(sql.Identifier(name))
        if template:
            stmt = sql.SQL("CREATE DATABASE {} TEMPLATE {}").format(
                sql.Identifier(name), sql.Identifier(template)
            )
        with self.admin() as conn:
            conn.execute(stmt)
        self._created.append(name)
        return self.url_for(name)

    def drop(self, name: str) -> None:
        with self.admin() as conn:
            conn.execute(
                sql.SQL("DROP DATABASE IF EXISTS {} WITH (FORCE)").format(sql.Identifier(name))
            )

    def xacts(self, dbname: str) -> int:
        """Committed plus rolled-back transactions of one database (pg_stat_database),
        read from the admin database so that reading it counts for no other."""
        with self.admin() as conn:
            row = conn.execute(
                "SELECT xact_commit + xact_rollback FROM pg_stat_database WHERE datname = %s",
                (dbname,),
            ).fetchone()
        return int(row[0]) if row else 0

    def wait_no_clients(self, dbname: str, keep: int | None, timeout: float = 30.0) -> None:
        """Until no client backend but ``keep`` (a backend pid) is connected to ``dbname``:
        a backend flushes its statistics when it exits, before it leaves pg_stat_activity."""
        deadline = time.monotonic() + timeout
        with self.admin() as conn:
            while True:
                row = conn.execute(
                    "SELECT count(*) FROM pg_stat_activity WHERE datname = %s "
                    "AND backend_type = 'client backend' AND pid IS DISTINCT FROM %s",
                    (dbname, keep),
                ).fetchone()
                if row and row[0] == 0:
                    return
                if time.monotonic() > deadline:
                    raise RuntimeError(f"{row[0] if row else '?'} sessions stay on {dbname}")
                time.sleep(0.05)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _as_postgres() -> dict[str, Any]:
    """subprocess arguments that run a command as ``postgres`` when we are root."""
    if os.geteuid() != 0:
        return {}
    user = pwd.getpwnam("postgres")
    return {"user": user.pw_uid, "group": user.pw_gid, "extra_groups": []}


@contextlib.contextmanager
def durable_cluster(bin_dir: Path = DEFAULT_BIN) -> Iterator[Cluster]:
    """initdb + pg_ctl start on a free loopback port; stopped and removed on exit."""
    if not (bin_dir / "initdb").is_file():
        raise RuntimeError(f"no initdb in {bin_dir} (use --pg-bin)")
    run_as = _as_postgres()
    base = Path(tempfile.mkdtemp(prefix="runledger-peers-"))
    pgdata = base / "data"
    pgdata.mkdir()
    if run_as:
        os.chmod(base, 0o755)
        os.chown(pgdata, run_as["user"], run_as["group"])
    out = tempfile.TemporaryFile("w+")  # noqa: SIM115 - the postmaster inherits it
    kwargs: dict[str, Any] = {
        "check": True,
        "stdout": out,
        "stderr": subprocess.STDOUT,
        "text": True,
        "env": dict(os.environ, LC_ALL="C", LANG="C"),
        **run_as,
    }
    started = False
    try:
        try:
            subprocess.run(
                [str(bin_dir / "initdb"), "-D", str(pgdata), "-U", "postgres",
                 "--auth=trust", "--encoding=UTF8"],
                timeout=180,
                **kwargs,
            )  # fmt: skip
            port = _free_port()
            options = " ".join(
                [f"-c listen_addresses=127.0.0.1 -c port={port}"]
                + [f"-c unix_socket_directories={pgdata}"]
                + [f"-c {s}" for s in SETTINGS]
            )
            subprocess.run(
                [str(bin_dir / "pg_ctl"), "-D", str(pgdata), "-l", str(pgdata / "server.log"),
                 "-o", options, "-w", "-t", "60", "start"],
                timeout=90,
                **kwargs,
            )  # fmt: skip
        except subprocess.CalledProcessError as exc:
            out.seek(0)
            log = pgdata / "server.log"
            raise RuntimeError(
                f"{exc.cmd[0]} failed: {out.read()}\n{log.read_text() if log.exists() else ''}"
            ) from exc
        started = True
        admin = f"postgresql://postgres@127.0.0.1:{port}/postgres"
        with psycopg.connect(admin, autocommit=True) as conn:
            row = conn.execute("SHOW server_version").fetchone()
            version = str(row[0]) if row else "?"
            for setting in ("fsync", "synchronous_commit", "full_page_writes"):
                value = conn.execute(f"SHOW {setting}").fetchone()
                if not value or value[0] != "on":
                    raise RuntimeError(f"the benchmark cluster has {setting}={value}")
        postmaster = int((pgdata / "postmaster.pid").read_text().split()[0])
        yield Cluster(admin, version, postmaster, pgdata, bin_dir)
    finally:
        with shielded():  # a second Ctrl-C must not leave the cluster running
            if started:
                subprocess.run(
                    [str(bin_dir / "pg_ctl"), "-D", str(pgdata), "-m", "immediate", "-w", "stop"],
                    timeout=60,
                    **{**kwargs, "check": False},
                )
            out.close()
            shutil.rmtree(base, ignore_errors=True)
