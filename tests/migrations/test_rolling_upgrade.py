"""`runledger migrate` under writers of the release before: a revision of
HOLD_EVENT_WRITERS (migrations/env.py) holds the writers of events outside the event
writer, so a write that comes while it runs enters the event writer the revision committed.

No revision since the baseline changes the event writers, so the set is empty; these tests
hold a revision of their own (a copy of migrations/ with one more revision after the
head, which alters run_events as a change of the chain would: a column whose default tells
an event written after the revision committed from one before). The migration is stopped
before it commits by a session that holds the version table (SHARE mode lets Alembic read
it and makes its UPDATE wait): what a worker's write does meanwhile is then a matter of
locks, not of timing. tests/process/test_rolling_upgrade.py runs real workers of an
earlier commit through the whole upgrade.
"""

from __future__ import annotations

import ast
import logging
import os
import re
import shutil
import subprocess
import sys
import threading
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import psycopg
import pytest
from alembic import command
from alembic.config import Config
from alembic.util import CommandError

from runledger.audit import CHAIN_CHECKS
from runledger.db import migrate
from runledger.testing import wait_for
from tests.migrations.helpers import MIGRATIONS

HELD = "0.1.held"  # the tests' revision after the head, which alters run_events
HELD_SQL = """
ALTER TABLE runledger.run_events ADD COLUMN after_held boolean NOT NULL DEFAULT false;
ALTER TABLE runledger.run_events ALTER COLUMN after_held SET DEFAULT true;
"""


class Background:
    """``fn`` in a thread; ``join`` re-raises what it raised."""

    def __init__(self, fn: Callable[[], Any]) -> None:
        self.error: BaseException | None = None

        def run() -> None:
            try:
                fn()
            except BaseException as exc:
                self.error = exc

        self.thread = threading.Thread(target=run, daemon=True)
        self.thread.start()

    def join(self, timeout: float = 60.0) -> None:
        self.thread.join(timeout)
        assert not self.thread.is_alive(), "still running"
        if self.error is not None:
            raise self.error


@contextmanager
def version_table_held(url: str) -> Iterator[psycopg.Connection[Any]]:
    """A transaction holding runledger.alembic_version in SHARE mode: a migration reads
    the version, runs its revision, then waits to write the version (before its commit).
    Committing the connection lets it go on."""
    with psycopg.connect(url) as holder:
        holder.execute("LOCK TABLE runledger.alembic_version IN SHARE MODE")
        yield holder


def waiting_for(admin: psycopg.Connection[Any], pid: int) -> list[int]:
    """The backends that wait for a lock ``pid`` holds."""
    rows = admin.execute(
        "SELECT pid FROM pg_stat_activity WHERE %s = ANY (pg_blocking_pids(pid)) ORDER BY pid",
        (pid,),
    ).fetchall()
    return [int(r[0]) for r in rows]


def awaited_table(admin: psycopg.Connection[Any], pid: int) -> str | None:
    row = admin.execute(
        "SELECT relation::regclass::text FROM pg_locks WHERE pid = %s AND NOT granted",
        (pid,),
    ).fetchone()
    return None if row is None else str(row[0])


def chain_findings(admin: psycopg.Connection[Any]) -> dict[str, list[Any]]:
    """What runledger audit's hash-chain checks find (empty lists: it passes)."""
    return {c.name: admin.execute(c.sql).fetchall() for c in CHAIN_CHECKS}


@pytest.fixture
def held_config(
    empty_database_url: str, tmp_path: Path
) -> Iterator[tuple[Config, str, psycopg.Connection[Any]]]:
    """A database at the head with a queued run ``r1``, and the config of a copy of
    migrations/ with revision HELD after the head, in the held set."""
    url = empty_database_url
    migrate.upgrade(url)
    copy = tmp_path / "migrations"
    shutil.copytree(MIGRATIONS, copy, ignore=shutil.ignore_patterns("__pycache__"))
    module = (MIGRATIONS / "versions" / "0_1_baseline.py").read_text("utf-8")
    module = module.replace('revision = "0.1"', f"revision = {HELD!r}")
    module = module.replace("down_revision = None", f"down_revision = {migrate.head()!r}")
    (copy / "versions" / "held.py").write_text(module, "utf-8")
    (copy / "versions" / "held.sql").write_text(HELD_SQL, "utf-8")
    (copy / "versions" / "held.down.sql").write_text(
        "ALTER TABLE runledger.run_events DROP COLUMN after_held;", "utf-8"
    )
    config = migrate.alembic_config(url)
    config.set_main_option("script_location", str(copy))
    config.attributes["hold_event_writers"] = frozenset({HELD})
    with psycopg.connect(url, autocommit=True) as admin:
        admin.execute("SELECT * FROM runledger.submit_run('r1', 'f', '1', '{}'::jsonb)")
        yield config, url, admin


