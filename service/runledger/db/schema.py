"""The living SQL contract: the current schema, one file per concern, in ``db/sql/``.

The revisions in ``migrations/versions`` are frozen deltas that bring an existing
database up to date; the files here are the same schema as it is now, readable in one
place. ``install`` builds a fresh database from them and stamps Alembic's version table
at head, so ``runledger migrate`` sees it as current. ``tests/migrations/test_catalog.py``
proves that ``install`` and ``alembic upgrade head`` give the same catalog.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import psycopg
from psycopg import sql

from runledger.db import migrate
from runledger.errors import ConfigurationError

SQL_DIR = Path(__file__).resolve().parent / "sql"
SCHEMA = "runledger"
# The key migrations/env.py holds while it migrates: an install and a migration of one
# database never run at the same time.
MIGRATE_LOCK_KEY = 7_210_551_234_001

# What Alembic creates (version_table_schema="runledger"), before any revision runs: the
# roles file grants SELECT ON ALL TABLES, so the table must exist before it, as it does
# during `alembic upgrade`.
_VERSION_TABLE = sql.SQL(
    "CREATE TABLE {}.alembic_version (version_num varchar(32) NOT NULL, "
    "CONSTRAINT alembic_version_pkc PRIMARY KEY (version_num))"
).format(sql.Identifier(SCHEMA))


def living_files() -> list[Path]:
    """The living SQL files in install order (their numbered names)."""
    files = sorted(SQL_DIR.glob("[0-9][0-9]_*.sql"))
    if not files:
        raise ConfigurationError(f"no living SQL files in {SQL_DIR} (broken installation?)")
    return files


def living_sql() -> str:
    """All living files, concatenated in install order."""
    return "\n".join(
        f"-- file: {path.name}\n{path.read_text(encoding='utf-8')}" for path in living_files()
    )


def install(conn: psycopg.Connection[Any]) -> str:
    """Install the current schema into a database without one; return the stamped revision.

    One transaction: the schema, Alembic's version table, every living file, and the
    head revision in the version table. Refuses a database that already has a
    ``runledger.alembic_version`` or ``runledger.runs`` table (use ``runledger migrate``).
    """
    revision = migrate.head()
    with conn.transaction():
        conn.execute("SELECT pg_advisory_xact_lock(%s)", (MIGRATE_LOCK_KEY,))
        found = conn.execute(
            "SELECT to_regclass('runledger.alembic_version') IS NOT NULL "
            "OR to_regclass('runledger.runs') IS NOT NULL"
        ).fetchone()
        if found is not None and found[0]:
            raise ConfigurationError(
                "schema runledger is already installed here: use `runledger migrate`"
            )
        conn.execute(sql.SQL("CREATE SCHEMA IF NOT EXISTS {}").format(sql.Identifier(SCHEMA)))
        conn.execute(_VERSION_TABLE)
        # Sent as is (no parameters, so no placeholder parsing of % in the SQL text).
        conn.execute(living_sql().encode("utf-8"))
        conn.execute(
            sql.SQL("INSERT INTO {}.alembic_version (version_num) VALUES (%s)").format(
                sql.Identifier(SCHEMA)
            ),
            (revision,),
        )
    return revision
