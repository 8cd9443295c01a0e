"""A real primary and streaming standbys from local binaries, for failover tests.

The primary is an ordinary throwaway cluster with WAL for a standby; the standby is a
``pg_basebackup -R`` copy streaming from it, asynchronously (no
``synchronous_standby_names``). :meth:`Pair.hold_back` points the standby's
``primary_conninfo`` at a closed port, so that from then on nothing the primary commits
reaches it: what a lagging asynchronous standby has not received when its primary dies.
:meth:`Pair.kill_primary` is ``pg_ctl stop -m immediate``; :meth:`Pair.promote` is
``pg_ctl promote -w``. As root the clusters run as the ``postgres`` user (PostgreSQL
refuses root), like :func:`runledger.testing.postgres.start_cluster`.

:func:`start_cluster` starts a primary with more standbys, named ``s1``, ``s2``, ...
(their ``cluster_name``, which the walreceiver sends as ``application_name``), and
optionally a ``synchronous_standby_names`` naming some of them.
"""

from __future__ import annotations

import contextlib
import os
import pwd
import shutil
import subprocess
import tempfile
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, TypeVar

import psycopg
from psycopg import sql

from runledger.testing import wait_for
from runledger.testing.postgres import NoPostgres

C = TypeVar("C", bound="Cluster")

BIN = Path(os.environ.get("RUNLEDGER_TEST_PG_BIN", "/usr/lib/postgresql/15/bin"))

_OPTIONS = (
    "-c listen_addresses=127.0.0.1 -c port={port} -c unix_socket_directories={data} "
    "-c fsync=off -c full_page_writes=off -c max_connections=200 -c shared_buffers=64MB "
    "-c wal_level=replica -c max_wal_senders=5 -c hot_standby=on "
    "-c wal_receiver_status_interval=1 -c log_min_messages=warning"
)


def free_port() -> int:
    """A TCP port free on loopback now."""
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def cluster_user() -> pwd.struct_passwd | None:
    """The user PostgreSQL runs as: none but the caller, unless that is root."""
    if os.geteuid() != 0:
        return None
    for name in ("postgres", "runledger_pg"):
        with contextlib.suppress(KeyError):
            return pwd.getpwnam(name)
    raise NoPostgres("running as root and no postgres user to run the clusters as")


@dataclass
class Node:
    data: Path
    port: int
    log: Path
    name: str | None = None  # cluster_name, the application_name it streams under

    @property
    def admin_url(self) -> str:
        return f"postgresql://postgres@127.0.0.1:{self.port}/postgres"

    def url(self, dbname: str) -> str:
        return f"postgresql://postgres@127.0.0.1:{self.port}/{dbname}"

    def connect(self, dbname: str = "postgres") -> psycopg.Connection[Any]:
        return psycopg.connect(self.url(dbname), autocommit=True, connect_timeout=5)


@dataclass
class Cluster:
    """A primary and its streaming standbys (all started)."""

    base: Path
    primary: Node
    standbys: list[Node]
    _user: pwd.struct_passwd | None = field(repr=False)

    # -- running the binaries --------------------------------------------------------

    def _run(self, *args: str, check: bool = True) -> subprocess.CompletedProcess[str]:
        kwargs: dict[str, Any] = {}
        if self._user is not None:
            kwargs = {"user": self._user.pw_uid, "group": self._user.pw_gid, "extra_groups": []}
        with tempfile.TemporaryFile("w+") as out:
            done = subprocess.run(
                list(args),
                stdout=out,
                stderr=subprocess.STDOUT,
                text=True,
                timeout=120,
                env=dict(os.environ, LC_ALL="C", LANG="C"),
                check=False,
                **kwargs,
            )
            out.seek(0)
            text = out.read()
        if check and done.returncode != 0:
            raise RuntimeError(f"{' '.join(args)} failed ({done.returncode}): {text}")
        return subprocess.CompletedProcess(done.args, done.returncode, text, "")

    def _start(self, node: Node) -> None:
        options = _OPTIONS.format(port=node.port, data=node.data)
        if node.name is not None:
            options += f" -c cluster_name={node.name}"
        self._run(
            str(BIN / "pg_ctl"),
            "-D",
            str(node.data),
            "-l",
            str(node.log),
            "-o",
            options,
            "-w",
            "-t",
            "60",
            "start",
        )

    # -- replication -----------------------------------------------------------------

    def replication(self) -> dict[str, tuple[str, str]]:
        """``application_name`` -> (``state``, ``sync_state``) of ``pg_stat_replication``
        on the primary."""
        with self.primary.connect() as conn:
            rows = conn.execute(
                "SELECT application_name, state, sync_state FROM pg_stat_replication"
            ).fetchall()
        return {r[0]: (r[1], r[2]) for r in rows}

    def kill_primary(self) -> None:
        self._run(
            str(BIN / "pg_ctl"), "-D", str(self.primary.data), "-m", "immediate", "-w", "stop"
        )

    def stop(self) -> None:
        for node in (self.primary, *self.standbys):
            if (node.data / "postmaster.pid").exists():
                self._run(
                    str(BIN / "pg_ctl"),
                    "-D",
                    str(node.data),
                    "-m",
                    "immediate",
                    "-w",
                    "stop",
                    check=False,
                )
        shutil.rmtree(self.base, ignore_errors=True)


