"""A rolling upgrade: workers of an earlier release run a six-turn flow while `runledger
migrate` of this tree upgrades the database under them; new workers start, the old ones are
stopped. Every run finishes, no effect happens twice, and `runledger audit` passes.

Two earlier releases: 0.1.0, the last release, and 4b19f01, the last commit before the 0.1
baseline (revision 0032), whose databases `runledger migrate` brings to the baseline.
Each is a commit of this repository's history, extracted with ``git archive`` and run from
its own ``service/`` directory with this environment's packages. When the release is
behind this tree, the migration is stopped before its first step commits (a session holds
the version table, which it writes last) until a worker of the earlier release has
written meanwhile: a write that comes while the step runs is then certain, not a matter
of timing. When it is at this tree's head (no revision since), `migrate` changes nothing
and the releases' workers share the database.
"""

from __future__ import annotations

import io
import json
import os
import subprocess
import sys
import tarfile
from collections import Counter
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import psycopg
import pytest
from psycopg.types.json import Jsonb

from runledger.db.migrate import behind, head
from runledger.testing import ProviderProcess, WorkerPool, wait_for
from runledger.testing.postgres import Databases
from tests.conftest import DEMO_FLOWS

pytestmark = [pytest.mark.process, pytest.mark.slow, pytest.mark.timeout(240)]

ROOT = Path(__file__).resolve().parents[2]

# The releases the workers are upgraded from: the last release, 0.1.0 (tag v0.1.0), and
# 4b19f01, the last commit before the 0.1 baseline, at revision 0032. A new release
# replaces PREVIOUS_RELEASE with its own commit.
PREVIOUS_RELEASE = "4b83b7ca0e40593713f54237e44f3f9961b51d4b"  # 0.1.0
PRE_BASELINE = "4b19f010a90cc4e3c3a1d7cc21b3c2f2e59a610a"  # revision 0032

RUNS = 80
GATED = 4  # runs whose second call waits at the provider until the upgrade is over
TURNS = [
    {"tool": "ticket", "args": {"title": "t"}},
    {"tool": "charge", "args": {"amount": 3}},
    {"tool": "email", "args": {}},
    {"tool": "ticket", "args": {"title": "u"}},
    {"tool": "charge", "args": {"amount": 4}},
    {"tool": "email", "args": {}},
]
ARGS = ["--poll-seconds", "0.2", "--concurrency", "4", "--grace-seconds", "20"]


class Workers(WorkerPool):
    """Workers named ``<prefix><i>``: both releases' workers are alive at once."""

    def __init__(self, prefix: str, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.prefix = prefix

    def worker_id(self, i: int) -> str:
        return f"{self.prefix}{i}"


@pytest.fixture(
    params=[pytest.param(PREVIOUS_RELEASE, id="0.1.0"), pytest.param(PRE_BASELINE, id="0032")]
)
def previous_release(request: pytest.FixtureRequest, tmp_path: Path) -> Path:
    """The tree of an earlier release (CI clones the whole history)."""
    commit = request.param
    archive = subprocess.run(
        ["git", "-C", str(ROOT), "archive", commit], capture_output=True, check=False
    )
    if archive.returncode != 0:
        pytest.fail(
            f"git archive {commit} failed (a shallow clone? git fetch --unshallow): "
            + archive.stderr.decode(errors="replace")
        )
    tree = tmp_path / "previous"
    with tarfile.open(fileobj=io.BytesIO(archive.stdout)) as tar:
        tar.extractall(tree, filter="data")
    return tree


@pytest.fixture
def upgrade_database(runledger_databases: Databases) -> Iterator[str]:
    url = runledger_databases.create("rl_upgrade", migrated=False)
    try:
        yield url
    finally:
        runledger_databases.drop(url)


def _command(args: list[str], env: dict[str, str], cwd: Path) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "runledger", *args],
        env={**os.environ, **env},
        cwd=cwd,
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )


def _plan(n: int) -> list[list[dict[str, Any]]]:
    turns = [[dict(call, args=dict(call["args"]))] for call in TURNS]
    if n < GATED:
        turns[1][0]["args"]["gate"] = "upgrade"
    return turns


def _waiting_for(conn: psycopg.Connection[Any], pid: int) -> list[int]:
    rows = conn.execute(
        "SELECT pid FROM pg_stat_activity WHERE %s = ANY (pg_blocking_pids(pid)) ORDER BY pid",
        (pid,),
    ).fetchall()
    return [int(r[0]) for r in rows]


def _statuses(conn: psycopg.Connection[Any]) -> Counter[str]:
    return Counter(str(r[0]) for r in conn.execute("SELECT status FROM runledger.runs"))


