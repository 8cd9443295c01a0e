"""`runledger doctor` against the test's database: what a deployment must get right."""

from __future__ import annotations

import json
from typing import Any

import psycopg
from click.testing import CliRunner

from runledger.cli import main
from runledger.db import migrate
from runledger.doctor import run_doctor


def _by_check(results: list[Any]) -> dict[str, Any]:
    return {r.check: r for r in results}


def test_a_primary_at_head_without_standbys_is_healthy(database_url: str) -> None:
    results = _by_check(run_doctor(database_url, connect_timeout=5))
    assert list(results) == ["connection", "server", "schema", "replication", "timeline"]
    assert all(r.ok for r in results.values()), results
    assert results["schema"].data == {"revision": migrate.head(), "head": migrate.head()}
    assert results["replication"].data["standbys"] == []
    assert "no failover recorded" in results["timeline"].detail
    result = CliRunner().invoke(main, ["doctor", "--database-url", database_url, "--json"])
    assert result.exit_code == 0, result.output
    assert [r["status"] for r in json.loads(result.output)] == ["ok"] * 5


def test_a_schema_behind_the_code_fails(
    database_url: str, admin_conn: psycopg.Connection[Any]
) -> None:
    admin_conn.execute("UPDATE runledger.alembic_version SET version_num = '0001'")
    results = _by_check(run_doctor(database_url, connect_timeout=5))
    assert results["schema"].status == "fail"
    assert "run `runledger migrate`" in results["schema"].detail
    result = CliRunner().invoke(main, ["doctor", "--database-url", database_url])
    assert result.exit_code == 1
    assert "fail schema: revision 0001" in result.output


def test_a_recorded_failover_is_listed(
    database_url: str, admin_conn: psycopg.Connection[Any]
) -> None:
    admin_conn.execute(
        "INSERT INTO runledger.timelines (position, timeline, seen_at) "
        "VALUES (2, runledger._timeline() + 1, now())"
    )
    admin_conn.execute("SELECT * FROM runledger.claim_runs('w1', '{demo@1}', '30 s', 1)")
    results = _by_check(run_doctor(database_url, connect_timeout=5))
    assert results["timeline"].ok
    assert "2 failover(s) recorded" in results["timeline"].detail  # the added row, and back


def test_no_server_is_one_failed_check() -> None:
    url = "postgresql://postgres@127.0.0.1:1/nothing"
    (result,) = run_doctor(url, connect_timeout=2)
    assert (result.check, result.status) == ("connection", "fail")
    out = CliRunner().invoke(main, ["doctor", "--database-url", url, "--connect-timeout", "2"])
    assert out.exit_code == 1
    assert out.output.startswith("fail connection: cannot connect")