def test_a_write_during_a_held_revision_waits_outside_the_event_writer(
    held_config: tuple[Config, str, psycopg.Connection[Any]],
) -> None:
    config, url, admin = held_config
    with version_table_held(url) as holder:
        migration = Background(lambda: command.upgrade(config, HELD))
        (migrator,) = wait_for(
            lambda: waiting_for(admin, holder.info.backend_pid), what="HELD done, uncommitted"
        )
        with psycopg.connect(url, autocommit=True) as writer:
            pid = writer.info.backend_pid
            write = Background(
                lambda: writer.execute("SELECT runledger.cancel_run('r1', 'operator', 'test')")
            )
            wait_for(lambda: pid in waiting_for(admin, migrator), what="the cancel waiting")
            # The cancel waits for the run's table, before it enters runledger._event. Were
            # it let in, its _event would wait for run_events (the revision alters it) and
            # insert after the commit with the body it entered before.
            assert awaited_table(admin, pid) == "runledger.runs"
            holder.commit()
            migration.join()
            write.join()

    assert admin.execute("SELECT version_num FROM runledger.alembic_version").fetchone() == (HELD,)
    events = admin.execute(
        "SELECT event_id, kind, hash IS NOT NULL, after_held FROM runledger.run_events"
        " ORDER BY event_id"
    ).fetchall()
    assert events == [(1, "submitted", True, False), (2, "run_cancelled", True, True)]
    assert admin.execute(
        "SELECT runs, created FROM runledger.checkpoint_events('test', interval '0')"
    ).fetchone() == (1, True)
    assert chain_findings(admin) == {c.name: [] for c in CHAIN_CHECKS}


def test_the_hold_waits_for_a_write_in_flight_trying_again(
    held_config: tuple[Config, str, psycopg.Connection[Any]], caplog: pytest.LogCaptureFixture
) -> None:
    """A writer that holds the run when the revision starts ends first, with its event
    before the revision; the migration's lock waits one try (lock_timeout) after another
    meanwhile, letting the other sessions through between them."""
    config, url, admin = held_config
    caplog.set_level(logging.WARNING, logger="runledger.migrate")
    with psycopg.connect(url, application_name="writer-in-flight") as writer:
        writer.execute("SELECT runledger.cancel_run('r1', 'operator', 'test')")  # uncommitted
        migration = Background(lambda: command.upgrade(config, HELD))
        (migrator,) = wait_for(
            lambda: waiting_for(admin, writer.info.backend_pid), what="HELD waiting for runs"
        )

        def started() -> Any:
            row = admin.execute(
                "SELECT query_start FROM pg_stat_activity WHERE pid = %s", (migrator,)
            ).fetchone()
            return row[0] if row else None

        first = started()
        wait_for(lambda: started() != first, timeout=30, what="a second try of the lock")
        # a try gives up after HOLD_TRY_SECONDS: a read that queued behind it gets through
        with psycopg.connect(url, autocommit=True, options="-c statement_timeout=20s") as reader:
            assert reader.execute("SELECT count(*) FROM runledger.runs").fetchone() == (1,)
        assert admin.execute("SELECT version_num FROM runledger.alembic_version").fetchone() == (
            migrate.head(),
        )
        writer.commit()
        migration.join()

    assert any("writer-in-flight" in r.getMessage() for r in caplog.records), caplog.text
    events = admin.execute(
        "SELECT kind, after_held FROM runledger.run_events ORDER BY event_id"
    ).fetchall()
    assert events == [("submitted", False), ("run_cancelled", False)]  # both before it
    assert chain_findings(admin) == {c.name: [] for c in CHAIN_CHECKS}


