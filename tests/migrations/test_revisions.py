"""The revision graph, the upgrade/downgrade round trip, and `runledger migrate`."""

from __future__ import annotations

import ast
import os
import re
import subprocess
import sys
import time
import zipfile
from pathlib import Path

import psycopg
import pytest
from alembic.script import ScriptDirectory
from click.testing import CliRunner

from runledger.cli import main
from runledger.db import migrate, schema
from tests.migrations.helpers import MIGRATIONS, ROOT, query, schema_snapshot

HEAD = "0.2"


def _script() -> ScriptDirectory:
    return ScriptDirectory.from_config(migrate.alembic_config(None))


# -- the revision graph ------------------------------------------------------------------


def test_single_head() -> None:
    script = _script()
    assert script.get_heads() == [HEAD]
    assert migrate.head() == HEAD
    bases = script.get_bases()
    assert len(bases) == 1, f"more than one base revision: {bases}"


def test_revisions_are_linear_and_load_their_sql_siblings() -> None:
    script = _script()
    revisions = list(script.walk_revisions())  # head first
    for rev in revisions:
        assert rev.is_merge_point is False, f"{rev.revision} is a merge"
        module = Path(rev.path)
        assert module.with_suffix(".sql").is_file(), f"{module.name} has no .sql sibling"
        assert module.with_suffix(".down.sql").is_file(), f"{module.name} has no .down.sql"


def test_revisions_import_nothing_of_runledger() -> None:
    """CONTRIBUTING.md: a released revision is frozen; it must not depend on moving package code."""
    for path in [MIGRATIONS / "env.py", *sorted((MIGRATIONS / "versions").glob("*.py"))]:
        tree = ast.parse(path.read_text(encoding="utf-8"))
        for node in ast.walk(tree):
            names: list[str] = []
            if isinstance(node, ast.Import):
                names = [a.name for a in node.names]
            elif isinstance(node, ast.ImportFrom) and node.module:
                names = [node.module]
            for name in names:
                assert name.split(".")[0] not in ("runledger", "service"), (
                    f"{path.name} imports {name}"
                )


# -- upgrade / downgrade round trip --------------------------------------------------------


def test_upgrade_downgrade_upgrade_round_trip(empty_database_url: str) -> None:
    url = empty_database_url
    assert migrate.current(url) is None

    migrate.upgrade(url)
    assert migrate.current(url) == HEAD
    first = schema_snapshot(url)
    table_names = {name for name, kind in first["tables"] if kind == "BASE TABLE"}
    assert table_names == {
        "alembic_version",
        "runs",
        "run_turns",
        "run_calls",
        "run_events",
        "workers",
        "settings",
        "prune_authorizations",
        "timelines",
        "failover_runs",
        "commit_guarantees",  # revision 0.2
        "event_checkpoints",  # revision 0016
        "event_checkpoint_heads",
        "event_chain_prunes",
        "event_checkpoint_prunes",  # revision 0.2
    }
    views = {name for name, kind in first["tables"] if kind == "VIEW"}
    assert views == {"run_timeline", "effect_ledger", "lease_history"}
    function_names = {sig.split("(")[0] for sig, _, _ in first["functions"]}
    assert "runledger.claim_runs_v4" in function_names
    assert "runledger.prune_runs" in function_names
    assert len(first["triggers"]) >= 5

    migrate.downgrade(url, "base")
    assert migrate.current(url) is None
    after_down = schema_snapshot(url)
    # Only Alembic's (now empty) version table is left behind.
    assert after_down["tables"] == {("alembic_version", "BASE TABLE")}
    assert {name for name, _ in after_down["relations"]} <= {
        "alembic_version",
        "alembic_version_pkc",
    }
    assert after_down["functions"] == set()
    assert after_down["triggers"] == set()
    assert after_down["types"] == set()
    assert query(url, "SELECT count(*) FROM runledger.alembic_version") == [(0,)]

    migrate.upgrade(url)
    assert migrate.current(url) == HEAD
    assert schema_snapshot(url) == first
    # The seed row of settings is written again.
    assert query(url, "SELECT singleton, max_payload_bytes FROM runledger.settings") == [
        (True, 1048576)
    ]


