"""The tamper-evident event log (revision 0016, docs/audit.md): every event's hash links
it to its run's previous event, checkpoints record the chain heads and chain their own
digests, and `runledger audit` names the first broken link of whatever was changed.

Each forgery is made as the owner with the guard triggers disabled, as a superuser would.
"""

from __future__ import annotations

import asyncio
import dataclasses
import datetime as dt
import hashlib
import json
import re
import threading
from typing import Any

import psycopg
import pytest
from click.testing import CliRunner
from psycopg.rows import dict_row

from runledger.audit import Anchor, audit
from runledger.cli import main
from runledger.db.store import Store
from tests.contract.helpers import chain_links, wait_until, waiting_on_a_lock
from tests.integration.conftest import eventually

Conn = psycopg.Connection[Any]
CHAIN = {"event_chain_broken", "checkpoint_head_changed", "checkpoint_chain_broken"}


async def _finished_run(store: Store, run_id: str, calls: int = 2) -> None:
    await store.worker.submit_run(run_id, "demo", "1", {})
    # concurrent: a claim skips the queued runs other claims hold locked at that moment,
    # and may find none for now; it gets one once those claims have committed
    ((c, _),) = await eventually(
        lambda: store.worker.claim_runs("w1", ["demo@1"], dt.timedelta(seconds=30), 1),
        timeout=30,
        interval=0.01,
        what=f"a queued run to claim after submitting {run_id}",
    )
    args = (c.run_id, c.lease_id, c.fencing_token)
    plan = [{"call_id": f"c{i}", "tool": "t", "args": {"i": i}} for i in range(calls)]
    await store.worker.record_turn(*args, 0, plan)
    for i in range(calls):
        key = f"{c.run_id}:0:c{i}"  # (concurrent: the claim may take another queued run)
        await store.worker.dispatch_call(*args, key)
        await store.worker.complete_call(*args, key, "succeeded", {"ok": i}, {"id": i})
    await store.worker.record_turn(*args, 1, [])
    await store.worker.finish_run(*args, "succeeded", {"done": True}, None)


def _checkpoint(conn: Conn) -> dict[str, Any]:
    row = conn.execute("SELECT * FROM runledger.checkpoint_events('test', interval '0')").fetchone()
    assert row is not None
    return dict(row)


def _events(conn: Conn, run_id: str) -> list[dict[str, Any]]:
    return list(
        conn.execute(
            "SELECT * FROM runledger.run_events WHERE run_id = %s ORDER BY event_id", (run_id,)
        ).fetchall()
    )


def _broken(url: str, *anchors: Anchor) -> dict[str, list[dict[str, Any]]]:
    return {f.check.name: f.rows for f in audit(url, expect=anchors).findings if not f.ok}


class _Unguarded:
    """The guard triggers of the chain's tables off for a block, as a superuser can."""

    TABLES = ("run_events", "event_checkpoints", "event_checkpoint_heads", "event_chain_prunes")

    def __init__(self, conn: Conn) -> None:
        self.conn = conn

    def __enter__(self) -> Conn:
        for t in self.TABLES:
            self.conn.execute(f"ALTER TABLE runledger.{t} DISABLE TRIGGER ALL")  # type: ignore[arg-type]
        return self.conn

    def __exit__(self, *exc: object) -> None:
        for t in self.TABLES:
            self.conn.execute(f"ALTER TABLE runledger.{t} ENABLE TRIGGER ALL")  # type: ignore[arg-type]
        for row in self.conn.execute(
            "SELECT tgrelid::regclass::text AS rel, tgname FROM pg_trigger"
            " WHERE NOT tgisinternal AND tgrelid::regclass::text = ANY(%s)",
            ([f"runledger.{t}" for t in self.TABLES],),
        ).fetchall():
            self.conn.execute(
                f'ALTER TABLE {row["rel"]} ENABLE ALWAYS TRIGGER "{row["tgname"]}"'  # type: ignore[arg-type]
            )


