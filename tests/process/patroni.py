"""A Patroni cluster for failover tests: one etcd and three Patroni nodes from local
binaries (Debian's ``patroni`` and ``etcd-server``, PostgreSQL from ``BIN``).

:func:`patroni_cluster` starts one etcd (v3 API, Patroni's ``etcd3:`` section) on free
ports with a temporary data directory, then node ``n1``, waits until it leads, then
``n2`` and ``n3``, and waits until the leader sees both streaming, one of them
synchronous (``synchronous_mode: true``). Every wait is on a condition (Patroni's
``GET /cluster``, ``pg_stat_replication``) with a deadline. On exit every process is
killed and every directory removed, also when the test failed; then the tail of each
process's log (etcd's, each node's Patroni with its PostgreSQL) is printed, which
pytest shows with a failed test.

**The leader lives in a network namespace.** ``n1`` (Patroni and its PostgreSQL) runs
inside a namespace from :mod:`tests.process.netns` from the start, reached through the
veth pair's private /30: it listens and advertises itself on the namespace's end.
etcd, ``n2``, ``n3``, the workers and the test stay in the host's namespace; etcd and
the other nodes listen on the host's end of the pair too, so that ``n1`` reaches them.
:meth:`PatroniCluster.cut_leader` takes the namespace's link down: the leader reaches
neither etcd, nor the other nodes, nor the workers, and no one reaches it (packets are
dropped, no reset). Its leader key expires and the synchronous standby is promoted.
Where namespaces cannot be made the test is skipped, saying why; under ``CI=true`` it
fails instead.

**Timing.** ``ttl`` 10 s, ``loop_wait`` 1 s, ``retry_timeout`` 4 s: Patroni requires
``loop_wait + 2 * retry_timeout <= ttl`` (1 + 8 <= 10), so that a leader that cannot
reach etcd demotes itself before its key can expire and another node take over.
(Patroni's later documentation gives 20 as the least ``ttl``; 3.0.2, Debian's, takes 10:
a failover after a crash takes about ``ttl``.)

**No pg_rewind** (``use_pg_rewind: false``): PostgreSQL runs with
``full_page_writes=off`` for speed, as :mod:`tests.process.replication` does, and
pg_rewind refuses a cluster without full page writes. No test needs it: each cluster
lives for one fault, and after a switchover the old leader, shut down cleanly first,
follows the new one without a rewind.

**How clients find the primary.** :meth:`PatroniCluster.url` is the multi-host URL over
all three nodes with ``target_session_attrs=read-write``: libpq tries the hosts in order
and keeps the first that accepts writes. That is what a user without a proxy gives the
workers (docs/failover.md, "Following a promotion"). Patroni's REST health checks
(``GET /primary`` answering 200 on the leader only) are what HAProxy uses to route to
the leader; there is no proxy here, so they are not on the clients' path (the test
reads ``GET /cluster`` only to know who leads).
"""

from __future__ import annotations

import contextlib
import json
import os
import pwd
import shutil
import signal
import subprocess
import tempfile
import time
import urllib.error
import urllib.request
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import psycopg
import pytest

from runledger.testing import wait_for
from tests.process.netns import Namespace, namespace
from tests.process.replication import cluster_user, free_port

BIN = Path(os.environ.get("RUNLEDGER_TEST_PG_BIN", "/usr/lib/postgresql/15/bin"))
PATRONI = shutil.which("patroni") or "/usr/bin/patroni"
PATRONICTL = shutil.which("patronictl") or "/usr/bin/patronictl"
ETCD = shutil.which("etcd") or "/usr/bin/etcd"
SCOPE = "runledger"
NAMES = ("n1", "n2", "n3")

TTL, LOOP_WAIT, RETRY_TIMEOUT = 10, 1, 4
assert LOOP_WAIT + 2 * RETRY_TIMEOUT <= TTL  # Patroni's rule

# as replication.py's _OPTIONS: speed over durability (a test cluster), WAL for standbys
PARAMETERS = {
    "fsync": "off",
    "full_page_writes": "off",
    "max_connections": 200,
    "shared_buffers": "64MB",
    "wal_level": "replica",
    "max_wal_senders": 10,
    "max_replication_slots": 10,
    "hot_standby": "on",
    "wal_receiver_status_interval": 1,
    "log_min_messages": "warning",
    "synchronous_commit": "on",
}