# -- runledger migrate (CLI) -------------------------------------------------------------


@pytest.fixture
def no_database_env(monkeypatch: pytest.MonkeyPatch) -> None:
    for name in list(os.environ):
        if name.startswith("RUNLEDGER_") or name == "DATABASE_URL" or name.startswith("PG"):
            monkeypatch.delenv(name)
    # If anything tried to connect anyway, it would fail instead of finding a server.
    monkeypatch.setenv("PGHOST", "/nonexistent-runledger-test")
    monkeypatch.setenv("PGCONNECT_TIMEOUT", "1")


def test_migrate_check_fails_on_empty_database_then_passes(
    empty_database_url: str, no_database_env: None
) -> None:
    runner = CliRunner()
    url = empty_database_url

    checked = runner.invoke(main, ["migrate", "--check", "--database-url", url])
    assert checked.exit_code == 1, checked.output
    assert "behind" in checked.stderr
    assert migrate.current(url) is None, "--check must change nothing"

    done = runner.invoke(main, ["migrate"], env={"RUNLEDGER_DATABASE_URL": url})
    assert done.exit_code == 0, done.output
    assert f"-> {HEAD}" in done.stdout

    # DATABASE_URL is the fallback when RUNLEDGER_DATABASE_URL is not set.
    checked = runner.invoke(main, ["migrate", "--check"], env={"DATABASE_URL": url})
    assert checked.exit_code == 0, checked.output
    assert f"up to date: {HEAD}" in checked.stdout


def test_migrate_without_url_is_a_usage_error(no_database_env: None) -> None:
    result = CliRunner().invoke(main, ["migrate", "--check"])
    assert result.exit_code == 2, result.output
    assert "RUNLEDGER_DATABASE_URL" in result.output


def test_migrate_sql_prints_the_schema_without_a_database(no_database_env: None) -> None:
    result = CliRunner().invoke(main, ["migrate", "--sql"])
    assert result.exit_code == 0, result.output
    sql = result.stdout
    assert "CREATE FUNCTION runledger.claim_runs" in sql
    assert "CREATE TABLE runledger.runs" in sql
    assert "CREATE SCHEMA IF NOT EXISTS runledger" in sql
    # Alembic's bookkeeping lands in the runledger schema too.
    assert re.search(r"INSERT INTO runledger\.alembic_version .*'0\.1'", sql), sql[-2000:]