def test_workers_of_the_previous_release_run_through_the_upgrade(
    previous_release: Path, upgrade_database: str, provider: ProviderProcess
) -> None:
    url = upgrade_database
    old_env = {"PYTHONPATH": str(previous_release / "service")}
    with_provider = {"RUNLEDGER_PROVIDER_URL": provider.url}
    old = Workers(
        "old",
        url,
        ["runledger.demo.flows:flows"],
        env={**old_env, **with_provider},
        args=ARGS,
        cwd=str(previous_release),
    )
    new = Workers("new", url, DEMO_FLOWS, env=with_provider, args=ARGS)
    migrate: subprocess.Popen[str] | None = None
    try:
        # The earlier release installs its schema, and its workers run.
        done = _command(["migrate"], {**old_env, "RUNLEDGER_DATABASE_URL": url}, previous_release)
        assert done.returncode == 0, done.stderr
        with psycopg.connect(url, autocommit=True) as conn:
            (before,) = conn.execute("SELECT version_num FROM runledger.alembic_version").fetchone()
            assert before == head() or behind(before), f"{previous_release} is at {before}"
            for n in range(RUNS):
                conn.execute(
                    "SELECT * FROM runledger.submit_run(%s, 'scripted', '1', %s)",
                    (f"up-{n:03d}", Jsonb({"plan": _plan(n)})),
                )
            provider.client.configure(latency=0.05)
            old.start(2)
            provider.client.wait_for_held("upgrade", GATED, timeout=90)

            if before == head():
                # No revision since that release: this tree's migrate changes nothing.
                done = _command(["migrate"], {"RUNLEDGER_DATABASE_URL": url}, ROOT)
                assert done.returncode == 0, done.stderr
                out, err = done.stdout, done.stderr
            else:
                # This tree's migrate, stopped before its first revision commits until a worker
                # of the earlier release waits for it.
                with psycopg.connect(url) as holder:
                    holder.execute("LOCK TABLE runledger.alembic_version IN SHARE MODE")
                    migrate = subprocess.Popen(
                        [sys.executable, "-m", "runledger", "migrate"],
                        env={**os.environ, "RUNLEDGER_DATABASE_URL": url},
                        cwd=ROOT,
                        stdout=subprocess.PIPE,
                        stderr=subprocess.PIPE,
                        text=True,
                    )
                    try:
                        wait_for(
                            lambda: _waiting_for(conn, holder.info.backend_pid),
                            timeout=60,
                            what="the migration's first revision, done and not committed",
                        )
                        # The workers of the earlier release write meanwhile: the step from
                        # their revision to the baseline takes nothing they use.
                        (during,) = conn.execute(
                            "SELECT max(event_id) FROM runledger.run_events"
                        ).fetchone()
                        wait_for(
                            lambda: conn.execute(
                                "SELECT count(*) > 0 FROM runledger.run_events"
                                " WHERE event_id > %s AND actor LIKE 'old%%'",
                                (during,),
                            ).fetchone()[0],
                            timeout=60,
                            what="a write of the earlier release's workers during the migration",
                        )
                    finally:
                        holder.commit()
                    out, err = migrate.communicate(timeout=120)
            assert migrate is None or migrate.returncode == 0, err
            assert out.strip() == f"migrated: {before} -> {head()}"
            # A checkpoint of the heads the upgrade left (this tree's workers make one every
            # 10 s): an event without its hash there would be a head that changed.
            made = _command(["checkpoint"], {"RUNLEDGER_DATABASE_URL": url}, ROOT)
            assert made.returncode == 0, made.stderr

            # The workers of the earlier release go on on the new schema: the calls they
            # held at the provider all along are journaled now.
            assert old.alive(0) and old.alive(1), old.log(0) + old.log(1)
            (upgraded,) = conn.execute("SELECT max(event_id) FROM runledger.run_events").fetchone()
            provider.client.open_gate("upgrade")
            wait_for(
                lambda: conn.execute(
                    "SELECT count(*) >= %s FROM runledger.run_events WHERE event_id > %s"
                    " AND kind = 'call_succeeded' AND actor LIKE 'old%%'",
                    (GATED, upgraded),
                ).fetchone()[0],
                timeout=60,
                what="the held calls journaled by the earlier release's workers",
            )

            # New workers start; the old ones drain and stop.
            new.start(2)
            for i in range(2):
                old.terminate(i)
            for i in range(2):
                assert old.wait(i, timeout=60) == 0, old.log(i)

            def finished() -> bool:
                statuses = _statuses(conn)
                assert set(statuses) <= {"queued", "running", "succeeded"}, statuses
                return statuses["succeeded"] == RUNS

            wait_for(finished, timeout=120, interval=0.2, what="every run succeeded")
            effects = Counter(e["key"] for e in provider.client.effects())
            assert {k: n for k, n in effects.items() if n > 1} == {}
            assert len(effects) == RUNS * len(TURNS)
            assert {
                str(r[0])[:3]
                for r in conn.execute("SELECT DISTINCT actor FROM runledger.run_events")
                if r[0] is not None
            } == {"old", "new"}

        # A checkpoint of every head, then the audit a user runs.
        this = {"RUNLEDGER_DATABASE_URL": url}
        made = _command(["checkpoint"], this, ROOT)
        assert made.returncode == 0, made.stderr
        audited = _command(["audit", "--json"], this, ROOT)
        assert audited.stdout.startswith("["), audited.stderr
        assert [c for c in json.loads(audited.stdout) if not c["ok"]] == []
        assert audited.returncode == 0
    finally:
        if migrate is not None and migrate.poll() is None:
            migrate.kill()
            migrate.wait(timeout=30)
        new.close()
        old.close()
