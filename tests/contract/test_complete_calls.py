"""complete_calls (revision 0018): the results of several calls of one run in one
transaction (group commit), and optionally the next call's dispatch, called as a live or
a stale worker would; every refusal leaves nothing of the batch written."""

from __future__ import annotations

import dataclasses
from typing import Any

import psycopg
import pytest
from psycopg.types.json import Jsonb

from runledger.testing import DbClock

from .helpers import (
    LEASE_SECONDS,
    Lease,
    call,
    call_row,
    claim,
    complete,
    dispatch,
    events,
    key,
    record_turn,
    refused,
    run_row,
    scalar,
    submit_and_claim,
)

Conn = psycopg.Connection[Any]

SQL = (
    "SELECT runledger.complete_calls(%s, %s, %s, %s::text[], %s::text[], %s::jsonb[],"
    " %s::jsonb[], %s)"
)


def complete_calls(
    conn: Conn,
    lease: Lease,
    keys: Any,
    outcomes: Any,
    results: Any = None,
    receipts: Any = None,
    next_key: str | None = None,
) -> int | None:
    n = len(keys) if isinstance(keys, list) else 0
    if results is None:
        results = [None] * n
    if receipts is None:
        receipts = [None] * n
    wrap = (lambda xs: [None if x is None else Jsonb(x) for x in xs]) if n else (lambda xs: xs)
    value = scalar(
        conn,
        SQL,
        (
            lease.run_id,
            lease.lease_id,
            lease.token,
            keys,
            outcomes,
            wrap(results) if isinstance(results, list) else results,
            wrap(receipts) if isinstance(receipts, list) else receipts,
            next_key,
        ),
    )
    return None if value is None else int(value)


def group(
    worker: Conn, run_id: str = "r1", n: int = 3, sent: int | None = None
) -> tuple[Lease, list[str]]:
    """A running run whose turn 0 has ``n`` calls, the first ``sent`` (all) dispatched."""
    lease = submit_and_claim(worker, run_id)
    record_turn(worker, lease, 0, [call(f"c{i}") for i in range(n)])
    keys = [key(run_id, 0, f"c{i}") for i in range(n)]
    for k in keys[: n if sent is None else sent]:
        dispatch(worker, lease, k)
    return lease, keys


def test_a_group_completes_in_one_transaction(worker: Conn, admin_conn: Conn) -> None:
    lease, keys = group(worker)
    before = len(events(admin_conn, "r1"))
    got = complete_calls(
        worker,
        lease,
        keys,
        ["succeeded", "failed", "not_applied"],
        [{"r": 0}, {"error": "no"}, {"why": "busy"}],
        [{"receipt": 0}, None, {"ignored": True}],
    )
    assert got is None
    ok, bad, again = (call_row(admin_conn, k) for k in keys)
    assert (ok["status"], ok["result"], ok["error"], ok["receipt"]) == (
        "succeeded", {"r": 0}, None, {"receipt": 0}
    )  # fmt: skip
    assert (bad["status"], bad["result"], bad["error"]) == ("failed", None, {"error": "no"})
    assert (ok["completed_token"], ok["completed_by"]) == (lease.token, "w1")
    assert ok["completed_at"] == bad["completed_at"]  # one clock reading
    # not_applied: back to planned, the completion fields cleared, the attempt kept
    assert (again["status"], again["receipt"], again["completed_token"]) == ("planned", None, None)
    assert again["attempts"] == 1
    evs = events(admin_conn, "r1")[before:]
    assert [e["kind"] for e in evs] == ["call_succeeded", "call_failed", "call_not_applied"]
    assert [e["detail"] for e in evs] == [
        {"idempotency_key": k, "tool": "create_ticket", "attempt": 1} for k in keys
    ]
    assert {e["fencing_token"] for e in evs} == {lease.token}
    # the same results as complete_call would leave, one call at a time
    lease2, keys2 = group(worker, "r2")
    for k, o, r in zip(keys2, ["succeeded", "failed"], [{"r": 0}, {"error": "no"}], strict=False):
        complete(worker, lease2, k, o, r)
    one_by_one = call_row(admin_conn, keys2[1])
    for col in ("status", "result", "error", "receipt", "completed_token", "attempts"):
        assert one_by_one[col] == bad[col], col