@pytest.fixture
def admin(admin_conn: Conn) -> Conn:
    admin_conn.row_factory = dict_row  # type: ignore[assignment]
    return admin_conn


# -- an honest history --------------------------------------------------------------------


async def test_every_event_is_chained_by_the_documented_formula(
    store: Store, admin: Conn, database_url: str
) -> None:
    await _finished_run(store, "ch-1")
    rows = admin.execute(
        "SELECT e.event_id, e.hash, jsonb_build_array(e.event_id, e.run_id,"
        " (extract(epoch FROM e.at) * 1000000)::bigint, e.kind, e.actor, e.fencing_token,"
        " e.state_version, e.detail)::text AS canonical"
        " FROM runledger.run_events e WHERE e.run_id = 'ch-1' ORDER BY e.event_id"
    ).fetchall()
    assert len(rows) >= 8
    previous = b""
    for r in rows:  # recomputed outside the database: sha256(previous hash || canonical)
        assert bytes(r["hash"]) == hashlib.sha256(previous + r["canonical"].encode()).digest()
        previous = bytes(r["hash"])
    assert json.loads(rows[0]["canonical"])[3] == "submitted"
    _checkpoint(admin)
    assert _broken(database_url) == {}


async def test_a_checkpoint_records_the_heads_of_the_runs_with_new_events(
    store: Store, admin: Conn
) -> None:
    await _finished_run(store, "ch-1")
    await _finished_run(store, "ch-2")
    first = _checkpoint(admin)
    assert first["created"] and first["checkpoint_id"] == 1 and first["runs"] == 2
    heads = admin.execute(
        "SELECT run_id, event_id, hash FROM runledger.event_checkpoint_heads"
        " WHERE checkpoint_id = 1 ORDER BY run_id"
    ).fetchall()
    for h in heads:
        last = _events(admin, h["run_id"])[-1]
        assert (h["event_id"], h["hash"]) == (last["event_id"], last["hash"])
    # nothing new: no checkpoint, the last one returned
    again = _checkpoint(admin)
    assert not again["created"] and again["checkpoint_id"] == 1
    # a young last checkpoint is kept when asked for a minimum age
    await _finished_run(store, "ch-3")
    young = admin.execute(
        "SELECT * FROM runledger.checkpoint_events('test', interval '1 hour')"
    ).fetchone()
    assert young is not None and not young["created"]
    second = _checkpoint(admin)
    assert second["created"] and second["checkpoint_id"] == 2 and second["runs"] == 1
    assert second["through_event_id"] == _events(admin, "ch-3")[-1]["event_id"]


async def test_a_checkpoint_waits_for_no_event_write_in_flight(
    store: Store, admin: Conn, database_url: str
) -> None:
    """An event written but not yet committed would be missed by a checkpoint that read
    past it: the checkpoint gives up (its lock_timeout) instead, and the next one has it."""
    await _finished_run(store, "ch-1")
    with psycopg.connect(database_url, autocommit=False, row_factory=dict_row) as writer:
        writer.execute("SELECT * FROM runledger.submit_run('ch-open', 'demo', '1', '{}')")
        waited = _checkpoint(admin)  # the writer holds run_events: lock_timeout, no checkpoint
        assert not waited["created"] and waited["checkpoint_id"] == 0
        writer.commit()
    made = _checkpoint(admin)
    assert made["created"]
    heads = {
        r["run_id"]
        for r in admin.execute(
            "SELECT run_id FROM runledger.event_checkpoint_heads WHERE checkpoint_id = %s",
            (made["checkpoint_id"],),
        )
    }
    assert heads == {"ch-1", "ch-open"}


def test_checkpoint_events_refuses_bad_input_and_writes_nothing(admin: Conn) -> None:
    for sql in (
        "SELECT * FROM runledger.checkpoint_events(NULL, interval '0')",
        "SELECT * FROM runledger.checkpoint_events('', interval '0')",
        "SELECT * FROM runledger.checkpoint_events('x', NULL)",
        "SELECT * FROM runledger.checkpoint_events('x', interval '-1 s')",
    ):
        with pytest.raises(psycopg.Error) as caught:
            admin.execute(sql)  # type: ignore[arg-type]
        assert caught.value.sqlstate == "RL006", sql
    count = admin.execute("SELECT count(*) AS n FROM runledger.event_checkpoints").fetchone()
    assert count is not None and count["n"] == 1  # checkpoint 0 only


