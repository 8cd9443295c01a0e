"""On a managed database the migrating user may not create roles: the migration still
succeeds, and says so. Needs a cluster of its own (roles are cluster-wide)."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import psycopg
import pytest

from runledger.db.migrate import head, migrations_dir
from runledger.testing.postgres import Server, _embedded_bin_dir, _local_bin_dirs, start_cluster


@pytest.fixture(scope="module")
def fresh_cluster(runledger_server: Server) -> Iterator[Server]:
    if runledger_server.backend == "local":
        bin_dir = _local_bin_dirs()[0]
    elif runledger_server.backend == "embedded":
        bin_dir = _embedded_bin_dir()
    else:
        pytest.skip(f"needs a cluster of its own; the {runledger_server.backend} server is shared")
    server = start_cluster(Path(bin_dir), "local")
    try:
        yield server
    finally:
        server.stop()


def test_migration_without_createrole_succeeds_and_warns(fresh_cluster: Server) -> None:
    with psycopg.connect(fresh_cluster.admin_url, autocommit=True) as admin:
        admin.execute("CREATE ROLE limited LOGIN CREATEDB NOCREATEROLE")
        admin.execute("CREATE DATABASE managed OWNER limited")
    url = fresh_cluster.url_for("managed").replace("postgres@", "limited@", 1)

    notices: list[str] = []
    sql = (migrations_dir() / "versions" / "0_1_baseline.sql").read_text()
    with psycopg.connect(url, autocommit=True) as conn:
        conn.add_notice_handler(lambda d: notices.append(d.message_primary or ""))
        conn.execute("BEGIN")
        # what Alembic creates before the revision runs (the roles' grants name it)
        conn.execute("CREATE SCHEMA runledger")
        conn.execute(
            "CREATE TABLE runledger.alembic_version (version_num varchar(32) NOT NULL PRIMARY KEY)"
        )
        conn.execute(sql.encode())
        conn.execute("COMMIT")
        functions = conn.execute(
            "SELECT count(*) FROM pg_proc WHERE pronamespace = 'runledger'::regnamespace"
        ).fetchone()
        roles = conn.execute(
            "SELECT count(*) FROM pg_roles WHERE rolname LIKE 'runledger\\_%'"
        ).fetchone()
    assert functions is not None and functions[0] > 20  # the contract is installed
    assert roles == (0,)  # and no role could be made
    assert any("could not create role runledger_worker" in n for n in notices), notices


def test_runledger_migrate_as_that_user_exits_zero(fresh_cluster: Server, tmp_path: Any) -> None:
    from click.testing import CliRunner

    from runledger.cli import main

    with psycopg.connect(fresh_cluster.admin_url, autocommit=True) as admin:
        admin.execute("CREATE ROLE limited2 LOGIN CREATEDB NOCREATEROLE")
        admin.execute("CREATE DATABASE managed2 OWNER limited2")
    url = fresh_cluster.url_for("managed2").replace("postgres@", "limited2@", 1)
    result = CliRunner().invoke(main, ["migrate", "--database-url", url])
    assert result.exit_code == 0, result.output
    assert f"-> {head()}" in result.output


def test_install_from_the_living_files_as_that_user_succeeds_and_warns(
    fresh_cluster: Server,
) -> None:
    from runledger.db import schema

    with psycopg.connect(fresh_cluster.admin_url, autocommit=True) as admin:
        admin.execute("CREATE ROLE limited3 LOGIN CREATEDB NOCREATEROLE")
        admin.execute("CREATE DATABASE managed3 OWNER limited3")
    url = fresh_cluster.url_for("managed3").replace("postgres@", "limited3@", 1)
    notices: list[str] = []
    with psycopg.connect(url) as conn:
        conn.add_notice_handler(lambda d: notices.append(d.message_primary or ""))
        assert schema.install(conn) == head()
        version = conn.execute("SELECT version_num FROM runledger.alembic_version").fetchall()
    assert version == [(head(),)]
    assert any("could not create role runledger_worker" in n for n in notices), notices