@dataclass
class Pair(Cluster):
    """A primary and its one asynchronous standby (both started)."""

    @property
    def standby(self) -> Node:
        return self.standbys[0]

    # -- the failure -----------------------------------------------------------------

    def streaming(self) -> bool:
        with self.standby.connect() as conn:
            row = conn.execute("SELECT status FROM pg_stat_wal_receiver").fetchone()
        return row is not None and row[0] == "streaming"

    def replayed(self, timeout: float = 30.0) -> None:
        """Wait until the standby has replayed all the primary has written so far (asked
        of their ``postgres`` databases, which exist before a CREATE DATABASE is
        replayed)."""
        with self.primary.connect() as conn:
            row = conn.execute("SELECT pg_current_wal_lsn()").fetchone()
        assert row is not None
        lsn = row[0]

        def caught_up() -> bool:
            with self.standby.connect() as conn:
                got = conn.execute(
                    "SELECT pg_last_wal_replay_lsn() >= %s::pg_lsn", (lsn,)
                ).fetchone()
            return bool(got and got[0])

        wait_for(caught_up, timeout=timeout, what=f"the standby to replay up to {lsn}")

    def hold_back(self) -> None:
        """From now on the standby receives nothing: its primary_conninfo names a closed
        port (the walreceiver restarts with it on reload) and waits until no walreceiver
        streams. What it received so far it replays."""
        closed = free_port()
        with self.standby.connect() as conn:
            conn.execute(
                f"ALTER SYSTEM SET primary_conninfo = 'host=127.0.0.1 port={closed} "
                "user=postgres connect_timeout=1'"
            )
            conn.execute("SELECT pg_reload_conf()")
        wait_for(lambda: not self.streaming(), timeout=30, what="the walreceiver to stop")

    def promote(self) -> None:
        self._run(str(BIN / "pg_ctl"), "-D", str(self.standby.data), "-w", "-t", "60", "promote")


def _build(cls: type[C], standbys: list[str | None]) -> C:
    """initdb and start a primary, pg_basebackup -R a standby from it for each of
    ``standbys`` (its name, or None for one directory ``standby`` without a
    cluster_name), and start them."""
    if not (BIN / "pg_basebackup").is_file():
        raise NoPostgres(f"no PostgreSQL binaries in {BIN} (set RUNLEDGER_TEST_PG_BIN)")
    user = cluster_user()
    base = Path(tempfile.mkdtemp(prefix="runledger-failover-"))
    os.chmod(base, 0o755)
    primary = Node(base / "primary", free_port(), base / "primary.log")
    nodes = [
        Node(base / (name or "standby"), free_port(), base / f"{name or 'standby'}.log", name)
        for name in standbys
    ]
    cluster = cls(base, primary, nodes, user)
    try:
        primary.data.mkdir()
        if user is not None:
            for path in (base, primary.data):
                os.chown(path, user.pw_uid, user.pw_gid)
        cluster._run(
            str(BIN / "initdb"),
            "-D",
            str(primary.data),
            "-U",
            "postgres",
            "--auth=trust",
            "--encoding=UTF8",
            "--no-sync",
        )
        with (primary.data / "pg_hba.conf").open("a") as hba:
            hba.write("host replication all 127.0.0.1/32 trust\n")
        cluster._start(primary)
        for node in nodes:
            cluster._run(
                str(BIN / "pg_basebackup"),
                "-h",
                "127.0.0.1",
                "-p",
                str(primary.port),
                "-U",
                "postgres",
                "-D",
                str(node.data),
                "-R",
                "-X",
                "stream",
                "--no-sync",
            )
            cluster._start(node)
    except BaseException:
        cluster.stop()
        raise
    return cluster


def start_pair() -> Pair:
    """initdb and start a primary, pg_basebackup -R a standby from it, start that, and
    wait until it streams."""
    pair = _build(Pair, [None])
    try:
        wait_for(pair.streaming, timeout=30, what="the standby to stream")
    except BaseException:
        pair.stop()
        raise
    return pair


def start_cluster(n_standbys: int = 2, sync: str | None = None) -> Cluster:
    """A primary and ``n_standbys`` standbys named ``s1``, ``s2``, ..., and wait until
    the primary sees every one streaming. With ``sync`` (e.g. ``'FIRST 1 (s1)'``) that is
    the primary's ``synchronous_standby_names``, set once they stream, as an operator
    (or Patroni) would; the caller waits for the ``sync_state`` it expects."""
    names = [f"s{n}" for n in range(1, n_standbys + 1)]
    cluster = _build(Cluster, [*names])
    try:

        def streaming() -> bool:
            seen = cluster.replication()
            return all(seen.get(name, ("", ""))[0] == "streaming" for name in names)

        wait_for(streaming, timeout=30, what=f"{', '.join(names)} to stream")
        if sync is not None:
            with cluster.primary.connect() as conn:
                conn.execute(
                    sql.SQL("ALTER SYSTEM SET synchronous_standby_names = {}").format(
                        sql.Literal(sync)
                    )
                )
                conn.execute("SELECT pg_reload_conf()")
    except BaseException:
        cluster.stop()
        raise
    return cluster