def test_the_chain_tables_are_append_only_even_for_their_owner(admin: Conn) -> None:
    for sql in (
        "UPDATE runledger.event_checkpoints SET actor = 'x'",
        "DELETE FROM runledger.event_checkpoints",
        "TRUNCATE runledger.event_checkpoint_heads",
        "INSERT INTO runledger.event_chain_prunes VALUES ('r', 1, NULL, 1, now())",
    ):
        with pytest.raises(psycopg.Error) as caught:
            admin.execute(sql)  # type: ignore[arg-type]
        assert caught.value.sqlstate == "RL007", sql


async def test_a_concurrent_history_stays_verifiable(
    store: Store, admin: Conn, database_url: str
) -> None:
    """Runs written by several connections at once, checkpoints made meanwhile: every
    chain and checkpoint verifies (each run's events are appended under its row lock)."""
    stop = threading.Event()

    def checkpoints() -> None:
        with psycopg.connect(database_url, autocommit=True) as c:
            while not stop.is_set():
                c.execute("SELECT * FROM runledger.checkpoint_events('t', interval '0')")

    t = threading.Thread(target=checkpoints)
    t.start()
    try:
        await asyncio.gather(*(_finished_run(store, f"cc-{i}", calls=3) for i in range(12)))
    finally:
        stop.set()
        t.join()
    _checkpoint(admin)
    assert _broken(database_url) == {}


# -- forgeries ------------------------------------------------------------------------------


async def test_an_edited_event_is_named(store: Store, admin: Conn, database_url: str) -> None:
    await _finished_run(store, "ch-1")
    victim = _events(admin, "ch-1")[4]
    with _Unguarded(admin):
        admin.execute(
            "UPDATE runledger.run_events SET detail = detail || '{\"forged\": 1}'"
            " WHERE event_id = %s",
            (victim["event_id"],),
        )
    (row,) = _broken(database_url)["event_chain_broken"]
    assert (row["run_id"], row["event_id"]) == ("ch-1", victim["event_id"])


async def test_a_deleted_middle_event_is_named_at_the_next(
    store: Store, admin: Conn, database_url: str
) -> None:
    await _finished_run(store, "ch-1")
    events = _events(admin, "ch-1")
    with _Unguarded(admin):
        admin.execute(
            "DELETE FROM runledger.run_events WHERE event_id = %s", (events[3]["event_id"],)
        )
    (row,) = _broken(database_url)["event_chain_broken"]
    assert row["event_id"] == events[4]["event_id"]


async def test_an_inserted_event_with_a_valid_link_breaks_the_next_one(
    store: Store, admin: Conn, database_url: str
) -> None:
    await _finished_run(store, "ch-1")
    await _finished_run(store, "ch-2")  # ch-1 and ch-2 interleave: ids free inside ch-1
    await store.worker.submit_run("ch-1b", "demo", "1", {})
    events = _events(admin, "ch-1")
    with _Unguarded(admin):
        # a forger who knows the formula links the event to its predecessor correctly
        admin.execute(
            "INSERT INTO runledger.run_events (event_id, run_id, at, kind, actor, detail, hash)"
            " SELECT 0, 'ch-1', now(), 'call_succeeded', 'forger', '{}',"
            " runledger._event_hash(NULL, 0, 'ch-1', now(), 'call_succeeded', 'forger',"
            " NULL, NULL, '{}')"
        )
    (row,) = _broken(database_url)["event_chain_broken"]
    assert row["event_id"] == events[0]["event_id"]  # its successor names the forgery


