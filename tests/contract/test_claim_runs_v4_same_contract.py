"""claim_runs_v4 (since revision 0020 claim_runs' body with the per-run read in the claim
statement) against the body it replaced (0018's, a loop over claim_runs with a read per
run): from the same queue, the same runs claimed with the same columns, the same rows and
events written, or the same refusal.

The reference is vendored in reference/claim_runs_v4_0018.sql, installed as
claim_runs_v4_0018: claim_runs_v4's body as revision 0020's downgrade restored it (commit
4b19f01, migrations/versions/0020_hot_turn_claim.down.sql, gone since the baseline "0.1"),
its loop calling claim_runs_v1_ref, the claim_runs (v1, retired) it looped over when this
test last ran against it (commit 4b19f01, service/runledger/db/sql/03_leases.sql)."""

from __future__ import annotations

import datetime as dt
from collections.abc import Callable
from pathlib import Path
from typing import Any

import psycopg
import pytest
from psycopg.rows import dict_row
from psycopg.types.json import Jsonb

from runledger.testing import DbClock

from .helpers import (
    FLOW_REF,
    LEASE_SECONDS,
    call,
    claim,
    complete,
    key,
    record_turn,
    submit,
    submit_and_claim,
)

Conn = psycopg.Connection[Any]

OLD = "claim_runs_v4_0018"
TP = "00-0af7651916cd43dd8448eb211c80319c-b7ad6b7169203331-01"
# drawn at random or read from the clock at each call: not compared
RANDOM = ("lease_id", "lease_expires_at")


REFERENCE = Path(__file__).parent / "reference" / f"{OLD}.sql"


def _install_old(admin: Conn) -> None:
    admin.execute(REFERENCE.read_text(encoding="utf-8"))  # type: ignore[arg-type]


def _outcome(conn: Conn, fn: str, args: tuple[Any, ...]) -> tuple[Any, ...]:
    try:
        with conn.transaction(force_rollback=True):
            got = (
                conn.cursor(row_factory=dict_row)
                .execute(
                    f"SELECT * FROM runledger.{fn}(%s, %s::text[], %s, %s)",  # type: ignore[arg-type]
                    args,
                )
                .fetchall()
            )
            runs = conn.execute(
                "SELECT to_jsonb(r) - 'lease_id' - 'lease_expires_at' - 'updated_at'"
                " FROM runledger.runs r ORDER BY r.run_id"
            ).fetchall()
            evs = conn.execute(
                "SELECT e.run_id, e.kind, e.actor, e.fencing_token, e.state_version,"
                " e.detail - 'lease_id' - 'lease_expires_at' AS detail"
                " FROM runledger.run_events e ORDER BY e.event_id"
            ).fetchall()
            claimed = [{k: v for k, v in r.items() if k not in RANDOM} for r in got]
            return ("ok", claimed, runs, evs)
    except psycopg.Error as e:
        d = e.diag
        return ("refused", e.sqlstate, d.message_primary, d.message_detail, d.message_hint)


def _queued(worker: Conn, admin: Conn, clock: DbClock) -> None:
    for i in range(4):
        submit(worker, f"q{i}", {"i": i}, priority=i % 2)
    worker.execute(
        "SELECT * FROM runledger.submit_run_v2('t1', 'demo', '1', %s, 0, NULL, %s)",
        (Jsonb({"n": 1}), TP),
    )


def _with_journal(worker: Conn, admin: Conn, clock: DbClock) -> None:
    # one run with a journal, taken over after its lease expired (stalled twice: no
    # journal with it), one with a journal and progress, released
    lease = submit_and_claim(worker, "j1")
    record_turn(worker, lease, 0, [call("c1"), call("c2")])
    worker.execute(
        "SELECT runledger.dispatch_call(%s, %s, %s, %s)",
        (lease.run_id, lease.lease_id, lease.token, key("j1", 0, "c1")),
    )
    complete(worker, lease, key("j1", 0, "c1"), "succeeded", {"ok": 1})
    clock.advance(LEASE_SECONDS + 1)
    [again] = claim(worker, "w2", max_runs=1)
    assert again.takeover
    clock.advance(LEASE_SECONDS + 1)
    submit(worker, "q9")


def _failover_marked(worker: Conn, admin: Conn, clock: DbClock) -> None:
    lease = submit_and_claim(worker, "f1")
    record_turn(worker, lease, 0, [call("c1")])
    admin.execute(
        "INSERT INTO runledger.timelines (position, timeline, seen_at)"
        " SELECT coalesce(max(position), 0) + 1, 1, now() FROM runledger.timelines"
    )
    admin.execute(
        "INSERT INTO runledger.failover_runs (run_id, position, status, fencing_token, turn,"
        " marked_calls) SELECT 'f1', max(position), 'running', 1, 0, '{}'"
        " FROM runledger.timelines"
    )
    clock.advance(LEASE_SECONDS + 1)


SETUPS: dict[str, Callable[[Conn, Conn, DbClock], None]] = {
    "queued runs": _queued,
    "runs with a journal, taken over": _with_journal,
    "a run a failover affected": _failover_marked,
}

CLAIMS: dict[str, tuple[Any, ...]] = {
    "one": ("w1", [FLOW_REF], dt.timedelta(seconds=30), 1),
    "all": ("w1", [FLOW_REF], dt.timedelta(seconds=30), 10),
    "none wanted": ("w1", [FLOW_REF], dt.timedelta(seconds=30), 0),
    "another flow": ("w1", ["other@1"], dt.timedelta(seconds=30), 10),
    "a bad worker id": ("", [FLOW_REF], dt.timedelta(seconds=30), 1),
    "a bad lease": ("w1", [FLOW_REF], dt.timedelta(seconds=0), 1),
    "a bad flow": ("w1", ["nope"], dt.timedelta(seconds=30), 1),
    "too many": ("w1", [FLOW_REF], dt.timedelta(seconds=30), 10001),
}


@pytest.mark.parametrize("claim_case", list(CLAIMS))
@pytest.mark.parametrize("setup", list(SETUPS))
def test_a_claim_gets_what_it_got_before(
    worker: Conn, admin_conn: Conn, db_clock: DbClock, setup: str, claim_case: str
) -> None:
    _install_old(admin_conn)
    SETUPS[setup](worker, admin_conn, db_clock)
    args = CLAIMS[claim_case]
    new = _outcome(admin_conn, "claim_runs_v4", args)
    assert new == _outcome(admin_conn, OLD, args)
    if claim_case == "all":
        assert new[0] == "ok" and new[1], new
