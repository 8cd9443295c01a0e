"""deploy/roles.sql, run with psql against a cluster of its own that checks passwords.

The cluster trusts only ``postgres`` on the loopback; every other user logs in with a
SCRAM-SHA-256 password, so a login here proves the password roles.sql set. Each login
user is then asked to do what its role may and may not do.
"""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import psycopg
import pytest

from runledger.testing.postgres import Server, private_cluster, url_with_dbname

ROOT = Path(__file__).resolve().parents[2]
ROLES_SQL = ROOT / "deploy" / "roles.sql"
USERS = {
    "worker": "runledger_worker_login",
    "operator": "runledger_operator_login",
    "auditor": "runledger_auditor_login",
}
PASSWORDS = {"worker": "w-secret 1", "operator": "o'secret 2", "auditor": 'a"secret 3'}


def _psql() -> str:
    candidates = [shutil.which("psql")]
    root = Path("/usr/lib/postgresql")
    if root.is_dir():
        candidates += [str(p / "bin" / "psql") for p in sorted(root.iterdir(), reverse=True)]
    for c in candidates:
        if c and Path(c).is_file():
            return c
    pytest.fail("no psql: install postgresql-client (roles.sql is a psql script)")


@dataclass
class Cluster:
    server: Server
    admin_url: str  # the runledger database, as postgres (the schema owner here)

    def url(self, who: str, password: str | None = None) -> str:
        user = USERS[who]
        pw = PASSWORDS[who] if password is None else password
        conninfo = psycopg.conninfo.conninfo_to_dict(self.admin_url)
        conninfo.update(user=user, password=pw)
        return psycopg.conninfo.make_conninfo(**conninfo)  # type: ignore[arg-type]

    def connect(self, who: str, password: str | None = None) -> psycopg.Connection[Any]:
        return psycopg.connect(self.url(who, password), autocommit=True)


@pytest.fixture(scope="module")
def cluster() -> Iterator[Cluster]:
    hba_dir = Path(tempfile.mkdtemp(prefix="runledger-hba-"))
    os.chmod(hba_dir, 0o755)
    hba = hba_dir / "pg_hba.conf"
    hba.write_text(
        "local all postgres trust\n"
        "host all postgres 127.0.0.1/32 trust\n"
        "host all all 127.0.0.1/32 scram-sha-256\n"
    )
    os.chmod(hba, 0o644)
    server = private_cluster(settings={"hba_file": str(hba)})
    try:
        with psycopg.connect(server.admin_url, autocommit=True) as conn:
            conn.execute("CREATE DATABASE runledger")
        admin_url = url_with_dbname(server.admin_url, "runledger")
        # The migrate Job's command, as the schema owner; it creates the three roles.
        subprocess.run(
            [sys.executable, "-m", "runledger", "migrate", "--database-url", admin_url],
            check=True,
            capture_output=True,
            timeout=120,
        )
        yield Cluster(server=server, admin_url=admin_url)
    finally:
        server.stop()
        shutil.rmtree(hba_dir, ignore_errors=True)


def run_roles_sql(
    cluster: Cluster, passwords: Mapping[str, str]
) -> subprocess.CompletedProcess[str]:
    variables = [arg for who, pw in passwords.items() for arg in ("-v", f"{who}_password={pw}")]
    return subprocess.run(
        [_psql(), cluster.admin_url, "-X", "-q", *variables, "-f", str(ROLES_SQL)],
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )


def _logins(cluster: Cluster) -> dict[str, tuple[bool, bool, bool, bool]]:
    with psycopg.connect(cluster.admin_url, autocommit=True) as conn:
        rows = conn.execute(
            "SELECT u.rolname, u.rolcanlogin, u.rolsuper OR u.rolcreaterole OR u.rolcreatedb,"
            " u.rolinherit, pg_has_role(u.rolname, replace(u.rolname, '_login', ''), 'MEMBER')"
            " FROM pg_roles u WHERE u.rolname LIKE 'runledger\\_%\\_login' ORDER BY 1"
        ).fetchall()
    return {r[0]: (r[1], r[2], r[3], r[4]) for r in rows}


def _refused(conn: psycopg.Connection[Any], statement: str) -> None:
    with pytest.raises(psycopg.errors.InsufficientPrivilege):
        conn.execute(statement)  # type: ignore[arg-type]


@pytest.fixture(scope="module")
def applied(cluster: Cluster) -> Cluster:
    """roles.sql refuses a missing password first, then runs twice (it is re-runnable)."""
    missing = run_roles_sql(cluster, {"worker": "x", "operator": "y"})
    assert missing.returncode == 3, missing
    assert "password of runledger_auditor_login is empty" in missing.stderr
    assert "auditor_password" in missing.stderr
    assert _logins(cluster) == {}, "a refused run created users"
    for _ in range(2):
        done = run_roles_sql(cluster, PASSWORDS)
        assert done.returncode == 0, done.stderr
        assert "secret" not in done.stdout + done.stderr  # no password echoed
    return cluster


def test_roles_sql_creates_one_login_user_in_each_role(applied: Cluster) -> None:
    # can log in, no admin attributes, inherits, member of its role
    assert _logins(applied) == {user: (True, False, True, True) for user in USERS.values()}