async def test_a_deleted_tail_is_caught_by_the_checkpoint(
    store: Store, admin: Conn, database_url: str
) -> None:
    await _finished_run(store, "ch-1")
    made = _checkpoint(admin)
    events = _events(admin, "ch-1")
    with _Unguarded(admin):
        admin.execute(
            "DELETE FROM runledger.run_events WHERE event_id >= %s", (events[-2]["event_id"],)
        )
    broken = _broken(database_url)
    assert set(broken) == {"checkpoint_head_changed"}  # the shorter chain is whole
    (row,) = broken["checkpoint_head_changed"]
    assert (row["checkpoint_id"], row["run_id"], row["event_id"]) == (
        made["checkpoint_id"],
        "ch-1",
        events[-1]["event_id"],
    )
    assert row["problem"] == "the event is gone"


async def test_a_rehashed_chain_is_caught_by_the_checkpoint(
    store: Store, admin: Conn, database_url: str
) -> None:
    """The forger edits an event and recomputes every hash after it: the links hold, the
    head no longer matches the checkpoint."""
    await _finished_run(store, "ch-1")
    _checkpoint(admin)
    events = _events(admin, "ch-1")
    with _Unguarded(admin):
        admin.execute(
            "UPDATE runledger.run_events SET actor = 'forger' WHERE event_id = %s",
            (events[2]["event_id"],),
        )
        previous = events[1]["hash"]
        for e in events[2:]:
            row = admin.execute(
                "UPDATE runledger.run_events e SET hash = runledger._event_hash(%s, e.event_id,"
                " e.run_id, e.at, e.kind, e.actor, e.fencing_token, e.state_version, e.detail)"
                " WHERE e.event_id = %s RETURNING e.hash",
                (previous, e["event_id"]),
            ).fetchone()
            assert row is not None
            previous = row["hash"]
    broken = _broken(database_url)
    assert set(broken) == {"checkpoint_head_changed"}
    assert broken["checkpoint_head_changed"][0]["problem"] == (
        "the event's hash is not the one checkpointed"
    )


async def test_a_forged_or_removed_checkpoint_is_named(
    store: Store, admin: Conn, database_url: str
) -> None:
    await _finished_run(store, "ch-1")
    _checkpoint(admin)
    await _finished_run(store, "ch-2")
    _checkpoint(admin)
    await _finished_run(store, "ch-3")
    _checkpoint(admin)
    with _Unguarded(admin):
        admin.execute(
            "UPDATE runledger.event_checkpoint_heads SET hash = '\\x00' WHERE checkpoint_id = 2"
        )
    rows = _broken(database_url)["checkpoint_chain_broken"]
    assert [(r["checkpoint_id"], r["problem"]) for r in rows] == [
        (2, "its digest does not match its heads")
    ]
    with _Unguarded(admin):
        admin.execute("DELETE FROM runledger.event_checkpoint_heads WHERE checkpoint_id = 2")
        admin.execute("DELETE FROM runledger.event_checkpoints WHERE checkpoint_id = 2")
    rows = _broken(database_url)["checkpoint_chain_broken"]
    assert [(r["checkpoint_id"], r["problem"]) for r in rows] == [
        (3, "the checkpoints before it are missing")
    ]


