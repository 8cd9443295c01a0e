"""The baseline 0.1 and the history it replaced (revisions 0001-0032, runledger at 4b19f01).

A database built by that history's own ``alembic upgrade head`` (its migrations directory,
extracted with ``git archive``) and then migrated by this tree has the catalog of a fresh
install of the living files; one at an older revision is refused in one line, and nothing
of it is changed.
"""

from __future__ import annotations

import io
import os
import re
import subprocess
import sys
import tarfile
from collections.abc import Callable
from pathlib import Path

import psycopg
import pytest
from alembic import command
from alembic.config import Config

from runledger.db import migrate, schema
from runledger.errors import SchemaTooOld
from tests.migrations.catalog import differences, snapshot_of
from tests.migrations.helpers import MIGRATIONS, ROOT, query

LAST_BEFORE_BASELINE = "4b19f01"  # the last commit before the baseline: revision 0032
RETIRED = {
    "runledger.claim_runs(text,text[],interval,integer)",
    "runledger.claim_runs_v2(text,text[],interval,integer)",
    "runledger.claim_runs_v3(text,text[],interval,integer)",
    "runledger.record_turn(text,uuid,bigint,integer,jsonb)",
    "runledger.record_turn_v2(text,uuid,bigint,integer,jsonb,jsonb,jsonb)",
    "runledger.record_turn_v3(text,uuid,bigint,integer,jsonb,jsonb,jsonb,bigint,jsonb,boolean)",
    "runledger.register_worker(text,text,integer,text[])",
}


@pytest.fixture(scope="module")
def history(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The migrations of the last commit before the baseline (CI clones the whole history)."""
    archive = subprocess.run(
        ["git", "-C", str(ROOT), "archive", LAST_BEFORE_BASELINE, "migrations"],
        capture_output=True,
        check=False,
    )
    if archive.returncode != 0:
        pytest.fail(
            f"git archive {LAST_BEFORE_BASELINE} failed (a shallow clone? git fetch "
            "--unshallow): " + archive.stderr.decode(errors="replace")
        )
    tree = tmp_path_factory.mktemp("history")
    with tarfile.open(fileobj=io.BytesIO(archive.stdout)) as tar:
        tar.extractall(tree, filter="data")
    return tree / "migrations"


def upgrade_with_history(history: Path, url: str, revision: str) -> None:
    """``alembic upgrade`` with the history's own migrations directory and env.py."""
    config = Config()
    config.set_main_option("script_location", str(history))
    config.set_main_option("sqlalchemy.url", migrate.sqlalchemy_url(url).replace("%", "%%"))
    command.upgrade(config, revision)


def test_the_history_ends_at_0032_which_env_brings_to_the_baseline(history: Path) -> None:
    heads = {p.name[:4] for p in (history / "versions").glob("*.py")}
    assert max(heads) == "0032" and len(heads) == 32
    env = (MIGRATIONS / "env.py").read_text("utf-8")
    assert 'LAST_BEFORE_BASELINE = "0032"' in env
    assert 'BEFORE_BASELINE = frozenset(f"{n:04d}" for n in range(1, 33))' in env
    assert heads == migrate.BEFORE_BASELINE  # runledger.db.migrate knows the same ones
    assert migrate.revision_chain()[0] == "0.1"  # the base; later revisions are deltas


def test_a_database_at_0032_upgrades_to_the_catalog_of_a_fresh_install(
    history: Path, new_empty_database: Callable[[], str]
) -> None:
    installed = new_empty_database()
    with psycopg.connect(installed) as conn:
        schema.install(conn)
    url = new_empty_database()
    upgrade_with_history(history, url, "head")
    assert migrate.current(url) == "0032"
    assert migrate.behind("0032") and migrate.known("0032")
    at_0032 = snapshot_of(url)
    assert set(at_0032["functions"]) >= RETIRED  # not vacuous: there is something to retire
    with psycopg.connect(url, autocommit=True) as conn:  # data survives the stamp
        conn.execute("SELECT * FROM runledger.submit_run('r1', 'f', '1', '{}'::jsonb)")

    migrate.upgrade(url)

    assert migrate.current(url) == migrate.head()
    upgraded = snapshot_of(url)
    assert not RETIRED & set(upgraded["functions"])
    names = ("0032 upgraded", "fresh install")
    assert differences(upgraded, snapshot_of(installed), names) == []
    assert query(url, "SELECT run_id, status FROM runledger.runs") == [("r1", "queued")]
    migrate.upgrade(url)  # nothing more to do
    assert query(url, "SELECT version_num FROM runledger.alembic_version") == [(migrate.head(),)]


def test_a_database_before_0032_is_refused_in_one_line_and_left_as_it_was(
    history: Path, new_empty_database: Callable[[], str]
) -> None:
    url = new_empty_database()
    upgrade_with_history(history, url, "0030")
    before = snapshot_of(url)

    with pytest.raises(SchemaTooOld, match=r"revision 0030, older than runledger 0\.1"):
        migrate.upgrade(url)

    done = subprocess.run(
        [sys.executable, "-m", "runledger", "migrate"],
        env={**os.environ, "RUNLEDGER_DATABASE_URL": url},
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )
    assert done.returncode == 3, done.stderr  # the schema is missing or behind (EXIT_CODES)
    assert re.fullmatch(
        r"error: SchemaTooOld: the database is at revision 0030, older than runledger 0\.1 "
        r"can upgrade \(from 0032 only\): recreate it, or first run `runledger migrate` of "
        r"runledger at commit 4b19f01, then this one\n",
        done.stderr,
    ), done.stderr
    assert done.stdout == ""
    assert differences(snapshot_of(url), before, ("after the refusals", "at 0030")) == []
    checked = subprocess.run(
        [sys.executable, "-m", "runledger", "migrate", "--check"],
        env={**os.environ, "RUNLEDGER_DATABASE_URL": url},
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )
    assert (checked.returncode, checked.stderr) == (
        1,
        f"behind: database at 0030, code at {migrate.head()}\n",
    )