def test_the_hold_gives_up_naming_the_session_that_holds_the_runs(
    held_config: tuple[Config, str, psycopg.Connection[Any]],
) -> None:
    config, url, admin = held_config
    config.attributes["hold_seconds"] = 2.0
    with psycopg.connect(url, application_name="long-writer") as writer:
        writer.execute("SELECT runledger.cancel_run('r1', 'operator', 'test')")  # uncommitted
        migration = Background(lambda: command.upgrade(config, HELD))
        with pytest.raises(
            CommandError, match=r"not free within 2 s \(held by pid \d+ 'long-writer'"
        ):
            migration.join(timeout=60)
    assert admin.execute("SELECT version_num FROM runledger.alembic_version").fetchone() == (
        migrate.head(),
    )
    command.upgrade(config, HELD)  # once the writer is gone
    assert chain_findings(admin) == {c.name: [] for c in CHAIN_CHECKS}


# Each revision that defines a writer of run_events, or alters the table (and the step
# that brings a database of 0032 to the baseline). Those that change what a write puts
# there (the hash, its input, the chain's order) are in HOLD_EVENT_WRITERS; the others
# keep the chain as it was, and a write that ends on their old body is still a link of it.
EVENT_WRITER_REVISIONS = {
    "0.1": "the baseline: an empty database, no writer yet",
    "0.1 from 0032": "_event and _events: the same body, comments aside: same links",
}
WRITER = re.compile(
    r"FUNCTION\s+runledger\.(_event|_events|_event_rows|_event_hash)\s*\("
    r"|INSERT\s+INTO\s+runledger\.run_events\b"
    r"|ALTER\s+TABLE\s+(ONLY\s+)?runledger\.run_events\b",
    re.IGNORECASE,
)


def _revision_of(sql: Path) -> str:
    """The revision a SQL file of migrations/versions belongs to (its module's
    ``revision``), with `` from <revision>`` for a step from a history before it."""
    stem, _, step = sql.name.removesuffix(".sql").partition(".")
    tree = ast.parse((sql.parent / f"{stem}.py").read_text("utf-8"))
    (revision,) = [
        str(node.value.value)
        for node in tree.body
        if isinstance(node, ast.Assign)
        and any(isinstance(t, ast.Name) and t.id == "revision" for t in node.targets)
        and isinstance(node.value, ast.Constant)
    ]
    return f"{revision} {step.replace('_', ' ')}" if step else str(revision)


def test_each_revision_that_changes_the_event_writers_says_whether_it_holds_them() -> None:
    """A new revision that defines the writers of run_events (or alters the table) is a
    decision: if it changes what they write, add it to HOLD_EVENT_WRITERS in
    migrations/env.py; then name it in EVENT_WRITER_REVISIONS here."""
    found = {
        _revision_of(path)
        for path in sorted((MIGRATIONS / "versions").glob("*.sql"))
        if not path.name.endswith(".down.sql") and WRITER.search(path.read_text("utf-8"))
    }
    assert found == set(EVENT_WRITER_REVISIONS)
    env = (MIGRATIONS / "env.py").read_text("utf-8")
    (held,) = re.findall(r"HOLD_EVENT_WRITERS: frozenset\[str\] = frozenset\((.*)\)\n", env)
    assert set(re.findall(r'"([^"]+)"', held)) == {
        r for r, why in EVENT_WRITER_REVISIONS.items() if why.startswith("HOLD")
    }


def test_what_migrate_refuses_is_one_line(empty_database_url: str) -> None:
    """Alembic's refusals (here a revision that does not exist; also a revision that could
    not hold the event writers) reach the user as one line and exit 1, not a traceback."""
    done = subprocess.run(
        [sys.executable, "-m", "runledger", "migrate", "--revision", "9999"],
        env={**os.environ, "RUNLEDGER_DATABASE_URL": empty_database_url},
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )
    assert (done.returncode, done.stderr) == (
        1,
        "error: RunLedgerError: Can't locate revision identified by '9999'\n",
    )