async def test_a_rewritten_history_is_caught_by_an_anchor_kept_outside(
    store: Store, admin: Conn, database_url: str
) -> None:
    """Rewriting the events and every checkpoint after them is consistent inside the
    database; the digest an auditor kept from an earlier audit is not."""
    await _finished_run(store, "ch-1")
    kept = _checkpoint(admin)
    anchor = Anchor(kept["checkpoint_id"], kept["digest"])
    assert _broken(database_url, anchor) == {}
    with _Unguarded(admin):  # the whole history rebuilt: chain 1 dropped and made again
        admin.execute("DELETE FROM runledger.event_checkpoint_heads WHERE checkpoint_id = 1")
        admin.execute("DELETE FROM runledger.event_checkpoints WHERE checkpoint_id = 1")
        admin.execute(
            "UPDATE runledger.run_events SET actor = 'forger' WHERE run_id = 'ch-1'"
            " AND kind = 'claimed'"
        )
        prev = None
        for e in _events(admin, "ch-1"):
            row = admin.execute(
                "UPDATE runledger.run_events e SET hash = runledger._event_hash(%s, e.event_id,"
                " e.run_id, e.at, e.kind, e.actor, e.fencing_token, e.state_version, e.detail)"
                " WHERE e.event_id = %s RETURNING e.hash",
                (prev, e["event_id"]),
            ).fetchone()
            assert row is not None
            prev = row["hash"]
    assert _checkpoint(admin)["checkpoint_id"] == 1  # a new checkpoint 1, self-consistent
    assert _broken(database_url) == {}
    broken = _broken(database_url, anchor)
    assert set(broken) == {"checkpoint_anchor"}
    (row,) = broken["checkpoint_anchor"]
    assert row["problem"] == "the checkpoint's digest differs: the history was rewritten"


async def test_an_event_without_hash_after_0016_is_named(
    store: Store, admin: Conn, database_url: str
) -> None:
    await _finished_run(store, "ch-1")
    admin.execute(
        "INSERT INTO runledger.run_events (run_id, at, kind, actor) "
        "VALUES ('ch-1', now(), 'run_cancelled', 'ghost')"
    )
    (row,) = _broken(database_url)["event_chain_broken"]
    assert row["problem"] == "the event has no hash"


async def test_pruned_chains_are_recorded_and_pass(
    store: Store, admin: Conn, database_url: str
) -> None:
    await _finished_run(store, "ch-1")
    await _finished_run(store, "ch-2")
    _checkpoint(admin)
    last = _events(admin, "ch-1")[-1]
    n = len(_events(admin, "ch-1"))
    admin.execute("SELECT runledger.prune_runs_v2(now() + interval '1 day', false, 1)")
    pruned = admin.execute("SELECT * FROM runledger.event_chain_prunes").fetchall()
    assert [(p["run_id"], p["last_event_id"], p["last_hash"], p["events"]) for p in pruned] == [
        ("ch-1", last["event_id"], last["hash"], n)
    ]
    assert _events(admin, "ch-1") == [] and _events(admin, "ch-2") != []
    assert _broken(database_url) == {}
    # the same deletion by hand, without prune_runs, is tampering
    with _Unguarded(admin):
        admin.execute("DELETE FROM runledger.run_events WHERE run_id = 'ch-2'")
    assert [r["run_id"] for r in _broken(database_url)["checkpoint_head_changed"]] == ["ch-2"]


# -- the command line -------------------------------------------------------------------------


async def test_audit_prints_the_anchor_and_checks_an_expected_one(
    store: Store, admin: Conn, database_url: str
) -> None:
    await _finished_run(store, "ch-1")
    runner = CliRunner()
    made = runner.invoke(main, ["checkpoint", "--database-url", database_url, "--json"])
    assert made.exit_code == 0, made.output
    cp = json.loads(made.output)
    assert cp["created"] and cp["checkpoint_id"] == 1 and cp["runs"] == 1
    out = runner.invoke(main, ["audit", "--database-url", database_url])
    assert out.exit_code == 0, out.output
    anchor = re.search(r"^anchor (\d+:[0-9a-f]{64}) ", out.output, re.M)
    assert anchor is not None and anchor.group(1) == f"1:{cp['digest']}"
    good = runner.invoke(
        main, ["audit", "--database-url", database_url, "--expect", anchor.group(1), "--json"]
    )
    assert good.exit_code == 0, good.output
    doc = json.loads(good.output)
    assert {c["check"] for c in doc} >= CHAIN | {"checkpoint_anchor", "anchor"}
    assert doc[-1]["anchor"]["digest"] == cp["digest"]
    wrong = "1:" + "0" * 64
    bad = runner.invoke(main, ["audit", "--database-url", database_url, "--expect", wrong])
    assert bad.exit_code == 1 and "FAIL checkpoint_anchor" in bad.output


