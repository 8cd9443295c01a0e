"""Alembic environment for runledger.

Online: takes a session advisory lock so that several processes running
``runledger migrate`` at once apply each revision exactly once (Alembic reads the
current revision only after the lock is held). Offline (``--sql``): prints the SQL.
"""

from __future__ import annotations

from alembic import context
from sqlalchemy import create_engine, pool, text

MIGRATE_LOCK_KEY = 7_210_551_234_001  # pg_advisory_lock key for migrations
VERSION_SCHEMA = "runledger"

config = context.config


def _url() -> str:
    url = config.get_main_option("sqlalchemy.url") or ""
    if url.startswith("postgresql://") or url.startswith("postgres://"):
        url = "postgresql+psycopg://" + url.split("://", 1)[1]
    return url


def run_offline() -> None:
    context.configure(
        url=_url() or "postgresql+psycopg://",
        literal_binds=True,
        version_table_schema=VERSION_SCHEMA,
        dialect_opts={"paramstyle": "named"},
    )
    with context.begin_transaction():
        context.get_context().impl.static_output("CREATE SCHEMA IF NOT EXISTS runledger;")
        context.run_migrations()


def run_online() -> None:
    connection = config.attributes.get("connection")
    if connection is not None:
        _migrate(connection)
        return
    engine = create_engine(_url(), poolclass=pool.NullPool)
    with engine.connect() as conn:
        _migrate(conn)
    engine.dispose()


def _migrate(connection) -> None:  # type: ignore[no-untyped-def]
    connection.execute(text("SELECT pg_advisory_lock(:k)"), {"k": MIGRATE_LOCK_KEY})
    connection.commit()
    try:
        connection.execute(text("CREATE SCHEMA IF NOT EXISTS runledger"))
        connection.commit()
        context.configure(
            connection=connection,
            version_table_schema=VERSION_SCHEMA,
            transaction_per_migration=True,
        )
        with context.begin_transaction():
            context.run_migrations()
        connection.commit()
    finally:
        connection.execute(text("SELECT pg_advisory_unlock(:k)"), {"k": MIGRATE_LOCK_KEY})
        connection.commit()


if context.is_offline_mode():
    run_offline()
else:
    run_online()
