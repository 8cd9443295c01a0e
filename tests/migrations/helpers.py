"""Helpers shared by the migration tests: paths, one-shot queries, catalog snapshots."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import psycopg

ROOT = Path(__file__).resolve().parents[2]
MIGRATIONS = ROOT / "migrations"


def query(url: str, sql: Any, params: tuple[Any, ...] = ()) -> list[tuple[Any, ...]]:
    with psycopg.connect(url, autocommit=True) as conn:
        return conn.execute(sql, params).fetchall()


def schema_snapshot(url: str) -> dict[str, set[tuple[Any, ...]]]:
    """Every object of schema runledger that a migration creates, by kind."""
    return {
        "relations": set(
            query(
                url,
                "SELECT c.relname, c.relkind::text FROM pg_class c "
                "WHERE c.relnamespace = 'runledger'::regnamespace",
            )
        ),
        "tables": set(
            query(
                url,
                "SELECT table_name, table_type FROM information_schema.tables "
                "WHERE table_schema = 'runledger'",
            )
        ),
        "functions": set(
            query(
                url,
                "SELECT p.oid::regprocedure::text, p.prosecdef, "
                "       coalesce(array_to_string(p.proconfig, ';'), '') "
                "FROM pg_proc p WHERE p.pronamespace = 'runledger'::regnamespace",
            )
        ),
        "triggers": set(
            query(
                url,
                "SELECT t.tgname, c.relname, t.tgenabled::text FROM pg_trigger t "
                "JOIN pg_class c ON c.oid = t.tgrelid "
                "WHERE c.relnamespace = 'runledger'::regnamespace AND NOT t.tgisinternal",
            )
        ),
        "types": set(
            query(
                url,
                "SELECT t.typname FROM pg_type t WHERE t.typnamespace = 'runledger'::regnamespace "
                "AND t.typtype <> 'c' AND t.typelem = 0",
            )
        ),
    }