def test_one_call_with_the_next_dispatched(worker: Conn, admin_conn: Conn) -> None:
    lease, keys = group(worker, n=2, sent=1)
    assert complete_calls(worker, lease, keys[:1], ["succeeded"], [{"r": 1}], next_key=keys[1]) == 1
    done, sent = call_row(admin_conn, keys[0]), call_row(admin_conn, keys[1])
    assert (done["status"], sent["status"], sent["attempts"]) == ("succeeded", "dispatched", 1)
    assert sent["dispatched_token"] == lease.token and sent["dispatched_at"] == done["completed_at"]
    evs = events(admin_conn, "r1")[-2:]
    assert [e["kind"] for e in evs] == ["call_succeeded", "call_dispatched"]
    assert evs[1]["detail"] == {
        "idempotency_key": keys[1],
        "tool": "create_ticket",
        "attempt": 1,
        "previous_status": "planned",
    }
    assert run_row(admin_conn, "r1")["stalled_claims"] == 0


def test_a_refused_call_leaves_the_whole_batch_unwritten(worker: Conn, admin_conn: Conn) -> None:
    lease, keys = group(worker, sent=2)  # c2 is still planned
    with refused(admin_conn, "RL004") as info:
        complete_calls(worker, lease, keys, ["succeeded"] * 3, [{"r": i} for i in range(3)])
    assert f"call {keys[2]} is planned, not dispatched" in (info.value.diag.message_primary or "")
    with refused(admin_conn, "RL006"):  # the last call's result is refused
        complete_calls(
            worker, lease, keys[:2], ["succeeded", "succeeded"], [{"r": 0}, 7], [None, 7]
        )
    lease_b, keys_b = group(worker, "r2", n=2)
    complete(worker, lease_b, keys_b[1], "succeeded", {"r": 1})
    with refused(admin_conn, "RL004"):  # the next call (final already) after the batch's
        complete_calls(worker, lease_b, keys_b[:1], ["succeeded"], next_key=keys_b[1])
    # and then the batch goes through
    complete_calls(worker, lease, keys[:2], ["succeeded", "succeeded"], [{"r": 0}, {"r": 1}])
    assert [call_row(admin_conn, k)["status"] for k in keys] == [
        "succeeded",
        "succeeded",
        "planned",
    ]
    with refused(admin_conn, "RL004"):  # a call completes once
        complete_calls(worker, lease, keys[:1], ["succeeded"])


def test_a_stale_lease_is_refused(worker: Conn, admin_conn: Conn, db_clock: DbClock) -> None:
    lease, keys = group(worker)
    wrong = dataclasses.replace(lease, token=lease.token + 1)
    with refused(admin_conn, "RL001"):
        complete_calls(worker, wrong, keys, ["succeeded"] * 3)
    db_clock.advance(LEASE_SECONDS + 1)
    with refused(admin_conn, "RL001"):  # expired, not yet taken over
        complete_calls(worker, lease, keys, ["succeeded"] * 3)
    [taken] = claim(worker, "w2")
    assert taken.run_id == "r1" and taken.token > lease.token
    with refused(admin_conn, "RL001") as info:  # taken over: the old holder is refused
        complete_calls(worker, lease, keys, ["succeeded"] * 3)
    assert "lease lost" in (info.value.diag.message_primary or "")


