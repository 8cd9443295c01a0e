"""`runledger doctor` against the test's database: what a deployment must get right."""

from __future__ import annotations

import json
import time
import uuid
from typing import Any

import psycopg
import pytest
from click.testing import CliRunner
from psycopg import sql
from psycopg.conninfo import conninfo_to_dict, make_conninfo

from runledger import doctor
from runledger.cli import main
from runledger.db import migrate
from runledger.doctor import run_doctor


def _by_check(results: list[Any]) -> dict[str, Any]:
    return {r.check: r for r in results}


def test_a_primary_at_head_without_standbys_is_healthy(database_url: str) -> None:
    results = _by_check(run_doctor(database_url, connect_timeout=5))
    assert list(results) == [
        "connection",
        "server",
        "schema",
        "replication",
        "timeline",
        "roles",
        "isolation",
        "write",
        "clock",
        "worker clocks",
        "settings",
    ]
    assert all(r.ok for r in results.values()), results
    assert results["server"].data["num"] >= 130000 and results["server"].data["version"]
    assert results["roles"].data == {
        "present": ["runledger_auditor", "runledger_operator", "runledger_worker"],
        "missing": [],
    }
    assert abs(results["clock"].data["skew_seconds"]) < 1
    assert results["schema"].data == {
        "revision": migrate.head(),
        "head": migrate.head(),
        "behind": False,
    }
    assert results["replication"].data["standbys"] == []
    assert "no failover recorded" in results["timeline"].detail
    assert results["write"].data == {"tablespace": "pg_default"}
    result = CliRunner().invoke(main, ["doctor", "--database-url", database_url, "--json"])
    assert result.exit_code == 0, result.output
    assert [r["status"] for r in json.loads(result.output)] == ["ok"] * 11


def test_a_schema_behind_the_code_fails(
    database_url: str, admin_conn: psycopg.Connection[Any]
) -> None:
    admin_conn.execute("UPDATE runledger.alembic_version SET version_num = '0001'")
    results = _by_check(run_doctor(database_url, connect_timeout=5))
    assert results["schema"].status == "fail"
    assert "run `runledger migrate`" in results["schema"].detail
    result = CliRunner().invoke(main, ["doctor", "--database-url", database_url])
    # the CLI's code for a schema behind the code, as every other command exits with
    assert result.exit_code == 3
    assert "fail schema: revision 0001" in result.output


def test_a_schema_newer_than_the_code_is_a_failed_check_not_unavailable(
    database_url: str, admin_conn: psycopg.Connection[Any]
) -> None:
    # a rolling deploy: the next release migrated, this one still runs (and works)
    admin_conn.execute("UPDATE runledger.alembic_version SET version_num = '9999'")
    result = CliRunner().invoke(main, ["doctor", "--database-url", database_url])
    assert result.exit_code == 1, result.output
    assert "fail schema: revision 9999 is newer than this code's head" in result.output


def test_a_recorded_failover_is_listed(
    database_url: str, admin_conn: psycopg.Connection[Any]
) -> None:
    admin_conn.execute(
        "INSERT INTO runledger.timelines (position, timeline, seen_at) "
        "VALUES (2, runledger._timeline() + 1, now())"
    )
    admin_conn.execute("SELECT * FROM runledger.claim_runs_v4('w1', '{demo@1}', '30 s', 1)")
    results = _by_check(run_doctor(database_url, connect_timeout=5))
    assert results["timeline"].ok
    assert "2 failover(s) recorded" in results["timeline"].detail  # the added row, and back


def test_no_server_is_one_failed_check() -> None:
    url = "postgresql://postgres@127.0.0.1:1/nothing"
    result, shown = run_doctor(url, connect_timeout=2)
    assert (result.check, result.status) == ("connection", "fail")
    assert (shown.check, shown.data["database_url"]) == ("settings", url)
    out = CliRunner().invoke(main, ["doctor", "--database-url", url, "--connect-timeout", "2"])
    assert out.exit_code == 3  # database unreachable (runledger --help)
    assert out.output.startswith("fail connection: cannot connect")


