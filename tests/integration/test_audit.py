"""`runledger audit`: every invariant check passes on an honest journal and names the
one that breaks when the tables are tampered with."""

from __future__ import annotations

import datetime as dt
import json
from typing import Any

import psycopg
import pytest
from click.testing import CliRunner

from runledger.audit import CHECKS, run_checks
from runledger.cli import main
from runledger.db.store import Store


async def _one_finished_run(store: Store) -> None:
    await store.worker.submit_run("aud-1", "demo", "1", {})
    ((c, _),) = await store.worker.claim_runs("w1", ["demo@1"], dt.timedelta(seconds=30), 1)
    args = (c.run_id, c.lease_id, c.fencing_token)
    await store.worker.record_turn(*args, 0, [{"call_id": "c1", "tool": "t", "args": {}}])
    await store.worker.dispatch_call(*args, "aud-1:0:c1")
    await store.worker.complete_call(*args, "aud-1:0:c1", "succeeded", {"ok": True}, {"id": 1})
    await store.worker.record_turn(*args, 1, [])
    await store.worker.finish_run(*args, "succeeded", {"done": True}, None)


async def test_an_honest_journal_passes_every_check(store: Store, database_url: str) -> None:
    await _one_finished_run(store)
    findings = run_checks(database_url)
    assert [f.check.name for f in findings] == [c.name for c in CHECKS]
    assert all(f.ok for f in findings), [(f.check.name, f.rows) for f in findings if not f.ok]
    result = CliRunner().invoke(main, ["audit", "--database-url", database_url])
    assert result.exit_code == 0, result.output


@pytest.mark.parametrize(
    ("tamper", "check"),
    [
        (
            "INSERT INTO runledger.run_events (run_id, at, kind, actor, fencing_token) "
            "VALUES ('aud-1', now(), 'claimed', 'ghost', 1)",
            "claim_token_reused",
        ),
        (
            "INSERT INTO runledger.run_events (run_id, at, kind, actor, fencing_token) "
            "VALUES ('aud-1', now(), 'checkpoint', 'ghost', 0)",
            "event_token_went_back",
        ),
    ],
)
async def test_tampering_is_named(
    store: Store, database_url: str, admin_conn: psycopg.Connection[Any], tamper: str, check: str
) -> None:
    await _one_finished_run(store)
    admin_conn.execute(tamper)
    broken = {f.check.name for f in run_checks(database_url) if not f.ok}
    # an event written around runledger._event has no hash: its chain breaks too (0016)
    assert broken == {check, "event_chain_broken"}
    result = CliRunner().invoke(main, ["audit", "--database-url", database_url, "--json"])
    assert result.exit_code == 1
    assert f'"check": "{check}"' in result.output


async def test_a_failover_is_reported_with_its_runs(
    store: Store, database_url: str, admin_conn: psycopg.Connection[Any]
) -> None:
    """The database changed timeline (here: the table says it last saw another one):
    the audit cannot vouch for the commits of the old one, and says which runs."""
    await _one_finished_run(store)
    admin_conn.execute("SELECT * FROM runledger.submit_run('aud-open', 'demo', '1', '{}'::jsonb)")
    admin_conn.execute(
        "INSERT INTO runledger.timelines (position, timeline, seen_at) "
        "VALUES (2, runledger._timeline() + 1, now())"
    )
    admin_conn.execute("SELECT * FROM runledger.claim_runs_v4('w1', '{other@1}', '30 s', 1)")
    broken = {f.check.name: f for f in run_checks(database_url) if not f.ok}
    assert set(broken) == {"failover"}
    added, (row,) = broken["failover"].rows[:1], broken["failover"].rows[1:]
    assert added[0]["position"] == 2  # the row the test added: a timeline change too
    assert row["position"] == 3 and row["previous_timeline"] == row["timeline"] + 1
    assert (row["affected_runs"], row["runs"], row["seen_by"]) == (1, ["aud-open"], "w1")
    result = CliRunner().invoke(main, ["audit", "--database-url", database_url])
    assert result.exit_code == 1
    assert "FAIL failover" in result.output


async def test_a_lossless_failover_is_not_a_violation(
    store: Store, database_url: str, admin_conn: psycopg.Connection[Any]
) -> None:
    """The claims had seen every commit wait for the one synchronous standby: the
    promotion lost nothing the audit could miss, so it is not listed; a later failover
    without that evidence is."""
    await _one_finished_run(store)
    admin_conn.execute("SELECT * FROM runledger.submit_run('aud-open', 'demo', '1', '{}'::jsonb)")
    admin_conn.execute(
        "INSERT INTO runledger.commit_guarantees SELECT coalesce(max(position), 0) + 1, "
        "'on', 'n2', runledger._timeline(), now(), 'w0' FROM runledger.commit_guarantees"
    )
    admin_conn.execute(
        "INSERT INTO runledger.timelines (position, timeline, seen_at) "
        "VALUES (2, runledger._timeline() + 1, now())"
    )
    admin_conn.execute("SELECT * FROM runledger.claim_runs_v4('w1', '{other@1}', '30 s', 1)")
    lossless = admin_conn.execute(
        "SELECT position, lossless FROM runledger.timelines WHERE position > 1 ORDER BY 1"
    ).fetchall()
    assert lossless == [(2, None), (3, True)]
    failover = {f.check.name: f for f in run_checks(database_url)}["failover"]
    assert [r["position"] for r in failover.rows] == [2]  # only the row the test added
    # named all the same, with its evidence
    result = CliRunner().invoke(main, ["audit", "--database-url", database_url])
    assert (
        "note failover to timeline 1 (from 2, seen " in result.output
        and "by w1) was lossless: every acknowledged commit was on every synchronous standby "
        "(synchronous_commit on, synchronous_standby_names 'n2'); 0 lease(s) ended, "
        "no run doubted"
        in result.output
    ), result.output
    result = CliRunner().invoke(main, ["audit", "--database-url", database_url, "--json"])
    entries = {c["check"]: c for c in json.loads(result.output)}
    (noted,) = entries["lossless_failovers"]["failovers"]
    assert noted["position"] == 3
    assert noted["evidence"]["commit_guarantee"]["synchronous_standby_names"] == "n2"
    # the claim noted this server's own guarantee (no standby): the next failover is lossy
    admin_conn.execute(
        "INSERT INTO runledger.timelines (position, timeline, seen_at) "
        "VALUES (4, runledger._timeline() + 2, now())"
    )
    admin_conn.execute("SELECT * FROM runledger.claim_runs_v4('w1', '{other@1}', '30 s', 1)")
    failover = {f.check.name: f for f in run_checks(database_url)}["failover"]
    rows = [(r["position"], r["lossless"]) for r in failover.rows]
    assert rows == [(2, None), (4, None), (5, False)]
