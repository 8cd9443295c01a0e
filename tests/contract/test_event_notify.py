"""Revision 0015: the events an operator watches are sent on NOTIFY channel
runledger_events at commit, payload '<event_id> <run_id> <kind>'; the per-call and
per-turn events are not (they would put a NOTIFY on the hot path)."""

from __future__ import annotations

from typing import Any

import psycopg

from .conftest import Connect
from .helpers import complete, dispatched_call, events, finish, submit, submit_and_claim

Conn = psycopg.Connection[Any]


def _received(conn: Conn) -> list[tuple[int, str, str]]:
    out = []
    for n in conn.notifies(timeout=0.5, stop_after=None):
        assert n.channel == "runledger_events"
        event_id, run_id, kind = n.payload.split(" ")
        out.append((int(event_id), run_id, kind))
    return out


def test_run_level_events_are_notified_with_their_ids(connect: Connect, worker: Conn) -> None:
    listener = connect("runledger_auditor")
    listener.execute("LISTEN runledger_events")
    lease = submit_and_claim(worker, "n-1")
    key = dispatched_call(worker, lease)
    complete(worker, lease, key, "succeeded", {"ok": True}, {"id": "T-1"})
    finish(worker, lease, "succeeded", {"done": True}, reason="done")
    got = _received(listener)
    all_events = {e["event_id"]: e["kind"] for e in events(worker, "n-1")}
    assert [k for _, _, k in got] == ["submitted", "run_succeeded"]
    for event_id, run_id, kind in got:
        assert run_id == "n-1" and all_events[event_id] == kind
    # the per-call and per-turn events happened, but were not sent
    assert {"claimed", "call_dispatched", "call_succeeded", "turn_recorded"} <= set(
        all_events.values()
    )


def test_a_rolled_back_event_sends_nothing(connect: Connect, worker: Conn) -> None:
    listener = connect("runledger_auditor")
    listener.execute("LISTEN runledger_events")
    with worker.transaction(force_rollback=True):
        submit(worker, "n-2")
    assert _received(listener) == []