def _ci() -> bool:
    return os.environ.get("CI", "").lower() in ("1", "true", "yes")


def require_binaries() -> None:
    """Patroni, etcd and PostgreSQL's binaries; a skip without them, a failure under CI
    (``scripts/test`` installs them)."""
    missing = [p for p in (PATRONI, PATRONICTL, ETCD) if not os.access(p, os.X_OK)]
    if not (BIN / "initdb").is_file():
        missing.append(str(BIN / "initdb"))
    if missing:
        why = (
            f"missing {', '.join(missing)}: apt-get install patroni etcd-server "
            "(scripts/test does), and PostgreSQL in RUNLEDGER_TEST_PG_BIN"
        )
        if _ci():
            pytest.fail(why)
        pytest.skip(why)


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    # a zombie is dead for our purpose
    with contextlib.suppress(OSError):
        if Path(f"/proc/{pid}/stat").read_text().split(") ", 1)[1].startswith("Z"):
            return False
    return True


def _tail(path: Path, chars: int = 4000) -> str:
    try:
        text = path.read_text(errors="replace")
    except OSError as exc:
        return f"({exc})"
    return text[-chars:]


@dataclass
class Member:
    """One Patroni node: ``addr`` is where its PostgreSQL and REST API listen and what it
    advertises (the namespace's end of the veth pair for ``n1``, the host's end for the
    others, which listen on 127.0.0.1 too)."""

    name: str
    addr: str
    pg_port: int
    api_port: int
    dir: Path
    netns: str | None
    proc: subprocess.Popen[bytes] | None = None

    @property
    def data(self) -> Path:
        return self.dir / "data"

    @property
    def config(self) -> Path:
        return self.dir / "patroni.yml"

    @property
    def log(self) -> Path:
        return self.dir / "patroni.log"

    @property
    def client_host(self) -> str:
        """The address clients in the host's namespace use."""
        return self.addr if self.netns else "127.0.0.1"

    def api(self, path: str, timeout: float = 2.0) -> Any:
        with urllib.request.urlopen(
            f"http://{self.addr}:{self.api_port}{path}", timeout=timeout
        ) as resp:
            return json.loads(resp.read() or b"null")

    def postmaster_pid(self) -> int | None:
        try:
            return int((self.data / "postmaster.pid").read_text().split("\n", 1)[0])
        except (OSError, ValueError):
            return None