def test_migrate_sql_in_a_clean_process(tmp_path: Path) -> None:
    """The real entry point, no database settings at all, from an unrelated directory."""
    env = {
        k: v
        for k, v in os.environ.items()
        if not (k.startswith(("RUNLEDGER_", "PG")) or k == "DATABASE_URL")
    }
    env["PGHOST"] = "/nonexistent-runledger-test"
    done = subprocess.run(
        [sys.executable, "-m", "runledger", "migrate", "--sql"],
        cwd=tmp_path,
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert done.returncode == 0, done.stderr
    assert "CREATE FUNCTION runledger.claim_runs" in done.stdout
    assert "CREATE FUNCTION runledger.claim_runs" not in done.stderr


# -- several processes migrating one database at once ------------------------------------------


def _migrate_lock_key() -> int:
    match = re.search(r"MIGRATE_LOCK_KEY\s*=\s*([\d_]+)", (MIGRATIONS / "env.py").read_text())
    assert match, "migrations/env.py no longer defines MIGRATE_LOCK_KEY"
    return int(match.group(1).replace("_", ""))


def _advisory_waiters(conn: psycopg.Connection[tuple[object, ...]], key: int) -> int:
    row = conn.execute(
        "SELECT count(*) FROM pg_locks WHERE locktype = 'advisory' AND NOT granted "
        "AND database = (SELECT oid FROM pg_database WHERE datname = current_database()) "
        "AND ((classid::bigint << 32) | objid::bigint) = %s",
        (key,),
    ).fetchone()
    assert row is not None
    return int(str(row[0]))


def test_four_processes_migrate_one_empty_database_at_once(empty_database_url: str) -> None:
    url = empty_database_url
    key = _migrate_lock_key()
    env = {k: v for k, v in os.environ.items() if not k.startswith("RUNLEDGER_")}
    env["RUNLEDGER_DATABASE_URL"] = url
    env.pop("DATABASE_URL", None)

    with psycopg.connect(url, autocommit=True) as gate:
        # Hold the migration lock so that all four processes are provably waiting on it
        # together, then let them race.
        gate.execute("SELECT pg_advisory_lock(%s)", (key,))
        procs = [
            subprocess.Popen(
                [sys.executable, "-m", "runledger", "migrate"],
                cwd=ROOT,
                env=env,
                stdout=subprocess.PIPE,
                stderr=subprocess.PIPE,
                text=True,
            )
            for _ in range(4)
        ]
        try:
            deadline = time.monotonic() + 60
            while _advisory_waiters(gate, key) < 4:
                early = [p for p in procs if p.poll() is not None]
                if early:
                    out, err = early[0].communicate()
                    pytest.fail(f"a migrate process exited before the race: {out}\n{err}")
                if time.monotonic() > deadline:
                    pytest.fail("the four migrate processes never all waited on the lock")
                time.sleep(0.05)
        finally:
            gate.execute("SELECT pg_advisory_unlock(%s)", (key,))
        results = [p.communicate(timeout=120) for p in procs]

    for proc, (out, err) in zip(procs, results, strict=True):
        assert proc.returncode == 0, f"stdout: {out}\nstderr: {err}"
        # Each one looked before the race: all four saw an empty database.
        assert f"migrated: empty -> {HEAD}" in out
    assert query(url, "SELECT version_num FROM runledger.alembic_version") == [(HEAD,)]
    # The revision ran exactly once: its seed row is there once.
    assert query(url, "SELECT count(*) FROM runledger.settings") == [(1,)]


# -- the wheel carries the migrations ------------------------------------------------------


@pytest.mark.slow
def test_wheel_ships_the_migrations(tmp_path: Path) -> None:
    wheel_dir = tmp_path / "dist"
    subprocess.run(
        [sys.executable, "-m", "pip", "wheel", "--no-deps", "-q", "-w", str(wheel_dir), str(ROOT)],
        check=True,
        capture_output=True,
        timeout=300,
    )
    (wheel,) = wheel_dir.glob("runledger_pg-*.whl")
    with zipfile.ZipFile(wheel) as zf:
        names = set(zf.namelist())
        assert "runledger/_migrations/env.py" in names
        for revision in (
            "0_1_baseline.py",
            "0_1_baseline.sql",
            "0_1_baseline.down.sql",
            "0_2.py",
            "0_2.sql",
            "0_2.down.sql",
        ):
            assert f"runledger/_migrations/versions/{revision}" in names
        # what migrations/env.py runs on a database of the last revision before the baseline
        assert "runledger/_migrations/versions/0_1_baseline.from_0032.sql" in names
        living = {n for n in names if n.startswith("runledger/db/sql/")}
        assert living == {f"runledger/db/sql/{f.name}" for f in schema.living_files()}
        assert "runledger/db/schema.py" in names
        assert "runledger/_migrations/script.py.mako" in names
        assert "runledger/db/tables.py" in names
        unpacked = tmp_path / "site"
        zf.extractall(unpacked)

    # From the unpacked wheel (not this checkout), the code finds its migrations and can
    # render the SQL offline.
    probe = (
        "import runledger, runledger.db.migrate as m;"
        "print(runledger.__file__); print(m.migrations_dir()); print(m.head());"
        "print('CREATE FUNCTION runledger.claim_runs' in m.offline_sql());"
        "import runledger.db.schema as s; print(s.living_files()[0].parent)"
    )
    env = {k: v for k, v in os.environ.items() if not k.startswith("RUNLEDGER_")}
    env["PYTHONPATH"] = str(unpacked)
    out = subprocess.run(
        [sys.executable, "-c", probe],
        cwd=tmp_path,
        env=env,
        check=True,
        capture_output=True,
        text=True,
        timeout=120,
    ).stdout.splitlines()
    assert out[0].startswith(str(unpacked)), out
    assert out[1] == str(unpacked / "runledger" / "_migrations"), out
    assert out[2:4] == [HEAD, "True"], out
    assert out[4] == str(unpacked / "runledger" / "db" / "sql"), out
