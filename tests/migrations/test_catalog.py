"""The living files and the revisions build the same database.

``runledger.db.schema.install`` (a fresh install from ``service/runledger/db/sql``) and
``alembic upgrade head`` must give the same catalog: functions with their full
definitions, owners and ACLs; tables, columns, constraints, indexes, triggers, views,
sequences, grants and the settings seed row. A function changed in a revision but not in
the living files (or the other way round) fails here.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import Any

import psycopg
import pytest

from runledger.db import migrate, schema
from runledger.errors import ConfigurationError
from runledger.testing.postgres import Databases
from tests.migrations.catalog import Snapshot, differences, snapshot, snapshot_of

NAMES = ("living files", "alembic upgrade head")


def _install(url: str) -> None:
    with psycopg.connect(url) as conn:
        schema.install(conn)


def snapshot_of_install(url: str) -> Snapshot:
    """The catalog of a fresh install from the living files into the empty ``url``."""
    _install(url)
    return snapshot_of(url)


@pytest.fixture(scope="module")
def installed_url(runledger_databases: Databases) -> Iterator[str]:
    url = runledger_databases.create("rl_cat_inst", migrated=False)
    try:
        _install(url)
        yield url
    finally:
        runledger_databases.drop(url)


@pytest.fixture(scope="module")
def upgraded_url(runledger_databases: Databases) -> Iterator[str]:
    url = runledger_databases.create("rl_cat_up", migrated=False)
    try:
        migrate.upgrade(url)
        yield url
    finally:
        runledger_databases.drop(url)


@pytest.fixture(scope="module")
def upgraded(upgraded_url: str) -> Snapshot:
    return snapshot_of(upgraded_url)


def test_install_and_upgrade_give_the_same_catalog(installed_url: str, upgraded: Snapshot) -> None:
    installed = snapshot_of(installed_url)
    assert differences(installed, upgraded, NAMES) == []


def test_the_snapshot_sees_the_whole_contract(upgraded: Snapshot) -> None:
    """Not vacuous: every kind of object is there, with the names the contract relies on."""
    functions = upgraded["functions"]
    assert "runledger.claim_runs_v4(text,text[],interval,integer)" in functions
    assert "runledger.release_lease(text,uuid,bigint,text,jsonb)" in functions
    # the claim's body (in _claim, which claim_runs_v4 selects from)
    definition = functions["runledger._claim(text,text[],interval,integer,boolean)"][0]
    assert "FOR NO KEY UPDATE OF c SKIP LOCKED" in definition
    claim = functions["runledger.claim_runs_v4(text,text[],interval,integer)"][0]
    assert "runledger._claim(" in claim
    assert "runledger_worker:EXECUTE by <owner>" in functions["runledger.now()"][-1]
    assert {"runs", "run_events_event_id_seq", "pk_runs", "alembic_version"} <= set(
        upgraded["relations"]
    )
    assert "runs.ck_runs_running_has_lease" in upgraded["constraints"]
    assert "ix_runs_claimable" in upgraded["indexes"]
    assert upgraded["triggers"]["runs.tg_runs_guard"][-1] == "A"  # ENABLE ALWAYS
    assert {"run_timeline", "effect_ledger", "lease_history"} == set(upgraded["views"])
    assert "run_events_event_id_seq" in upgraded["sequences"]
    assert "runledger_auditor:USAGE by <owner>" in upgraded["schema"]["runledger"][-1]
    assert upgraded["settings"] == {"true": (1048576, "00:00:00")}
    assert upgraded["alembic_version"] == {migrate.head(): ()}


# -- the comparison can fail ------------------------------------------------------------------

CHANGES: dict[str, tuple[str, str]] = {
    # a function body changed in one database only
    "function body": (
        """
        CREATE OR REPLACE FUNCTION runledger._check_run_id(p_run_id text) RETURNS void
        LANGUAGE plpgsql IMMUTABLE
        SET search_path = pg_catalog, runledger, pg_temp
        AS $$ BEGIN RETURN; END $$
        """,
        "functions runledger._check_run_id(text) differs",
    ),
    "grant": (
        "REVOKE EXECUTE ON FUNCTION runledger.release_lease(text, uuid, bigint, text, jsonb) "
        "FROM runledger_worker",
        "functions runledger.release_lease(text,uuid,bigint,text,jsonb) differs",
    ),
    "search_path": (
        "ALTER FUNCTION runledger._event(text, text, text, bigint, bigint, jsonb, timestamptz) "
        "SET search_path = pg_catalog, pg_temp",
        "functions runledger._event(",
    ),
    "trigger disabled": (
        "ALTER TABLE runledger.runs DISABLE TRIGGER tg_runs_guard",
        "triggers runs.tg_runs_guard differs",
    ),
    "column default": (
        "ALTER TABLE runledger.runs ALTER COLUMN priority SET DEFAULT 1",
        "columns runs.priority differs",
    ),
    "constraint": (
        "ALTER TABLE runledger.run_calls DROP CONSTRAINT ck_run_calls_attempts",
        "constraints run_calls.ck_run_calls_attempts: only in alembic upgrade head",
    ),
    "index": (
        "DROP INDEX runledger.ix_runs_status",
        "indexes ix_runs_status: only in alembic upgrade head",
    ),
    "view": (
        "CREATE OR REPLACE VIEW runledger.run_timeline AS SELECT e.run_id, e.event_id, e.at, "
        "e.kind, e.actor, e.fencing_token, e.state_version, e.detail FROM runledger.run_events e "
        "WHERE e.kind <> 'checkpoint'",
        "views run_timeline differs",
    ),
    "table grant": (
        "GRANT INSERT ON runledger.run_events TO runledger_worker",
        "relations run_events differs",
    ),
    "schema grant": (
        "REVOKE USAGE ON SCHEMA runledger FROM runledger_auditor",
        "schema runledger differs",
    ),
    "sequence": (
        "ALTER SEQUENCE runledger.run_events_event_id_seq INCREMENT BY 2",
        "sequences run_events_event_id_seq differs",
    ),
    "settings seed": (
        "UPDATE runledger.settings SET max_payload_bytes = 2048",
        "settings true differs",
    ),
}


@pytest.mark.parametrize("change", sorted(CHANGES))
def test_the_comparison_reports_a_deliberate_difference(
    change: str, installed_url: str, upgraded: Snapshot
) -> None:
    statement, expected = CHANGES[change]
    with psycopg.connect(installed_url) as conn:
        try:
            conn.execute(statement)  # type: ignore[call-overload]
            changed = snapshot(conn)
        finally:
            conn.rollback()
    found = differences(changed, upgraded, NAMES)
    assert found, f"{change}: the comparison saw no difference"
    assert any(entry.startswith(expected) for entry in found), found
    # and the rollback left the installed database as it was
    assert differences(snapshot_of(installed_url), upgraded, NAMES) == []


# -- install: stamped at head, refuses a second time, migrate agrees -------------------------


def test_install_stamps_head_so_migrate_sees_it_current(installed_url: str) -> None:
    assert migrate.current(installed_url) == migrate.head()
    migrate.upgrade(installed_url)  # nothing to do: no revision runs again
    with psycopg.connect(installed_url) as conn:
        rows: list[Any] = conn.execute("SELECT count(*) FROM runledger.settings").fetchall()
    assert rows == [(1,)]


def test_install_refuses_a_database_that_has_the_schema(installed_url: str) -> None:
    with pytest.raises(ConfigurationError, match="already installed"):
        _install(installed_url)


def test_install_refuses_a_migrated_database(new_empty_database: Callable[[], str]) -> None:
    url = new_empty_database()
    migrate.upgrade(url)
    with pytest.raises(ConfigurationError, match="already installed"):
        _install(url)
    assert migrate.current(url) == migrate.head()


# -- the head's downgrade restores the revision before it exactly -------------------------------


def test_downgrade_of_the_head_restores_the_revision_before_it(
    new_empty_database: Callable[[], str],
) -> None:
    """The head gives back the catalog of the revision before it exactly; the baseline's
    (no revision before it) an empty schema runledger with an empty version table."""
    from alembic.script import ScriptDirectory

    script = ScriptDirectory.from_config(migrate.alembic_config(None))
    head = script.get_revision(migrate.head())
    assert head is not None
    previous = head.down_revision if isinstance(head.down_revision, str) else "base"
    url = new_empty_database()
    migrate.upgrade(url, previous)
    if previous == "base":  # the version table, as Alembic leaves it after a downgrade
        migrate.upgrade(url)
        migrate.downgrade(url, "base")
    before = snapshot_of(url)
    migrate.upgrade(url)
    assert differences(before, snapshot_of(url), (previous, head.revision)) != []
    migrate.downgrade(url, previous)
    assert differences(snapshot_of(url), before, (f"{head.revision} downgraded", previous)) == []
    migrate.upgrade(url)  # and up again: the same catalog as a fresh install
    assert differences(snapshot_of(url), snapshot_of_install(new_empty_database()), NAMES) == []