@dataclass
class PatroniCluster:
    base: Path
    ns: Namespace
    etcd_port: int
    members: dict[str, Member]
    _user: pwd.struct_passwd | None = field(repr=False)
    etcd: subprocess.Popen[bytes] | None = None
    _dead: set[str] = field(default_factory=set)

    @property
    def etcd_log(self) -> Path:
        return self.base / "etcd.log"

    # -- what Patroni says --------------------------------------------------------------

    def cluster(self) -> dict[str, Any]:
        """Patroni's ``GET /cluster``, from the first member that answers (those in the
        host's namespace first: after a cut, ``n1`` answers no one)."""
        order = sorted(self.members.values(), key=lambda m: (m.netns is not None, m.name))
        last: Exception | None = None
        for m in order:
            if m.name in self._dead:
                continue
            try:
                found: dict[str, Any] = m.api("/cluster")
                return found
            except (OSError, ValueError) as exc:
                last = exc
        raise RuntimeError(f"no Patroni member answers GET /cluster ({last})")

    def roles(self) -> dict[str, str]:
        """member name -> role (``leader``, ``sync_standby``, ``replica``), for the members
        that are running."""
        try:
            found = self.cluster()
        except RuntimeError:
            return {}
        return {
            m["name"]: m["role"] for m in found.get("members", []) if m.get("state") == "running"
        }

    def leader(self) -> str | None:
        return next((n for n, r in self.roles().items() if r == "leader"), None)

    def sync_standby(self) -> str | None:
        return next((n for n, r in self.roles().items() if r == "sync_standby"), None)

    def replication(self) -> dict[str, tuple[str, str]]:
        """``application_name`` (the member name) -> (``state``, ``sync_state``) of
        ``pg_stat_replication`` on the leader."""
        with self.connect() as conn:
            rows = conn.execute(
                "SELECT application_name, state, sync_state FROM pg_stat_replication"
            ).fetchall()
        return {r[0]: (r[1], r[2]) for r in rows}

    def healthy(self) -> bool:
        """A leader, one synchronous and one asynchronous standby, both streaming."""
        roles = self.roles()
        if sorted(roles.values()) != ["leader", "replica", "sync_standby"]:
            return False
        try:
            seen = self.replication()
        except psycopg.Error:
            return False
        return sorted(seen.values()) == [("streaming", "async"), ("streaming", "sync")]

    # -- what clients use ---------------------------------------------------------------

    def url(self, dbname: str) -> str:
        """The multi-host URL over all three nodes, asking for the primary."""
        hosts = ",".join(f"{m.client_host}:{m.pg_port}" for m in self.members.values())
        return f"postgresql://postgres@{hosts}/{dbname}?target_session_attrs=read-write"

    def member_url(self, name: str, dbname: str) -> str:
        m = self.members[name]
        return f"postgresql://postgres@{m.client_host}:{m.pg_port}/{dbname}"

    def connect(self, dbname: str = "postgres") -> psycopg.Connection[Any]:
        """A connection to the primary, through :meth:`url`."""
        return psycopg.connect(self.url(dbname), autocommit=True, connect_timeout=2)

    def port_of(self, name: str) -> int:
        return self.members[name].pg_port

    # -- the faults ---------------------------------------------------------------------

    def switchover(self, candidate: str) -> subprocess.CompletedProcess[str]:
        """``patronictl switchover`` to ``candidate`` now, without asking."""
        leader = self.leader()
        assert leader is not None, "no leader to switch over from"
        done = subprocess.run(
            [
                PATRONICTL,
                "-c",
                str(self.members[candidate].config),
                "switchover",
                "--leader",
                leader,
                "--candidate",
                candidate,
                "--force",
            ],
            capture_output=True,
            text=True,
            timeout=60,
            check=False,
        )
        if done.returncode != 0:
            raise RuntimeError(f"patronictl switchover failed: {done.stdout}{done.stderr}")
        return done

    def kill_leader(self) -> str:
        """SIGKILL the leader's Patroni and its postmaster, back to back: a crash of the
        node, not a clean stop (the backends exit when they see the postmaster gone).
        Returns its name."""
        leader = self.leader()
        assert leader is not None, "no leader to kill"
        m = self.members[leader]
        pid = m.postmaster_pid()
        assert m.proc is not None and pid is not None
        os.kill(m.proc.pid, signal.SIGKILL)
        os.kill(pid, signal.SIGKILL)
        self._dead.add(leader)
        m.proc.wait(timeout=30)
        return leader

    def cut_leader(self) -> str:
        """Take the leader's link down (it must be ``n1``, in the namespace): it reaches
        neither etcd, nor the other nodes, nor the workers. Returns its name."""
        leader = self.leader()
        assert leader is not None and self.members[leader].netns is not None, (
            f"the leader {leader} is not the namespaced node"
        )
        self.ns.cut()
        self._dead.add(leader)
        return leader

    def new_leader(self, old: str, timeout: float = 60.0) -> str:
        """Wait until another member than ``old`` leads, and accepts writes."""

        def promoted() -> str | None:
            leader = self.leader()
            if leader is None or leader == old:
                return None
            try:
                with psycopg.connect(
                    self.member_url(leader, "postgres"), autocommit=True, connect_timeout=2
                ) as conn:
                    row = conn.execute("SELECT pg_is_in_recovery()").fetchone()
            except psycopg.Error:
                return None
            return leader if row is not None and row[0] is False else None

        found = wait_for(promoted, timeout=timeout, interval=0.1, what=f"a leader after {old}")
        assert found is not None
        return found

    # -- logs and teardown --------------------------------------------------------------

    def logs(self) -> str:
        parts = [f"--- etcd ({self.etcd_log}) ---\n{_tail(self.etcd_log)}"]
        for m in self.members.values():
            parts.append(f"--- {m.name} ({m.log}) ---\n{_tail(m.log)}")
        return "\n".join(parts)

    def stop(self) -> None:
        """Kill every Patroni, every postmaster (SIGQUIT: immediate shutdown, then
        SIGKILL), etcd; remove the directory."""
        for m in self.members.values():
            if m.proc is not None and m.proc.poll() is None:
                m.proc.kill()
                with contextlib.suppress(subprocess.TimeoutExpired):
                    m.proc.wait(timeout=30)
        pids = [p for m in self.members.values() if (p := m.postmaster_pid()) is not None]
        for pid in pids:
            with contextlib.suppress(OSError):
                os.kill(pid, signal.SIGQUIT)
        deadline = time.monotonic() + 20
        while any(_alive(p) for p in pids) and time.monotonic() < deadline:
            time.sleep(0.05)
        for pid in pids:
            if _alive(pid):
                with contextlib.suppress(OSError):
                    os.kill(pid, signal.SIGKILL)
        if self.etcd is not None and self.etcd.poll() is None:
            self.etcd.kill()
            self.etcd.wait(timeout=30)


