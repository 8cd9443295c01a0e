"""Alembic environment for runledger.

Online: takes a session advisory lock so that several processes running
``runledger migrate`` at once apply each revision exactly once (Alembic reads the
current revision only after the lock is held). Each revision is its own transaction; a
revision of HOLD_EVENT_WRITERS first takes ``runledger.runs`` from the writers of events
(:func:`_hold_event_writers`). Offline (``--sql``): prints the SQL.
"""

from __future__ import annotations

import logging
import random
import time
from collections.abc import Callable, Iterable, Iterator
from typing import Any

from alembic import context
from alembic.util import CommandError
from sqlalchemy import create_engine, pool, text
from sqlalchemy.exc import DBAPIError

MIGRATE_LOCK_KEY = 7_210_551_234_001  # pg_advisory_lock key for migrations
VERSION_SCHEMA = "runledger"

# The revisions that change what a write of events puts in run_events, during which no
# event write may be in flight (_hold_event_writers): 0016 starts the hash chain. A
# revision that changes the chain again (the hash's input, its order) belongs here;
# tests/migrations/test_rolling_upgrade.py names the revisions that define the writers.
HOLD_EVENT_WRITERS = frozenset({"0016"})

# How a revision waits for runledger.runs (see _hold_event_writers): one try of at most
# HOLD_TRY_SECONDS (the longest the workers queue behind it), then a pause that lets
# them through, for at most HOLD_SECONDS in all (config attribute "hold_seconds": tests).
HOLD_TRY_SECONDS = 1.0
HOLD_SECONDS = 300.0

config = context.config
log = logging.getLogger("runledger.migrate")


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
        steps = context.get_context().opts["fn"]  # the command's: upgrade or downgrade
        context.configure(
            connection=connection,
            version_table_schema=VERSION_SCHEMA,
            transaction_per_migration=True,
            fn=_each_holding_event_writers(steps, connection),
        )
        with context.begin_transaction():
            context.run_migrations()
        connection.commit()
    finally:
        connection.execute(text("SELECT pg_advisory_unlock(:k)"), {"k": MIGRATE_LOCK_KEY})
        connection.commit()


def _each_holding_event_writers(
    steps: Callable[..., Iterable[Any]], connection: Any
) -> Callable[..., Iterator[Any]]:
    """The command's steps, up or down; the transaction of a revision of
    HOLD_EVENT_WRITERS begins with :func:`_hold_event_writers`. Alembic asks for the
    next step after it committed the one before, and begins the step's transaction on
    the connection as it finds it: the lock's statement has begun it, so the step runs in
    it."""

    def each(heads: Any, migration_context: Any) -> Iterator[Any]:
        for step in steps(heads, migration_context):
            revision = getattr(getattr(step, "revision", None), "revision", None)
            if revision in HOLD_EVENT_WRITERS:
                _hold_event_writers(connection, revision)
            yield step

    return each


def _hold_event_writers(connection: Any, revision: str) -> None:
    """Take ``runledger.runs`` in ACCESS EXCLUSIVE mode, in the transaction of the
    revision about to run, so that no event write is in flight while it runs.

    A session runs a function with the body it found when it entered it, to the end, even
    when a revision replaced the body meanwhile. Without this lock, a writer that had
    entered the old ``runledger._event`` and then waited for ``run_events`` (revision
    0016 takes it to add the hash column) inserted its event after 0016 committed, with
    the old body: no hash, an id past checkpoint 0's, and ``runledger audit`` failed
    (``event_chain_broken``: the event has no hash; ``checkpoint_head_changed`` once a
    checkpoint recorded it as a head). Every writer of a run's events locks the run, or
    reads it, in a statement before it enters ``_event`` (or ``_events``): a writer that
    holds ``runs`` is waited for, and one that comes meanwhile waits before the event
    writer, then enters the body the revision committed.

    Only for the revisions that need it: a writer held here goes on, once the revision
    committed, with the rest of its own function's old body. Revision 0002 dropped a
    helper that 0001's bodies call after they lock the run (``_check_json`` of four
    arguments): held there too, a worker of 0001 had its write refused
    (``UndefinedFunction``).

    Each try waits at most HOLD_TRY_SECONDS (``lock_timeout``, in a savepoint), so the
    workers queue behind the lock that long at most; between tries they go on. After
    HOLD_SECONDS the migration stops (CommandError, one line from ``runledger migrate``)
    naming the sessions that held the table.
    """
    if connection.execute(text("SELECT to_regclass('runledger.runs')")).scalar() is None:
        return  # an empty database: no writer yet
    previous = connection.execute(text("SELECT current_setting('lock_timeout')")).scalar()
    hold_seconds = float(config.attributes.get("hold_seconds", HOLD_SECONDS))
    deadline = time.monotonic() + hold_seconds
    waited = False
    while True:
        savepoint = connection.begin_nested()
        try:
            connection.execute(
                text("SELECT set_config('lock_timeout', :t, true)"),
                {"t": f"{int(HOLD_TRY_SECONDS * 1000)}ms"},
            )
            connection.execute(text("LOCK TABLE runledger.runs IN ACCESS EXCLUSIVE MODE"))
        except DBAPIError as exc:
            savepoint.rollback()  # the setting goes with it
            if getattr(exc.orig, "sqlstate", None) != "55P03":
                raise
            if time.monotonic() >= deadline:
                raise CommandError(
                    f"runledger.runs was not free within {hold_seconds:g} s (held by"
                    f" {_holders(connection)}); nothing of revision {revision} was applied:"
                    " run `runledger migrate` again once they are done"
                ) from exc
            if not waited:
                log.warning("runledger.runs is held by %s; trying again", _holders(connection))
            waited = True
            time.sleep(random.uniform(0.05, 0.25))
        else:
            savepoint.commit()
            connection.execute(text("SELECT set_config('lock_timeout', :t, true)"), {"t": previous})
            return


def _holders(connection: Any) -> str:
    rows = connection.execute(
        text(
            "SELECT a.pid, a.application_name, a.state, left(a.query, 80) AS query "
            "FROM pg_locks l JOIN pg_stat_activity a USING (pid) "
            "WHERE l.relation = 'runledger.runs'::regclass AND l.granted "
            "AND a.pid <> pg_backend_pid() ORDER BY a.pid LIMIT 5"
        )
    ).all()
    return "; ".join(f"pid {r.pid} {r.application_name!r} {r.state}: {r.query}" for r in rows) or (
        "sessions that have gone since"
    )


if context.is_offline_mode():
    run_offline()
else:
    run_online()