def test_a_database_without_the_schema_exits_3(
    database_url: str, admin_conn: psycopg.Connection[Any]
) -> None:
    name = f"doctor_empty_{uuid.uuid4().hex[:8]}"
    admin_conn.execute(f"CREATE DATABASE {name}")  # type: ignore[arg-type]
    try:
        empty = make_conninfo(database_url, dbname=name)
        result = CliRunner().invoke(main, ["doctor", "--database-url", empty])
        assert result.exit_code == 3, result.output
        assert "fail schema: no runledger schema" in result.output
    finally:
        admin_conn.execute(f"DROP DATABASE {name} WITH (FORCE)")  # type: ignore[arg-type]


def test_a_missing_role_warns_and_exits_1(
    database_url: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(doctor, "ROLES", (*doctor.ROLES, "runledger_nobody"))
    results = _by_check(run_doctor(database_url, connect_timeout=5))
    assert results["roles"].status == "warn"
    assert results["roles"].data["missing"] == ["runledger_nobody"]
    result = CliRunner().invoke(main, ["doctor", "--database-url", database_url])
    assert result.exit_code == 1
    assert "warn roles: missing role(s) runledger_nobody" in result.output


def test_a_default_isolation_above_read_committed_fails(
    database_url: str, admin_conn: psycopg.Connection[Any]
) -> None:
    dbname = conninfo_to_dict(database_url)["dbname"]
    admin_conn.execute(
        sql.SQL("ALTER DATABASE {} SET default_transaction_isolation = 'repeatable read'").format(
            sql.Identifier(dbname)
        )
    )
    results = _by_check(run_doctor(database_url, connect_timeout=5))
    assert results["isolation"].status == "fail"
    assert results["isolation"].data == {"default_transaction_isolation": "repeatable read"}
    result = CliRunner().invoke(main, ["doctor", "--database-url", database_url])
    assert result.exit_code == 1
    assert "fail isolation: default_transaction_isolation is repeatable read" in result.output


def test_a_host_clock_off_the_database_warns(
    database_url: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    real = time.time
    monkeypatch.setattr(doctor.time, "time", lambda: real() - 5.0)  # this host 5 s behind
    results = _by_check(run_doctor(database_url, connect_timeout=5))
    assert results["clock"].status == "warn"
    assert 4 < results["clock"].data["skew_seconds"] < 6
    assert "ahead of this host's (more than 1 s)" in results["clock"].detail


def test_settings_are_shown_with_secrets_redacted(
    database_url: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    params = conninfo_to_dict(database_url)
    params["password"] = "hunter2-secret"
    with_password = make_conninfo("", **params)
    monkeypatch.setenv("RUNLEDGER_DATABASE_URL", "postgresql://u:hunter2-secret@h/db")
    monkeypatch.setenv("RUNLEDGER_DIRECT_URL", "postgresql://u:hunter2-secret@db:5432/db")
    monkeypatch.setenv("RUNLEDGER_API_TOKEN", "hunter2-secret")
    monkeypatch.setenv("RUNLEDGER_LEASE_SECONDS", "12")
    result = CliRunner().invoke(
        main, ["doctor", "--database-url", with_password, "--connect-timeout", "3", "--json"]
    )
    assert "hunter2" not in result.output
    (settings,) = [r for r in json.loads(result.output) if r["check"] == "settings"]
    assert settings["status"] == "ok"
    assert conninfo_to_dict(settings["data"]["database_url"])["password"] == "***"
    assert settings["data"]["connect_timeout"] == 3
    env = settings["data"]["environment"]
    assert env["RUNLEDGER_LEASE_SECONDS"] == "12"
    assert env["RUNLEDGER_API_TOKEN"] == "***"
    assert conninfo_to_dict(env["RUNLEDGER_DATABASE_URL"])["password"] == "***"
    assert conninfo_to_dict(env["RUNLEDGER_DIRECT_URL"])["password"] == "***"
    assert doctor.redact_url("not a url at all =") == "***"
    assert doctor.redact_url("postgresql://u@h/db") == "postgresql://u@h/db"