@pytest.mark.parametrize(
    ("case", "code"),
    [
        ("no keys", "RL006"),
        ("NULL keys", "RL006"),
        ("101 keys", "RL006"),
        ("two-dimensional keys", "RL006"),
        ("keys from 0", "RL006"),
        ("fewer outcomes", "RL006"),
        ("NULL results", "RL006"),
        ("two-dimensional receipts", "RL006"),
        ("a key twice", "RL006"),
        ("unknown outcome", "RL006"),
        ("NULL outcome", "RL006"),
        ("receipt not an object", "RL006"),
        ("result too deep", "RL006"),
        ("NULL key", "RL006"),
        ("key too long", "RL006"),
        ("no such call", "RL003"),
        ("a call of another run", "RL003"),
        ("next call after unknown", "RL006"),
        ("next call after not_applied", "RL006"),
        ("next call among the keys", "RL006"),
        ("no such next call", "RL003"),
        ("next key too long", "RL006"),
    ],
)
def test_hostile_input_is_refused_and_nothing_written(
    worker: Conn, admin_conn: Conn, case: str, code: str
) -> None:
    lease, keys = group(worker)
    _, other = group(worker, "r2")
    ok = ["succeeded"] * 3
    deep: Any = {}
    for _ in range(100):
        deep = {"d": deep}
    sql_only = {  # arrays psycopg would not build: passed as literals
        "two-dimensional keys": ("{{a,b},{c,d}}", "{succeeded,succeeded,succeeded,succeeded}"),
        "keys from 0": ("[0:2]={" + ",".join(keys) + "}", "{succeeded,succeeded,succeeded}"),
    }
    if case in sql_only:
        k, o = sql_only[case]
        with refused(admin_conn, code, case):
            scalar(worker, SQL, (lease.run_id, lease.lease_id, lease.token, k, o,
                                 "{NULL,NULL,NULL}", "{NULL,NULL,NULL}", None))  # fmt: skip
        return
    if case == "two-dimensional receipts":
        with refused(admin_conn, code, case):
            scalar(worker, SQL, (lease.run_id, lease.lease_id, lease.token, keys, ok,
                                 "{NULL,NULL,NULL}", "{{NULL},{NULL},{NULL}}", None))  # fmt: skip
        return
    args: dict[str, Any] = {
        "no keys": {"keys": [], "outcomes": []},
        "NULL keys": {"keys": None, "outcomes": ok},
        "101 keys": {"keys": [keys[0]] * 101, "outcomes": ["succeeded"] * 101},
        "fewer outcomes": {"keys": keys, "outcomes": ok[:2]},
        "NULL results": {"keys": keys, "outcomes": ok, "results": "NULL"},
        "a key twice": {"keys": [keys[0], keys[1], keys[0]], "outcomes": ok},
        "unknown outcome": {"keys": keys, "outcomes": ["succeeded", "done", "succeeded"]},
        "NULL outcome": {"keys": keys, "outcomes": ["succeeded", None, "succeeded"]},
        "receipt not an object": {"keys": keys, "outcomes": ok, "receipts": [None, None, [1]]},
        "result too deep": {"keys": keys, "outcomes": ok, "results": [None, deep, None]},
        "NULL key": {"keys": [keys[0], None, keys[2]], "outcomes": ok},
        "key too long": {"keys": [keys[0], "k" * 301, keys[2]], "outcomes": ok},
        "no such call": {"keys": [keys[0], "r1:0:nope", keys[2]], "outcomes": ok},
        "a call of another run": {"keys": [keys[0], other[1], keys[2]], "outcomes": ok},
        "next call after unknown": {
            "keys": keys[:2],
            "outcomes": ["succeeded", "unknown"],
            "next_key": keys[2],
        },
        "next call after not_applied": {
            "keys": keys[:1],
            "outcomes": ["not_applied"],
            "next_key": keys[2],
        },
        "next call among the keys": {"keys": keys, "outcomes": ok, "next_key": keys[1]},
        "no such next call": {"keys": keys, "outcomes": ok, "next_key": "r1:0:nope"},
        "next key too long": {"keys": keys, "outcomes": ok, "next_key": "k" * 301},
    }[case]
    if args.get("results") == "NULL":
        with refused(admin_conn, code, case):
            scalar(worker, SQL, (lease.run_id, lease.lease_id, lease.token, keys, ok, None,
                                 "{NULL,NULL,NULL}", None))  # fmt: skip
        return
    with refused(admin_conn, code, case):
        complete_calls(
            worker,
            lease,
            args["keys"],
            args["outcomes"],
            args.get("results"),
            args.get("receipts"),
            args.get("next_key"),
        )


def test_old_completions_still_work_beside_it(worker: Conn, admin_conn: Conn) -> None:
    lease, keys = group(worker)
    complete(worker, lease, keys[0], "succeeded", {"ok": 0})
    complete_calls(worker, lease, keys[1:], ["succeeded", "succeeded"], [{"ok": 1}, {"ok": 2}])
    assert [call_row(admin_conn, k)["result"] for k in keys] == [{"ok": i} for i in range(3)]