def _yaml(value: Any) -> str:
    """The configuration as YAML: JSON is YAML, and needs no library."""
    return json.dumps(value, indent=2)


def _member_config(
    cluster: PatroniCluster, m: Member, subnet: str, etcd_host: str
) -> dict[str, Any]:
    listen = f"127.0.0.1,{m.addr}:{m.pg_port}"
    hba = [
        "local all all trust",
        "host all all 127.0.0.1/32 trust",
        "host replication all 127.0.0.1/32 trust",
        f"host all all {subnet} trust",
        f"host replication all {subnet} trust",
    ]
    return {
        "scope": SCOPE,
        "name": m.name,
        "log": {"level": "INFO"},
        "restapi": {
            "listen": f"{m.addr}:{m.api_port}",
            "connect_address": f"{m.addr}:{m.api_port}",
        },
        "etcd3": {"hosts": [f"{etcd_host}:{cluster.etcd_port}"]},
        "bootstrap": {
            "dcs": {
                "ttl": TTL,
                "loop_wait": LOOP_WAIT,
                "retry_timeout": RETRY_TIMEOUT,
                "maximum_lag_on_failover": 1048576,
                "synchronous_mode": True,
                "postgresql": {
                    "use_pg_rewind": False,
                    "use_slots": True,
                    "parameters": PARAMETERS,
                },
            },
            "initdb": [{"encoding": "UTF8"}, "no-sync"],
        },
        "postgresql": {
            "listen": listen,
            "connect_address": f"{m.addr}:{m.pg_port}",
            "data_dir": str(m.data),
            "bin_dir": str(BIN),
            "pgpass": str(m.dir / "pgpass"),
            "authentication": {
                "superuser": {"username": "postgres"},
                "replication": {"username": "postgres"},
            },
            "parameters": {"unix_socket_directories": str(m.dir)},
            "pg_hba": hba,
            "basebackup": [{"checkpoint": "fast"}],
        },
    }


def _spawn(cluster: PatroniCluster, m: Member) -> None:
    cmd = [PATRONI, str(m.config)]
    if cluster._user is not None:
        u = cluster._user
        cmd = ["setpriv", f"--reuid={u.pw_uid}", f"--regid={u.pw_gid}", "--clear-groups", *cmd]
    if m.netns is not None:  # ip execs the command: the pid is Patroni's
        cmd = ["ip", "netns", "exec", m.netns, *cmd]
    env = {
        "PATH": os.environ.get("PATH", "/usr/bin:/bin"),
        "LC_ALL": "C",
        "LANG": "C",
        "HOME": str(m.dir),
        "PYTHONUNBUFFERED": "1",
    }
    with m.log.open("ab") as log:
        m.proc = subprocess.Popen(
            cmd, stdout=log, stderr=log, env=env, cwd=m.dir, start_new_session=True
        )


