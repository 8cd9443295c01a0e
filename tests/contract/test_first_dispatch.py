"""``run_calls.first_dispatched_at`` (revision 0.2): the key's first dispatch, the age a
provider's lookup judges its retention window by. Every dispatch path sets it once and
no later dispatch moves it: ``record_turn_v4``'s listed calls, ``dispatch_call``,
``complete_call_v2``'s next call, and a failover's marking of a planned call."""

from __future__ import annotations

import datetime as dt
from typing import Any

import psycopg
import pytest
from psycopg.types.json import Jsonb

from runledger.db.harness import advance_clock

from .conftest import Connect
from .helpers import (
    FLOW_REF,
    LEASE_SECONDS,
    call,
    call_row,
    dispatch,
    key,
    record_turn,
    rows,
    scalar,
    submit_and_claim,
)

Conn = psycopg.Connection[Any]
HOUR = 3600.0


@pytest.fixture
def admin(connect: Connect) -> Conn:
    return connect("admin")


def _times(admin: Conn, k: str) -> tuple[dt.datetime | None, dt.datetime | None]:
    row = call_row(admin, k)
    return row["first_dispatched_at"], row["dispatched_at"]


def test_a_planned_call_has_none_and_dispatch_call_sets_it_once(worker: Conn, admin: Conn) -> None:
    lease = submit_and_claim(worker, "r1", lease_seconds=5 * HOUR)
    record_turn(worker, lease, 0, [call("c1")])
    k = key("r1", 0, "c1")
    assert _times(admin, k) == (None, None)

    dispatch(worker, lease, k)
    first, last = _times(admin, k)
    assert first is not None and first == last

    advance_clock(admin, HOUR)
    assert dispatch(worker, lease, k) == 2  # sent again with the same key
    again, later = _times(admin, k)
    assert again == first
    assert later is not None and later - first >= dt.timedelta(hours=1)


def test_record_turn_v4_dispatching_its_first_call_sets_it(worker: Conn, admin: Conn) -> None:
    lease = submit_and_claim(worker, "r2")
    worker.execute(
        "SELECT runledger.record_turn_v4(%s, %s, %s, 0, %s, NULL, NULL, NULL, NULL, false, %s)",
        (lease.run_id, lease.lease_id, lease.token, Jsonb([call("c1"), call("c2")]), ["c1"]),
    )
    first, last = _times(admin, key("r2", 0, "c1"))
    assert first is not None and first == last
    assert _times(admin, key("r2", 0, "c2")) == (None, None)


def test_complete_call_v2_dispatching_the_next_call_sets_it(worker: Conn, admin: Conn) -> None:
    lease = submit_and_claim(worker, "r3", lease_seconds=5 * HOUR)
    record_turn(worker, lease, 0, [call("c1"), call("c2")])
    k1, k2 = key("r3", 0, "c1"), key("r3", 0, "c2")
    dispatch(worker, lease, k1)
    advance_clock(admin, HOUR)
    worker.execute(
        "SELECT runledger.complete_call_v2(%s, %s, %s, %s, 'succeeded', %s, NULL, %s)",
        (lease.run_id, lease.lease_id, lease.token, k1, Jsonb({"ok": True}), k2),
    )
    first1, _ = _times(admin, k1)
    first2, last2 = _times(admin, k2)
    assert first2 is not None and first2 == last2
    assert first1 is not None and first2 - first1 >= dt.timedelta(hours=1)


def test_a_failover_marking_a_planned_call_sets_it_and_keeps_an_earlier_one(
    worker: Conn, admin: Conn
) -> None:
    lease = submit_and_claim(worker, "r4", lease_seconds=5 * HOUR)
    record_turn(worker, lease, 0, [call("c1"), call("c2")])
    sent, planned = key("r4", 0, "c1"), key("r4", 0, "c2")
    dispatch(worker, lease, sent)
    first_sent, _ = _times(admin, sent)
    advance_clock(admin, HOUR)
    # the schema last saw another timeline: what a promotion looks like to a claim
    admin.execute(
        "INSERT INTO runledger.timelines (position, timeline, seen_at) "
        "SELECT max(position) + 1, runledger._timeline() + 6, now() FROM runledger.timelines"
    )
    rows(
        worker,
        "SELECT * FROM runledger.claim_runs_v4('w2', %s::text[], %s, 10)",
        (
            [FLOW_REF],
            dt.timedelta(seconds=LEASE_SECONDS),
        ),
    )
    marked = call_row(admin, planned)
    assert (marked["status"], marked["dispatched_by"]) == ("dispatched", "failover")
    assert marked["first_dispatched_at"] == marked["dispatched_at"]
    assert marked["first_dispatched_at"] - first_sent >= dt.timedelta(hours=1)
    assert _times(admin, sent)[0] == first_sent  # not marked again: it was dispatched
    assert scalar(admin, "SELECT count(*) FROM runledger.failover_runs") == 1
