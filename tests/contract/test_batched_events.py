"""Revision 0028: the events one write appends to a run together go in one INSERT
(``runledger._events``), with the rows, the order and the hash chain of one ``_event``
per kind; and the JSON checks read the settings only for a value some allowed setting
could refuse, refusing exactly what they refused before.

A row's ``cmin`` is the command (statement) of its transaction that wrote it: events with
the same one were written by one statement. Before 0028 each event had its own."""

from __future__ import annotations

import json
from typing import Any

import psycopg
import pytest
from psycopg.types.json import Jsonb

from .helpers import (
    Lease,
    call,
    chain_links,
    complete,
    key,
    refused,
    rows,
    submit_and_claim,
)
from .test_fast_path import complete_v2, two_calls
from .test_record_turn_v4 import v4

Conn = psycopg.Connection[Any]


def _last_events(admin: Conn, run_id: str, n: int) -> list[dict[str, Any]]:
    found = rows(
        admin,
        "SELECT event_id, kind, state_version, detail, cmin::text::int AS cmin,"
        " xmin::text AS xmin FROM runledger.run_events WHERE run_id = %s"
        " ORDER BY event_id DESC LIMIT %s",
        (run_id, n),
    )
    return list(reversed(found))


def _one_statement(found: list[dict[str, Any]]) -> bool:
    return len({(e["xmin"], e["cmin"]) for e in found}) == 1


def _consecutive(found: list[dict[str, Any]]) -> bool:
    ids = [e["event_id"] for e in found]
    return ids == list(range(ids[0], ids[0] + len(ids)))


@pytest.mark.parametrize("outcome", ["succeeded", "failed"])
def test_a_completion_and_the_next_dispatch_write_their_events_in_one_insert(
    worker: Conn, admin_conn: Conn, outcome: str
) -> None:
    lease, first, second = two_calls(worker)
    before = _last_events(admin_conn, "r1", 1)[0]
    assert complete_v2(worker, lease, first, outcome, {"r": 1}, next_key=second) == 1
    done, sent = _last_events(admin_conn, "r1", 2)
    assert (done["kind"], sent["kind"]) == (f"call_{outcome}", "call_dispatched")
    assert _one_statement([done, sent]) and _consecutive([before, done, sent])
    assert done["detail"] == {"idempotency_key": first, "tool": "create_ticket", "attempt": 1}
    assert sent["detail"] == {
        "idempotency_key": second,
        "tool": "create_ticket",
        "attempt": 1,
        "previous_status": "planned",
    }
    assert all(chain_links(admin_conn, "r1"))


def test_a_decisions_events_are_one_insert_in_their_order(worker: Conn, admin_conn: Conn) -> None:
    lease = submit_and_claim(worker)
    calls = [call("c1"), call("c2"), call("c3")]
    assert v4(worker, lease, 0, calls, ["c3", "c1"], expected=0, state={"s": 1}) == (1, [1, 1])
    found = _last_events(admin_conn, "r1", 4)
    assert [e["kind"] for e in found] == [
        "checkpoint",
        "turn_recorded",
        "call_dispatched",
        "call_dispatched",
    ]
    assert _one_statement(found) and _consecutive(found)
    assert [e["state_version"] for e in found] == [1, 1, 1, 1]
    assert found[0]["detail"] == {}
    assert found[1]["detail"] == {"turn": 0, "calls": 3}
    keys = [e["detail"]["idempotency_key"] for e in found[2:]]
    assert keys == [key("r1", 0, "c3"), key("r1", 0, "c1")]
    assert all(chain_links(admin_conn, "r1"))


def test_a_decision_without_a_checkpoint_or_a_dispatch_writes_its_one_event(
    worker: Conn, admin_conn: Conn
) -> None:
    lease = submit_and_claim(worker)
    v4(worker, lease, 0, [call("c1")], None)
    claimed, recorded = _last_events(admin_conn, "r1", 2)
    assert claimed["kind"] == "claimed"  # one event written, no more
    assert recorded["kind"] == "turn_recorded" and recorded["state_version"] == 0
    assert all(chain_links(admin_conn, "r1"))


def test_the_final_decision_ends_the_run_in_the_same_insert_and_says_so_once(
    worker: Conn, admin_conn: Conn, database_url: str
) -> None:
    lease = submit_and_claim(worker)
    v4(worker, lease, 0, [call("c1")], ["c1"])
    complete(worker, lease, key("r1", 0, "c1"), "succeeded", {"ok": True})
    with psycopg.connect(database_url, autocommit=True) as listener:
        listener.execute("LISTEN runledger_events")
        v4(worker, lease, 1, [], None, expected=0, state={"done": 1}, finish=True)
        heard = [n.payload for n in listener.notifies(timeout=0.5, stop_after=2)]
    found = _last_events(admin_conn, "r1", 3)
    assert [e["kind"] for e in found] == ["checkpoint", "turn_recorded", "run_succeeded"]
    assert _one_statement(found) and _consecutive(found)
    # the run's end is the one kind of the three an operator is told about
    assert heard == [f"{found[2]['event_id']} r1 run_succeeded"]
    assert all(chain_links(admin_conn, "r1"))


# -- the JSON checks at the least settings the settings' CHECKs allow ------------------------


def _least_settings(admin: Conn) -> None:
    admin.execute("UPDATE runledger.settings SET max_json_depth = 1, max_payload_bytes = 1024")


def test_a_result_nested_past_the_least_depth_is_still_refused(
    worker: Conn, admin_conn: Conn
) -> None:
    _least_settings(admin_conn)
    lease, first, second = two_calls(worker)
    for deep in ({"a": {"b": 1}}, [[1]], {"a": [1]}):
        with refused(admin_conn, "RL006", deep) as caught:
            complete_v2(worker, lease, first, "succeeded", deep, next_key=second)
        assert caught.value.diag.message_primary == "result nests deeper than 1 levels"
    assert complete_v2(worker, lease, first, "succeeded", {"a": 1}, next_key=second) == 1


def test_a_result_over_the_least_cap_is_still_refused(worker: Conn, admin_conn: Conn) -> None:
    _least_settings(admin_conn)
    lease, first, second = two_calls(worker)
    big = {"x": "y" * 1100}
    assert len(json.dumps(big)) > 1024
    with refused(admin_conn, "RL006") as caught:
        complete_v2(worker, lease, first, "succeeded", big, next_key=second)
    assert "over the cap of 1024 bytes" in (caught.value.diag.message_primary or "")
    small = {"x": "y" * 900}
    assert complete_v2(worker, lease, first, "succeeded", small, next_key=second) == 1


def test_the_calls_keep_their_two_levels_of_wrapping_at_the_least_depth(
    worker: Conn, admin_conn: Conn
) -> None:
    _least_settings(admin_conn)
    lease = submit_and_claim(worker)
    with refused(admin_conn, "RL006") as caught:
        v4(worker, lease, 0, [call("c1", a={"b": 1})], None)  # args of depth 2
    assert caught.value.diag.message_primary == "calls nests deeper than 3 levels"
    v4(worker, lease, 0, [call("c1", a=1)], None)  # args of depth 1: the array and object
    with refused(admin_conn, "RL006"):
        checkpoint(worker, lease, 0, {"a": {"b": 1}})
    checkpoint(worker, lease, 0, {"a": 1})


def checkpoint(conn: Conn, lease: Lease, expected: int, state: Any) -> None:
    rows(
        conn,
        "SELECT runledger.checkpoint(%s, %s, %s, %s, %s)",
        (lease.run_id, lease.lease_id, lease.token, expected, Jsonb(state)),
    )