def test_a_malformed_anchor_is_one_line(database_url: str) -> None:
    out = CliRunner().invoke(main, ["audit", "--database-url", database_url, "--expect", "12"])
    assert out.exit_code == 2
    assert "is not a checkpoint anchor ID:DIGEST" in out.output
    assert "Traceback" not in out.output


async def test_writers_wait_for_a_checkpoint_only_while_it_reads_the_watermark(
    store: Store, admin: Conn, database_url: str
) -> None:
    """The table lock is held while the greatest event id is read, not while the heads
    are gathered: an event written from another session while a checkpoint's transaction
    is still open goes through at once, and the next checkpoint has it."""
    await _finished_run(store, "ch-1")
    with psycopg.connect(database_url, autocommit=False, row_factory=dict_row) as cp:
        made = cp.execute(
            "SELECT * FROM runledger.checkpoint_events('test', interval '0')"
        ).fetchone()
        assert made is not None and made["created"]
        # the checkpoint's transaction is still open: a writer is not held back
        with psycopg.connect(database_url, autocommit=True) as w:
            w.execute("SET lock_timeout = '1s'")
            w.execute("SELECT * FROM runledger.submit_run('ch-2', 'demo', '1', '{}')")
        cp.commit()
    after = _checkpoint(admin)
    assert after["created"] and after["checkpoint_id"] == made["checkpoint_id"] + 1
    assert _broken(database_url) == {}


def test_events_of_a_renewal_and_a_takeover_racing_stay_one_chain(
    database_url: str, db_clock: Any
) -> None:
    """renewal_failed is written by a worker that no longer holds the run, while the new
    holder writes its takeover: the two appends are serialized on the run's row lock
    (revision 0025), never forked."""
    from concurrent.futures import ThreadPoolExecutor

    from tests.contract.helpers import LEASE_SECONDS, claim, finish, renew, submit_and_claim

    with (
        psycopg.connect(database_url, autocommit=True, row_factory=dict_row) as a,
        psycopg.connect(database_url, autocommit=True, row_factory=dict_row) as b,
    ):
        a.execute("SET ROLE runledger_worker")
        b.execute("SET ROLE runledger_worker")
        for i in range(8):
            lease = submit_and_claim(a, f"race-{i}", "w1")
            db_clock.advance(LEASE_SECONDS + 1)
            with ThreadPoolExecutor(2) as pool:
                renewed = pool.submit(renew, a, "w1", [lease])
                taken = pool.submit(claim, b, "w2", max_runs=1)
                assert renewed.result(timeout=30) == []
                # a claim skips a run whose row another transaction holds: the renewal
                # that records its failure, for a moment; the next claim takes it
                got = taken.result(timeout=30) or claim(b, "w2", max_runs=1)
                (new,) = got
                assert new.run_id == f"race-{i}"
            finish(b, new, "succeeded", None, reason="done")  # out of the next race
    with psycopg.connect(database_url, autocommit=True, row_factory=dict_row) as admin:
        kinds = {
            r["kind"]
            for r in admin.execute(
                "SELECT kind FROM runledger.run_events WHERE run_id LIKE 'race-%'"
            )
        }
        assert {"renewal_failed", "takeover"} <= kinds
        _checkpoint(admin)
    assert _broken(database_url) == {}


def test_checkpoint_refusals_are_one_line(
    database_url: str, admin_conn: Conn, monkeypatch: pytest.MonkeyPatch, capsys: Any
) -> None:
    """A bad actor and a role without the grant end in one line (exit 1), not a
    traceback, and make no checkpoint."""
    import sys

    from runledger import cli

    admin_conn.execute("CREATE ROLE ch_auditor LOGIN IN ROLE runledger_auditor")
    auditor_url = database_url.replace("postgres@", "ch_auditor@", 1)
    assert auditor_url != database_url
    for args, says in (
        (["--actor", "x" * 300, "--database-url", database_url], "InvalidInput: actor must be"),
        (["--database-url", auditor_url], "checkpoint_events is granted to runledger_worker"),
    ):
        monkeypatch.setattr(sys, "argv", ["runledger", "checkpoint", *args])
        with pytest.raises(SystemExit) as exit_:
            cli.run()
        err = capsys.readouterr().err
        assert exit_.value.code == 1, err
        assert err.startswith("error: ") and says in err, err
        assert len(err.splitlines()) == 1, err
    (n,) = admin_conn.execute("SELECT count(*) FROM runledger.event_checkpoints").fetchone()
    assert n == 1


