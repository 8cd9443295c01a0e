"""Alembic environment for runledger.

Online: takes a session advisory lock so that several processes running
``runledger migrate`` at once apply each revision exactly once (Alembic reads the
current revision only after the lock is held). Each revision is its own transaction; a
revision of HOLD_EVENT_WRITERS first takes ``runledger.runs`` from the writers of events
(:func:`_hold_event_writers`). Offline (``--sql``): prints the SQL.

Revisions 0001-0032 of the unreleased history are gone: the baseline 0.1 replaced them.
Under the same lock, before Alembic looks for the database's revision (it could not find
those), a database at 0032 is brought to the baseline and stamped
(:func:`_bring_to_baseline`); one at an older revision is refused in one line.
"""

from __future__ import annotations

import logging
import random
import time
from collections.abc import Callable, Iterable, Iterator
from pathlib import Path
from typing import Any

from alembic import context
from alembic.util import CommandError
from sqlalchemy import create_engine, pool, text
from sqlalchemy.exc import DBAPIError

MIGRATE_LOCK_KEY = 7_210_551_234_001  # pg_advisory_lock key for migrations
VERSION_SCHEMA = "runledger"

# The revisions that change what a write of events puts in run_events, during which no
# event write may be in flight (_hold_event_writers). None since the baseline: 0.1 runs
# on an empty database, and from 0032 it changes no event writer's behaviour. A revision
# that changes the chain (the hash's input, its order) belongs here;
# tests/migrations/test_rolling_upgrade.py names the revisions that define the writers.
# (Config attribute "hold_event_writers" replaces the set: tests.)
HOLD_EVENT_WRITERS: frozenset[str] = frozenset()

# The baseline and the revisions of the history it replaced (see the module docstring).
BASELINE = "0.1"
LAST_BEFORE_BASELINE = "0032"  # runledger at commit 4b19f01
BEFORE_BASELINE = frozenset(f"{n:04d}" for n in range(1, 33))
FROM_LAST_BEFORE_BASELINE = Path(__file__).parent / "versions" / "0_1_baseline.from_0032.sql"

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
        _bring_to_baseline(connection)
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


def _bring_to_baseline(connection: Any) -> None:
    """A database at LAST_BEFORE_BASELINE gets FROM_LAST_BEFORE_BASELINE (the function
    versions the baseline retired dropped, the functions whose text changed replaced) and
    the baseline in its version table, in one transaction: the catalog of a fresh install
    of the baseline (tests/migrations/test_baseline.py). A database at an older revision
    of that history is refused (CommandError, one line; config attribute
    "before_baseline" names its revision), and nothing is written."""
    found = connection.execute(text("SELECT to_regclass('runledger.alembic_version')")).scalar()
    if found is None:
        connection.commit()
        return
    versions = set(
        connection.execute(text("SELECT version_num FROM runledger.alembic_version")).scalars()
    )
    if versions == {LAST_BEFORE_BASELINE}:
        sql = FROM_LAST_BEFORE_BASELINE.read_text(encoding="utf-8")
        # Sent as is through the driver (no bind-parameter parsing of % or :name).
        connection.connection.driver_connection.execute(sql)
        connection.execute(
            text("UPDATE runledger.alembic_version SET version_num = :b WHERE version_num = :a"),
            {"a": LAST_BEFORE_BASELINE, "b": BASELINE},
        )
        connection.commit()
        log.info("revision %s brought to the baseline %s", LAST_BEFORE_BASELINE, BASELINE)
        return
    connection.commit()
    older = sorted(versions & BEFORE_BASELINE)
    if older:
        config.attributes["before_baseline"] = older[0]
        raise CommandError(
            f"the database is at revision {older[0]}, older than runledger 0.1 can upgrade"
            f" (from {LAST_BEFORE_BASELINE} only): recreate it, or first run `runledger"
            f" migrate` of runledger at commit 4b19f01, then this one"
        )


def _each_holding_event_writers(
    steps: Callable[..., Iterable[Any]], connection: Any
) -> Callable[..., Iterator[Any]]:
    """The command's steps, up or down; the transaction of a revision of
    HOLD_EVENT_WRITERS begins with :func:`_hold_event_writers`. Alembic asks for the
    next step after it committed the one before, and begins the step's transaction on
    the connection as it finds it: the lock's statement has begun it, so the step runs in
    it."""

    held = config.attributes.get("hold_event_writers", HOLD_EVENT_WRITERS)

    def each(heads: Any, migration_context: Any) -> Iterator[Any]:
        for step in steps(heads, migration_context):
            revision = getattr(getattr(step, "revision", None), "revision", None)
            if isinstance(revision, str) and revision in held:
                _hold_event_writers(connection, revision)
            yield step

    return each


def _hold_event_writers(connection: Any, revision: str) -> None:
    """Take ``runledger.runs`` in ACCESS EXCLUSIVE mode, in the transaction of the
    revision about to run, so that no event write is in flight while it runs.

    A session runs a function with the body it found when it entered it, to the end, even
    when a revision replaced the body meanwhile. Without this lock, a writer that had
    entered the old ``runledger._event`` and then waited for ``run_events`` (which a
    revision takes to alter it) inserts its event after the revision committed, with the
    old body: for a change of the hash chain, an event the chain's new rule does not
    link, and ``runledger audit`` fails (``event_chain_broken``;
    ``checkpoint_head_changed`` once a checkpoint recorded it as a head). Every writer of a
    run's events locks the run, or reads it, in a statement before it enters ``_event``
    (or ``_events``): a writer that holds ``runs`` is waited for, and one that comes
    meanwhile waits before the event writer, then enters the body the revision committed.

    Only for the revisions that need it: a writer held here goes on, once the revision
    committed, with the rest of its own function's old body, and a revision that drops a
    helper such a body calls after it locks the run would have its write refused
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