def _start_etcd(cluster: PatroniCluster, host: str) -> None:
    peer = free_port()
    data = cluster.base / "etcd"
    urls = f"http://127.0.0.1:{cluster.etcd_port},http://{host}:{cluster.etcd_port}"
    with cluster.etcd_log.open("ab") as log:
        cluster.etcd = subprocess.Popen(
            [
                ETCD,
                "--name",
                "e1",
                "--data-dir",
                str(data),
                "--listen-client-urls",
                urls,
                "--advertise-client-urls",
                f"http://{host}:{cluster.etcd_port}",
                "--listen-peer-urls",
                f"http://127.0.0.1:{peer}",
                "--initial-advertise-peer-urls",
                f"http://127.0.0.1:{peer}",
                "--initial-cluster",
                f"e1=http://127.0.0.1:{peer}",
                "--initial-cluster-state",
                "new",
                "--logger",
                "zap",
                "--log-outputs",
                "stderr",
            ],
            stdout=log,
            stderr=log,
            start_new_session=True,
        )

    def healthy() -> bool:
        assert cluster.etcd is not None
        if cluster.etcd.poll() is not None:
            raise RuntimeError(f"etcd exited: {_tail(cluster.etcd_log)}")
        try:
            with urllib.request.urlopen(
                f"http://127.0.0.1:{cluster.etcd_port}/health", timeout=2
            ) as resp:
                return bool(json.loads(resp.read()).get("health") == "true")
        except (OSError, ValueError):
            return False

    wait_for(healthy, timeout=30, interval=0.1, what="etcd healthy")


def _namespace() -> contextlib.AbstractContextManager[Namespace]:
    """netns.namespace(), whose skip is a failure under CI."""

    @contextlib.contextmanager
    def made() -> Iterator[Namespace]:
        try:
            cm = namespace()
            ns = cm.__enter__()
        except pytest.skip.Exception as exc:
            if _ci():
                pytest.fail(f"CI=true: {exc}")
            raise
        try:
            yield ns
        finally:
            cm.__exit__(None, None, None)

    return made()


@contextlib.contextmanager
def patroni_cluster() -> Iterator[PatroniCluster]:
    """etcd and three Patroni nodes, ``n1`` leading from its namespace; healthy (a
    leader, a synchronous and an asynchronous standby, both streaming) when it yields."""
    require_binaries()
    user = cluster_user()
    with _namespace() as ns:
        base = Path(tempfile.mkdtemp(prefix="runledger-patroni-"))
        os.chmod(base, 0o755)
        members = {
            name: Member(
                name,
                ns.worker_addr if name == "n1" else ns.host_addr,
                free_port(),
                free_port(),
                base / name,
                ns.name if name == "n1" else None,
            )
            for name in NAMES
        }
        cluster = PatroniCluster(base, ns, free_port(), members, user)
        last, _, _ = ns.host_addr.rpartition(".")
        subnet = f"{last}.{int(ns.host_addr.rsplit('.', 1)[1]) - 1}/30"
        try:
            _start_etcd(cluster, ns.host_addr)
            for m in members.values():
                m.dir.mkdir()
                m.config.write_text(_yaml(_member_config(cluster, m, subnet, ns.host_addr)))
                if user is not None:
                    os.chown(m.dir, user.pw_uid, user.pw_gid)
                    os.chown(m.config, user.pw_uid, user.pw_gid)
            _spawn(cluster, members["n1"])
            wait_for(
                lambda: cluster.roles().get("n1") == "leader",
                timeout=60,
                interval=0.2,
                what="n1 to bootstrap and lead",
            )
            _spawn(cluster, members["n2"])
            _spawn(cluster, members["n3"])
            wait_for(
                cluster.healthy,
                timeout=90,
                interval=0.2,
                what="n2 and n3 streaming, one synchronous (GET /cluster, pg_stat_replication)",
            )
            yield cluster
        except BaseException:
            print(f"\nPatroni cluster logs (roles {cluster.roles()}):\n{cluster.logs()}")
            raise
        finally:
            cluster.stop()
            shutil.rmtree(base, ignore_errors=True)