def test_a_wrong_password_is_refused(applied: Cluster) -> None:
    for who in USERS:
        with pytest.raises(psycopg.OperationalError, match="password authentication failed"):
            applied.connect(who, password="wrong")


def test_the_worker_login_drives_runs_through_the_functions_only(applied: Cluster) -> None:
    with applied.connect("worker") as conn:
        conn.execute("SELECT * FROM runledger.submit_run('roles-r1', 'demo', '1', '{}', 0, NULL)")
        claimed = conn.execute(
            "SELECT run_id FROM runledger.claim_runs_v4('w1', ARRAY['demo@1'], '30 s', 1)"
        ).fetchall()
        assert [r[0] for r in claimed] == ["roles-r1"]
        assert conn.execute("SELECT count(*) FROM runledger.runs").fetchone() == (1,)
        _refused(conn, "UPDATE runledger.runs SET fencing_token = fencing_token + 1")
        _refused(conn, "DELETE FROM runledger.run_events")
        _refused(conn, "SELECT runledger.cancel_run('roles-r1', 'w1', NULL)")
        _refused(conn, "SELECT runledger.prune_runs(now(), false)")


def test_the_operator_login_resolves_and_reads(applied: Cluster) -> None:
    with applied.connect("operator") as conn:
        # EXECUTE is granted: the function itself answers (no such call), not 42501.
        with pytest.raises(psycopg.Error) as refused:
            conn.execute("SELECT runledger.resolve_call('nope:0:c1', 'applied', '{}', 'me', NULL)")
        assert refused.value.sqlstate is not None
        assert refused.value.sqlstate.startswith("RL"), refused.value.sqlstate
        conn.execute("SELECT count(*) FROM runledger.run_timeline")
        _refused(conn, "DELETE FROM runledger.runs")
    # An operator's shell: a read command of the CLI with the login's URL.
    out = subprocess.run(
        [sys.executable, "-m", "runledger", "list", "--json"],
        env={**os.environ, "RUNLEDGER_DATABASE_URL": applied.url("operator")},
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )
    assert out.returncode == 0, out.stderr


def test_the_auditor_login_reads_and_calls_only_the_clock(applied: Cluster) -> None:
    with applied.connect("auditor") as conn:
        conn.execute("SELECT count(*) FROM runledger.runs")
        conn.execute("SELECT count(*) FROM runledger.effect_ledger")
        conn.execute("SELECT runledger.now()")  # revision 0012: the read commands need it
        _refused(conn, "SELECT * FROM runledger.claim_runs_v4('a', ARRAY['demo@1'], '30 s', 1)")
        _refused(conn, "SELECT runledger.resolve_call('x:0:c1', 'applied', '{}', 'me', NULL)")
        _refused(
            conn, "INSERT INTO runledger.run_events (run_id, at, kind) VALUES ('x', now(), 'y')"
        )


def test_a_second_run_changes_the_passwords(cluster: Cluster, applied: Cluster) -> None:
    # A SCRAM verifier made on the client: the password itself never reaches the server.
    with psycopg.connect(cluster.admin_url) as conn:
        verifier = conn.pgconn.encrypt_password(
            b"rotated", USERS["worker"].encode(), b"scram-sha-256"
        ).decode()
    assert verifier.startswith("SCRAM-SHA-256$")
    rotated = {**PASSWORDS, "worker": verifier}
    try:
        done = run_roles_sql(cluster, rotated)
        assert done.returncode == 0, done.stderr
        with applied.connect("worker", password="rotated") as conn:
            assert conn.execute("SELECT current_user").fetchone() == (USERS["worker"],)
        with pytest.raises(psycopg.OperationalError, match="password authentication failed"):
            applied.connect("worker")
    finally:
        assert run_roles_sql(cluster, PASSWORDS).returncode == 0


@pytest.mark.process
def test_a_worker_process_runs_as_the_worker_login(applied: Cluster, tmp_path: Path) -> None:
    """`runledger worker` with the worker login's URL (as the k8s Secret's worker-url)
    connects, passes the schema check, registers, and drains on SIGTERM."""
    log = tmp_path / "worker.log"
    with log.open("w") as out:
        proc = subprocess.Popen(
            [
                sys.executable,
                "-m",
                "runledger",
                "worker",
                "--flows",
                "runledger.demo.flows:flows",
                "--worker-id",
                "roles-w1",
                "--grace-seconds",
                "5",
                "--log-json",
            ],
            env={**os.environ, "RUNLEDGER_DATABASE_URL": applied.url("worker")},
            stdout=out,
            stderr=subprocess.STDOUT,
        )
    try:
        deadline = time.monotonic() + 60
        with psycopg.connect(applied.admin_url, autocommit=True) as conn:
            while not conn.execute(
                "SELECT 1 FROM runledger.workers WHERE worker_id = 'roles-w1'"
            ).fetchone():
                assert proc.poll() is None, f"worker exited {proc.returncode}: {log.read_text()}"
                assert time.monotonic() < deadline, f"worker never registered: {log.read_text()}"
                time.sleep(0.1)
            proc.send_signal(signal.SIGTERM)
            assert proc.wait(timeout=60) == 0, log.read_text()
            stopped = conn.execute(
                "SELECT stopped_at IS NOT NULL FROM runledger.workers WHERE worker_id = 'roles-w1'"
            ).fetchone()
        assert stopped == (True,), log.read_text()
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait(timeout=30)
