"""service/runledger/db/tables.py describes exactly what the migrations create.

Two independent checks:

- Alembic's autogenerate comparison (tables, columns, types, nullability, server defaults,
  primary/unique/foreign keys, indexes) finds nothing to change;
- PostgreSQL itself renders the catalog of a migrated database and of a database built
  from the metadata (``create_all``) identically, which also covers what autogenerate
  does not look at: CHECK constraints and the predicates of partial indexes.
"""

from __future__ import annotations

import re
from collections.abc import Callable, Iterator
from typing import Any

import pytest
from alembic.autogenerate import compare_metadata
from alembic.runtime.migration import MigrationContext
from sqlalchemy import Column, Connection, MetaData, Text, create_engine, pool, text

from runledger.db import schema, tables
from runledger.db.migrate import sqlalchemy_url
from tests.migrations.helpers import query

TABLES = {
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


def _include_name(name: str | None, type_: str, parent_names: Any) -> bool:
    if type_ == "schema":
        return name == tables.SCHEMA
    if type_ == "table":
        return name != "alembic_version"
    return True


@pytest.fixture
def migrated_conn(database_url: str) -> Iterator[Connection]:
    engine = create_engine(sqlalchemy_url(database_url), poolclass=pool.NullPool)
    try:
        with engine.connect() as conn:
            yield conn
    finally:
        engine.dispose()


def _diff(conn: Connection, metadata: MetaData) -> list[Any]:
    ctx = MigrationContext.configure(
        conn,
        opts={
            "include_schemas": True,
            "include_name": _include_name,
            "compare_type": True,
            "compare_server_default": True,
            "version_table_schema": tables.SCHEMA,
        },
    )
    return list(compare_metadata(ctx, metadata))


def test_metadata_names_every_table() -> None:
    assert {t.name for t in tables.metadata.sorted_tables} == TABLES
    assert all(t.schema == tables.SCHEMA for t in tables.metadata.sorted_tables)


def test_autogenerate_finds_no_difference(migrated_conn: Connection) -> None:
    assert _diff(migrated_conn, tables.metadata) == []


def test_autogenerate_comparison_can_fail(migrated_conn: Connection) -> None:
    """The comparison above is not vacuous: a drifted model is reported."""
    drifted = MetaData(schema=tables.SCHEMA, naming_convention=dict(tables.NAMING_CONVENTION))
    for table in tables.metadata.sorted_tables:
        table.to_metadata(drifted)
    drifted.tables["runledger.runs"].append_column(Column("extra", Text, nullable=True))
    drifted.tables["runledger.run_calls"].c.tool.nullable = True
    drifted.remove(drifted.tables["runledger.workers"])

    kinds = {
        entry[0] if isinstance(entry, tuple) else entry[0][0]
        for entry in _diff(migrated_conn, drifted)
    }
    assert {"add_column", "modify_nullable", "remove_table"} <= kinds


# -- the catalog, as PostgreSQL renders it ----------------------------------------------------


def catalog(url: str) -> dict[str, set[tuple[Any, ...]]]:
    names = sorted(TABLES)
    return {
        "columns": set(
            query(
                url,
                "SELECT c.relname, a.attnum, a.attname, format_type(a.atttypid, a.atttypmod), "
                "       a.attnotnull, pg_get_expr(d.adbin, d.adrelid) "
                "FROM pg_attribute a JOIN pg_class c ON c.oid = a.attrelid "
                "LEFT JOIN pg_attrdef d ON d.adrelid = a.attrelid AND d.adnum = a.attnum "
                "WHERE c.relnamespace = 'runledger'::regnamespace AND c.relname = ANY(%s) "
                "AND a.attnum > 0 AND NOT a.attisdropped",
                (names,),
            )
        ),
        "constraints": set(
            query(
                url,
                "SELECT c.relname, k.conname, k.contype::text, pg_get_constraintdef(k.oid) "
                "FROM pg_constraint k JOIN pg_class c ON c.oid = k.conrelid "
                "WHERE c.relnamespace = 'runledger'::regnamespace AND c.relname = ANY(%s)",
                (names,),
            )
        ),
        "indexes": set(
            query(
                url,
                "SELECT tablename, indexname, indexdef FROM pg_indexes "
                "WHERE schemaname = 'runledger' AND tablename = ANY(%s)",
                (names,),
            )
        ),
    }


def _check_functions() -> list[str]:
    """The CREATE FUNCTION statements of ``runledger._ck_*`` in the living SQL."""
    found = re.findall(
        r"^CREATE FUNCTION runledger\._ck_\w+\(.*?\$\$;", schema.living_sql(), re.M | re.S
    )
    assert len(found) >= 20
    return found


@pytest.fixture
def metadata_database_url(new_empty_database: Callable[[], str]) -> str:
    """An empty database where only ``tables.metadata.create_all`` ran."""
    url = new_empty_database()
    engine = create_engine(sqlalchemy_url(url), poolclass=pool.NullPool)
    try:
        with engine.begin() as conn:
            conn.execute(text("CREATE SCHEMA runledger"))
            # the functions the CHECK constraints call (revision 0027), from the living SQL
            for definition in _check_functions():
                conn.exec_driver_sql(definition)
            tables.metadata.create_all(conn)
    finally:
        engine.dispose()
    return url


def test_catalog_of_create_all_equals_catalog_of_migration(
    database_url: str, metadata_database_url: str
) -> None:
    migrated = catalog(database_url)
    modelled = catalog(metadata_database_url)
    for kind in ("columns", "constraints", "indexes"):
        missing = sorted(migrated[kind] - modelled[kind], key=repr)
        extra = sorted(modelled[kind] - migrated[kind], key=repr)
        assert (missing, extra) == ([], []), f"{kind}: migration-only {missing}, model-only {extra}"


def test_catalog_holds_the_named_invariants(database_url: str) -> None:
    """A few names the rest of the code relies on (ON CONFLICT ON CONSTRAINT, error texts)."""
    got = catalog(database_url)
    constraint_names = {name for _, name, _, _ in got["constraints"]}
    assert {
        "pk_runs",
        "pk_workers",
        "uq_run_calls_idempotency_key",
        "fk_run_turns_run_id_runs",
        "fk_run_calls_turn_run_turns",
        "ck_runs_run_id",
        "ck_runs_running_has_lease",
        "ck_run_calls_key",
    } <= constraint_names
    partial = {
        name: definition for _, name, definition in got["indexes"] if " WHERE " in definition
    }
    assert set(partial) == {
        "ix_runs_claimable",
        "ix_runs_lease_expiry",
        "ix_runs_lease_lock",  # revision 0011
        "ix_runs_finished_at",  # revision 0014
    }
