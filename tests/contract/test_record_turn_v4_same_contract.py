"""record_turn_v4's body (since revision 0020) against the body it replaced (0018's): for
each decision, good or refused, the same result, the same rows and events, or the same
refusal (SQLSTATE, message, detail, hint).

The reference is vendored in reference/record_turn_v4_0018.sql: record_turn_v4 as
revision 0020's downgrade restored it, taken from commit 4b19f01,
migrations/versions/0020_hot_turn_claim.down.sql (gone since the baseline "0.1"),
installed as record_turn_v4_0018.

Revision 0020 answers most checks without a query (the JSON checks with the settings
read once, one call to dispatch by containment) and skips the query that finds the first
bad call when every call passes; the cases sit on both sides of each of those shortcuts.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

import psycopg
import pytest
from psycopg.types.json import Jsonb

from .helpers import Lease, complete, key, set_payload_cap, submit_and_claim

Conn = psycopg.Connection[Any]

OLD = "record_turn_v4_0018"


REFERENCE = Path(__file__).parent / "reference" / f"{OLD}.sql"


def _install_old(admin: Conn) -> None:
    admin.execute(REFERENCE.read_text(encoding="utf-8"))  # type: ignore[arg-type]


def _deep(levels: int) -> Any:
    value: Any = 1
    for _ in range(levels):
        value = {"a": value}
    return value


def _written(conn: Conn, run_id: str) -> dict[str, Any]:
    """What a call wrote: the run's rows and events, without clock readings and ids
    drawn from sequences (two calls in turn read the clock twice)."""
    q = conn.execute
    return {
        "run": q(
            "SELECT to_jsonb(r) - 'updated_at' - 'finished_at' FROM runledger.runs r"
            " WHERE r.run_id = %s",
            (run_id,),
        ).fetchall(),
        "turns": q(
            "SELECT to_jsonb(t) - 'created_at' FROM runledger.run_turns t WHERE t.run_id = %s"
            " ORDER BY t.turn",
            (run_id,),
        ).fetchall(),
        "calls": q(
            "SELECT to_jsonb(c) - 'dispatched_at' - 'completed_at' FROM runledger.run_calls c"
            " WHERE c.run_id = %s ORDER BY c.turn, c.position",
            (run_id,),
        ).fetchall(),
        "events": q(
            "SELECT e.kind, e.actor, e.fencing_token, e.state_version, e.detail"
            " FROM runledger.run_events e WHERE e.run_id = %s ORDER BY e.event_id",
            (run_id,),
        ).fetchall(),
    }


def _outcome(conn: Conn, fn: str, lease: Lease, args: dict[str, Any]) -> tuple[Any, ...]:
    params = (
        lease.run_id,
        lease.lease_id,
        lease.token,
        args.get("turn", 0),
        None if args.get("calls") is None else Jsonb(args["calls"]),
        None if args.get("record") is None else Jsonb(args["record"]),
        None if args.get("output") is None else Jsonb(args["output"]),
        args.get("expected", lease.state_version),
        None if args.get("state") is None else Jsonb(args["state"]),
        args.get("finish", False),
        args.get("dispatch"),
    )
    try:
        with conn.transaction(force_rollback=True):
            if "cap" in args:
                set_payload_cap(conn, args["cap"])
            row = conn.execute(
                f"SELECT * FROM runledger.{fn}(%s, %s, %s, %s, %s::jsonb, %s::jsonb, %s::jsonb,"  # type: ignore[arg-type]
                " %s, %s::jsonb, %s, %s::text[])",
                params,
            ).fetchone()
            return ("ok", row, _written(conn, lease.run_id))
    except psycopg.Error as e:
        d = e.diag
        return ("refused", e.sqlstate, d.message_primary, d.message_detail, d.message_hint)


def _c(call_id: Any, tool: Any = "t", **extra: Any) -> dict[str, Any]:
    return {"call_id": call_id, "tool": tool, **extra}


THREE = [_c("c0", args={"i": 0}), _c("c1"), _c("c2", provider_id="p2")]

CASES: dict[str, dict[str, Any]] = {
    # good decisions
    "three calls, the first dispatched": {"calls": THREE, "dispatch": ["c0"]},
    "three calls, two dispatched": {"calls": THREE, "dispatch": ["c1", "c0"]},
    "three calls, none dispatched": {"calls": THREE},
    "empty dispatch": {"calls": THREE, "dispatch": []},
    "with a checkpoint": {"calls": THREE, "dispatch": ["c0"], "state": {"n": 1}},
    "with a record": {"calls": THREE, "record": {"role": "assistant"}},
    "approval false and true": {
        "calls": [_c("c0", approval=False), _c("c1", approval=True)],
        "dispatch": ["c0"],
    },
    "the final decision": {"calls": [], "output": {"done": 1}, "state": {"n": 2}, "finish": True},
    "the final decision without output": {"calls": [], "finish": True},
    "no calls, not final": {"calls": []},
    "long args, not too deep": {"calls": [_c("c0", args={"x": "y" * 500})], "dispatch": ["c0"]},
    "args at the depth limit": {"calls": [_c("c0", args=_deep(63))]},
    # the JSON checks
    "calls null": {"calls": None},
    "calls an object": {"calls": {"a": 1}},
    "calls too deep": {"calls": [_c("c0", args=_deep(70))]},
    "calls over the cap": {"calls": [_c("c0", args={"x": "y" * 3000})], "cap": 2048},
    "state over the cap": {"calls": [], "state": {"x": "y" * 3000}, "cap": 2048},
    "record a string": {"calls": THREE, "record": "x"},
    "record an array": {"calls": THREE, "record": []},
    "record too deep": {"calls": THREE, "record": _deep(70)},
    "record over the cap": {"calls": THREE, "record": {"x": "y" * 3000}, "cap": 2048},
    "output too deep": {"calls": [], "output": _deep(70)},
    "output a scalar": {"calls": [], "output": 5, "finish": True},
    "output over the cap": {"calls": [], "output": "y" * 3000, "cap": 2048},
    "output with calls": {"calls": THREE, "output": {"a": 1}},
    "state an array": {"calls": THREE, "state": []},
    "state a number": {"calls": THREE, "state": 5},
    "state too deep": {"calls": THREE, "state": _deep(70)},
    "finish null": {"calls": [], "finish": None},
    "finish with calls": {"calls": THREE, "finish": True},
    "turn negative": {"calls": THREE, "turn": -1},
    "turn null": {"calls": THREE, "turn": None},
    "turn out of order": {"calls": THREE, "turn": 1},
    "state version conflict": {"calls": THREE, "state": {"n": 1}, "expected": 7},
    # the calls to dispatch
    "dispatch an unknown id": {"calls": THREE, "dispatch": ["c9"]},
    "dispatch one id twice": {"calls": THREE, "dispatch": ["c1", "c1"]},
    "dispatch a null": {"calls": THREE, "dispatch": [None]},
    "dispatch a null after an id": {"calls": THREE, "dispatch": ["c1", None]},
    "dispatch an empty id": {"calls": THREE, "dispatch": [""]},
    "dispatch a number id": {"calls": [_c(5)], "dispatch": ["5"]},
    "dispatch into no calls": {"calls": [], "dispatch": ["c0"], "finish": True},
    "dispatch a call awaiting approval": {"calls": [_c("c0", approval=True)], "dispatch": ["c0"]},
    "dispatch a non-object call": {"calls": [5, _c("c0")], "dispatch": ["c0"]},
    # the checks of each call
    "a call not an object": {"calls": [_c("c0"), 5]},
    "a call id a number": {"calls": [_c(5)]},
    "a call id missing": {"calls": [{"tool": "t"}]},
    "a call id invalid": {"calls": [_c("bad id!")], "dispatch": ["bad id!"]},
    "a call id too long": {"calls": [_c("x" * 65)]},
    "a call id of 64": {"calls": [_c("x" * 64)], "dispatch": ["x" * 64]},
    "a call id starting with a dot": {"calls": [_c(".c0")]},
    "a call id with a newline at its end": {"calls": [_c("c0\n")]},
    "a call id empty": {"calls": [_c("")]},
    "a tool of 128": {"calls": [_c("c0", "t" * 128)]},
    "a tool of 129": {"calls": [_c("c0", "t" * 129)]},
    "a tool starting with a digit": {"calls": [_c("c0", "1t")]},
    "a tool not a string": {"calls": [_c("c0", ["t"])]},
    "a call id twice": {"calls": [_c("c0"), _c("c0")], "dispatch": ["c0"]},
    "a call id twice, and a bad tool first": {"calls": [_c("c0"), _c("c0", "bad tool")]},
    "a tool invalid": {"calls": [_c("c0", "bad tool")], "dispatch": ["c0"]},
    "a tool missing": {"calls": [{"call_id": "c0"}]},
    "args an array": {"calls": [_c("c0", args=[])]},
    "args null": {"calls": [_c("c0", args=None)]},
    "a provider id a number": {"calls": [_c("c0", provider_id=5)]},
    "a provider id empty": {"calls": [_c("c0", provider_id="")]},
    "a provider id too long": {"calls": [_c("c0", provider_id="p" * 201)]},
    "a provider id null": {"calls": [_c("c0", provider_id=None)]},
    "approval a string": {"calls": [_c("c0", approval="yes")]},
    "approval null": {"calls": [_c("c0", approval=None)]},
    "the second of two bad calls": {"calls": [_c("c0"), _c("c1", args=[]), _c("bad id!")]},
}


@pytest.mark.parametrize("case", list(CASES))
def test_a_first_decision_gets_what_it_got_before(
    worker: Conn, admin_conn: Conn, case: str
) -> None:
    _install_old(admin_conn)
    lease = submit_and_claim(worker, "r1")
    args = CASES[case]
    assert _outcome(admin_conn, "record_turn_v4", lease, args) == _outcome(
        admin_conn, OLD, lease, args
    )


def _turn_recorded(worker: Conn, lease: Lease) -> None:
    worker.execute(
        "SELECT * FROM runledger.record_turn_v4(%s, %s, %s, 0, %s, NULL, NULL, NULL, NULL,"
        " false, %s::text[])",
        (lease.run_id, lease.lease_id, lease.token, Jsonb(THREE), ["c0"]),
    )


def _completed(worker: Conn, lease: Lease) -> None:
    _turn_recorded(worker, lease)
    for i, cid in enumerate(("c0", "c1", "c2")):
        if i:
            worker.execute(
                "SELECT runledger.dispatch_call(%s, %s, %s, %s)",
                (lease.run_id, lease.lease_id, lease.token, key(lease.run_id, 0, cid)),
            )
        complete(worker, lease, key(lease.run_id, 0, cid), "succeeded", {"ok": i})


LATER: dict[str, tuple[Callable[[Conn, Lease], None], dict[str, Any]]] = {
    "the same decision again": (_turn_recorded, {"calls": THREE, "dispatch": ["c0"]}),
    "the same decision again, another call": (_turn_recorded, {"calls": THREE, "dispatch": ["c1"]}),
    "the same calls, another record": (_turn_recorded, {"calls": THREE, "record": {"a": 1}}),
    "other calls": (_turn_recorded, {"calls": [_c("c0")]}),
    "the next turn with calls open": (_turn_recorded, {"calls": [_c("d0")], "turn": 1}),
    "the next turn": (_completed, {"calls": [_c("d0")], "turn": 1, "dispatch": ["d0"]}),
    "the next turn skipped": (_completed, {"calls": [_c("d0")], "turn": 2}),
    "the end": (_completed, {"calls": [], "turn": 1, "finish": True, "output": {"r": 1}}),
    "the end, its result counted": (_completed, {"calls": [], "turn": 1, "finish": True}),
    "an earlier call to dispatch": (
        _completed,
        {"calls": [_c("d0")], "turn": 1, "dispatch": ["c0"]},
    ),
}


@pytest.mark.parametrize("case", list(LATER))
def test_a_later_decision_gets_what_it_got_before(
    worker: Conn, admin_conn: Conn, case: str
) -> None:
    _install_old(admin_conn)
    lease = submit_and_claim(worker, "r1")
    setup, args = LATER[case]
    setup(worker, lease)
    assert _outcome(admin_conn, "record_turn_v4", lease, args) == _outcome(
        admin_conn, OLD, lease, args
    )