def test_three_writers_of_one_run_never_fork_its_chain(database_url: str, admin: Conn) -> None:
    """Every writer of a run's events holds the run's row lock, those that do not hold its
    lease too (revision 0025): report_stale_write, and renew_leases for a lease that
    failed. The second writer waits for the holder, the third for the second, and each
    chains to the event before it. A test-only trigger holds the second writer inside its
    INSERT, after it read its link, on an advisory lock: a third writer that did not wait
    for it would link to the same event (a fork)."""
    from concurrent.futures import ThreadPoolExecutor

    from tests.contract.helpers import checkpoint, renew, report_stale_write, submit_and_claim

    lease = submit_and_claim(admin, "fork-1", "w1")
    admin.execute(
        "CREATE FUNCTION runledger.test_hold() RETURNS trigger LANGUAGE plpgsql AS $$ BEGIN"
        " IF current_setting('test.hold', true) = 'on' THEN"
        " PERFORM pg_advisory_xact_lock(4242); END IF; RETURN NEW; END $$"
    )
    admin.execute(
        "CREATE TRIGGER test_hold BEFORE INSERT ON runledger.run_events"
        " FOR EACH ROW EXECUTE FUNCTION runledger.test_hold()"
    )
    try:
        with (
            psycopg.connect(database_url, row_factory=dict_row) as first,
            psycopg.connect(database_url, autocommit=True, row_factory=dict_row) as second,
            psycopg.connect(database_url, autocommit=True, row_factory=dict_row) as third,
            psycopg.connect(database_url, autocommit=True) as gate,
            ThreadPoolExecutor(2) as pool,
        ):
            for c in (first, second, third):
                c.execute("SET ROLE runledger_worker")
            gate.execute("SELECT pg_advisory_lock(4242)")
            # the holder's checkpoint: its transaction stays open, it holds the run
            checkpoint(first, lease, lease.state_version, {"step": 1})
            second.execute("SET test.hold = 'on'")
            pid2 = second.info.backend_pid
            stale = dataclasses.replace(lease, worker_id="w2")
            appended = pool.submit(report_stale_write, second, stale, "complete_call")
            wait_until(
                "the second writer to wait for the first", lambda: waiting_on_a_lock(admin, pid2)
            )
            first.commit()
            wait_until(
                "the second writer held in its INSERT", lambda: _held_on_advisory(admin, pid2)
            )
            pid3 = third.info.backend_pid
            failed = pool.submit(renew, third, "w3", [lease])  # not w3's: renewal_failed
            wait_until("the third writer", lambda: failed.done() or waiting_on_a_lock(admin, pid3))
            gate.execute("SELECT pg_advisory_unlock(4242)")
            appended.result(timeout=15)
            assert failed.result(timeout=15) == []
    finally:
        admin.execute("DROP TRIGGER test_hold ON runledger.run_events")
        admin.execute("DROP FUNCTION runledger.test_hold()")
    made = _events(admin, "fork-1")
    assert [e["kind"] for e in made] == [
        "submitted",
        "claimed",
        "checkpoint",
        "stale_write_rejected",
        "renewal_failed",
    ]
    assert chain_links(admin, "fork-1") == [True] * 5


def _held_on_advisory(admin: Conn, pid: int) -> bool:
    row = admin.execute(
        "SELECT count(*) AS n FROM pg_locks WHERE pid = %s AND locktype = 'advisory'"
        " AND NOT granted",
        (pid,),
    ).fetchone()
    return row is not None and row["n"] > 0
