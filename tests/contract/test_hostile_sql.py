"""Hostile input against every SQL function: a typed refusal, and nothing written.

Table-driven. ``REFUSALS`` lists (function, argument, hostile value, SQLSTATE); each case
runs against one shared database holding a running run with a dispatched call, a paused
run with an unknown call, a queued and a failed run and a registered worker, and asserts
the exact SQLSTATE and that no row of any runledger table (settings included) changed.
A refused case changes nothing, so the cases can share the database; a case that was
wrongly accepted fails itself. The boundaries (depth at the limit, text at its cap) are
accepted and must store the value exactly, so they run on a fresh database each.

Then the two concurrency cases of issue 7: a lease that expires while its write waits on
the run's row lock (RL001 once the lock is granted), and two sessions registering one
worker id (RL008 while the first is alive).
"""

from __future__ import annotations

import contextlib
import datetime as dt
import os
import signal
import subprocess
import sys
from collections.abc import Callable, Iterator
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any

import psycopg
import pytest
from psycopg.rows import dict_row
from psycopg.types.json import Jsonb

from runledger.testing.postgres import Databases
from tests.contract.conftest import Connect
from tests.contract.helpers import (
    FLOW_REF,
    Lease,
    call,
    call_row,
    claim,
    complete,
    dispatched_call,
    events,
    finish,
    one,
    paused_on_unknown,
    record_turn,
    rows,
    run_row,
    scalar,
    sqlstate,
    submit,
    submit_and_claim,
    wait_until,
    waiting_on_a_lock,
)

Conn = psycopg.Connection[Any]

LIMIT = 64  # the default of settings.max_json_depth
DAY_LEASE = dt.timedelta(hours=12)  # the shared run's lease outlives the module


# -- snapshots of every table -------------------------------------------------------------

ALL_TABLES = ("runs", "run_turns", "run_calls", "run_events", "workers", "settings")


def everything(admin: Conn) -> dict[str, list[dict[str, Any]]]:
    with admin.cursor(row_factory=dict_row) as cur:
        out = {}
        for table in ALL_TABLES:
            cur.execute(f"SELECT * FROM runledger.{table} ORDER BY 1, 2")  # type: ignore[arg-type]
            out[table] = cur.fetchall()
        cur.execute("SELECT last_value FROM runledger.run_events_event_id_seq")
        out["run_events_event_id_seq"] = cur.fetchall()
    return out


@contextlib.contextmanager
def refused_untouched(admin: Conn, code: str, case: object) -> Iterator[Any]:
    """SQLSTATE ``code``, and no row of any runledger table changed."""
    before = everything(admin)
    with sqlstate(code, case) as caught:
        yield caught
    after = everything(admin)
    for table in ALL_TABLES:
        assert after[table] == before[table], f"[{case}] runledger.{table} changed"


# -- hostile values ---------------------------------------------------------------------------


def nest(depth: int, shape: str = "objects") -> Any:
    """A JSON value of exactly ``depth`` (a scalar is 0; each object or array adds one).

    objects: {"a": {"a": ... 1}}; arrays: [[... [1]]]; mixed: {"a": [{"a": [... 1]}]};
    empty: the innermost container is empty; late: the deep branch is the last member of
    a wide object, after shallow ones.
    """
    if depth == 0:
        return 1
    if shape == "objects":
        return {"a": nest(depth - 1, shape)}
    if shape == "arrays":
        return [nest(depth - 1, shape)]
    if shape == "mixed":
        return {"a": nest(depth - 1, "mixed_array")}
    if shape == "mixed_array":
        return [nest(depth - 1, "mixed")]
    if shape == "empty":
        return {} if depth == 1 else {"a": nest(depth - 1, shape)}
    if shape == "late":
        wide: dict[str, Any] = {f"k{i}": i for i in range(50)}
        wide["m"] = [1, {"x": 2}]
        wide["z"] = nest(depth - 1, "objects")
        return wide
    raise AssertionError(shape)


def nest_object(depth: int, shape: str) -> Any:
    """As :func:`nest`, with an object at the root (for arguments that must be objects)."""
    value = nest(depth, shape)
    return value if isinstance(value, dict) else {"v": nest(depth - 1, shape)}


def depth_of(value: Any) -> int:
    if isinstance(value, dict):
        return 1 + max((depth_of(v) for v in value.values()), default=0)
    if isinstance(value, list):
        return 1 + max((depth_of(v) for v in value), default=0)
    return 0


SHAPES = ("objects", "arrays", "mixed", "empty", "late")
ISSUE_REPRO = "(repeat('{\"a\":', 2000) || '1' || repeat('}', 2000))::jsonb"


def test_the_builders_make_the_depth_they_say() -> None:
    for shape in SHAPES:
        for d in (3, 5, LIMIT, LIMIT + 1):
            assert depth_of(nest(d, shape)) == d, (shape, d)
            assert depth_of(nest_object(d, shape)) == d, (shape, d)
            assert isinstance(nest_object(d, shape), dict)


# -- the shared world ------------------------------------------------------------------------


@dataclass(frozen=True)
class World:
    """r1 running (lease), with r1:0:c1 dispatched; p1 paused with p1:0:c1 unknown; q1
    queued; f1 failed; worker w1 registered by the worker session."""

    lease: Lease
    key: str
    unknown_key: str


@pytest.fixture(scope="module")
def world_url(runledger_databases: Databases) -> Iterator[str]:
    url = runledger_databases.create("rl_hostile")
    try:
        yield url
    finally:
        runledger_databases.drop(url)


@pytest.fixture(scope="module")
def sessions(world_url: str) -> Iterator[dict[str, Conn]]:
    opened: dict[str, Conn] = {}
    try:
        for role in ("admin", "runledger_worker", "runledger_operator"):
            conn = psycopg.connect(world_url, autocommit=True, row_factory=dict_row)
            if role != "admin":
                conn.execute(f"SET ROLE {role}")  # type: ignore[arg-type]
            opened[role] = conn
        yield opened
    finally:
        for conn in opened.values():
            conn.close()


@pytest.fixture(scope="module")
def world(sessions: dict[str, Conn]) -> World:
    w = sessions["runledger_worker"]
    w.execute("SELECT runledger.register_worker_v2('w1', 'host-a', 101, ARRAY['demo@1'], false)")
    submit(w, "p1")
    [paused] = claim(w, "w1", lease_seconds=60, max_runs=1)
    [unknown_key] = paused_on_unknown(w, paused)
    submit(w, "f1")
    [failing] = claim(w, "w1", lease_seconds=60, max_runs=1)
    finish(w, failing, "failed", None, reason="broken")
    lease = submit_and_claim(w, "r1", "w1", lease_seconds=DAY_LEASE.total_seconds())
    key = dispatched_call(w, lease)
    submit(w, "q1")
    assert run_row(sessions["admin"], "p1")["status"] == "paused"
    assert run_row(sessions["admin"], "f1")["status"] == "failed"
    return World(lease=lease, key=key, unknown_key=unknown_key)


# -- the refusals -------------------------------------------------------------------------------

Args = Callable[[World], tuple[Any, ...]]


@dataclass(frozen=True)
class Case:
    name: str
    role: str  # "worker" or "operator"
    sql: str
    args: Args
    code: str


def _lease(w: World) -> tuple[Any, ...]:
    return (w.lease.run_id, w.lease.lease_id, w.lease.token)


SUBMIT = "SELECT * FROM runledger.submit_run(%s, %s, %s, %s, 0, NULL)"
SUBMIT_V2 = "SELECT * FROM runledger.submit_run_v2(%s, %s, %s, %s, 0, NULL, %s)"
TRACEPARENT = "00-0af7651916cd43dd8448eb211c80319c-b7ad6b7169203331-01"
CHECKPOINT = "SELECT runledger.checkpoint(%s, %s, %s, 0, %s)"
RECORD_TURN = (  # a bare decision: no record, output, checkpoint, finish or dispatch
    "SELECT runledger.record_turn_v4(%s, %s, %s, 1, %s, NULL, NULL, NULL, NULL, false, NULL)"
)
DISPATCH = "SELECT runledger.dispatch_call(%s, %s, %s, %s)"
COMPLETE = "SELECT runledger.complete_call(%s, %s, %s, %s, %s, %s, %s)"
COMPLETE_CALLS = (  # one call: each array of one element
    "SELECT runledger.complete_calls(%s, %s, %s, ARRAY[%s]::text[], ARRAY[%s]::text[],"
    " ARRAY[%s::jsonb], ARRAY[%s::jsonb])"
)
FINISH = "SELECT runledger.finish_run(%s, %s, %s, %s, %s, %s)"
RELEASE5 = "SELECT runledger.release_lease(%s, %s, %s, %s, %s)"
RESOLVE = "SELECT runledger.resolve_call(%s, %s, %s, %s, %s)"
CANCEL = "SELECT runledger.cancel_run(%s, %s, %s)"
RETRY = "SELECT runledger.retry_run(%s, %s)"
CLAIM = "SELECT * FROM runledger.claim_runs_v4(%s, %s::text[], '30 seconds', 5)"
RENEW = "SELECT * FROM runledger.renew_leases(%s, %s::text[], %s::uuid[], '30 seconds')"
REGISTER = "SELECT runledger.register_worker_v2(%s, %s, 7, %s::text[], false)"
HEARTBEAT = "SELECT runledger.heartbeat_worker(%s, %s)"
STALE = "SELECT runledger.report_stale_write(%s, %s, NULL, 1, %s, %s)"


def json_cases() -> list[Case]:
    """Every JSON argument of every function, one level over the limit, in each shape."""
    cases: list[Case] = []
    for shape in SHAPES:
        deep_obj = Jsonb(nest_object(LIMIT + 1, shape))
        deep_any = Jsonb(nest(LIMIT + 1, shape))
        deep_args = Jsonb([{"call_id": "c1", "tool": "t", "args": nest_object(LIMIT + 1, shape)}])
        deep_member = Jsonb([{"call_id": "c1", "tool": "t", "meta": nest(LIMIT + 1, shape)}])
        cases += [
            Case(f"submit_run input {shape}", "worker", SUBMIT,
                 lambda w, v=deep_obj: ("deep1", "demo", "1", v), "RL006"),
            Case(f"checkpoint state {shape}", "worker", CHECKPOINT,
                 lambda w, v=deep_obj: (*_lease(w), v), "RL006"),
            Case(f"record_turn_v4 args {shape}", "worker", RECORD_TURN,
                 lambda w, v=deep_args: (*_lease(w), v), "RL006"),
            Case(f"record_turn_v4 call member {shape}", "worker", RECORD_TURN,
                 lambda w, v=deep_member: (*_lease(w), v), "RL006"),
            Case(f"complete_call result {shape}", "worker", COMPLETE,
                 lambda w, v=deep_any: (*_lease(w), w.key, "succeeded", v, None), "RL006"),
            Case(f"complete_call receipt {shape}", "worker", COMPLETE,
                 lambda w, v=deep_obj: (*_lease(w), w.key, "succeeded", None, v), "RL006"),
            Case(f"complete_calls result {shape}", "worker", COMPLETE_CALLS,
                 lambda w, v=deep_any: (*_lease(w), w.key, "succeeded", v, None), "RL006"),
            Case(f"complete_calls receipt {shape}", "worker", COMPLETE_CALLS,
                 lambda w, v=deep_obj: (*_lease(w), w.key, "succeeded", None, v), "RL006"),
            Case(f"finish_run result {shape}", "worker", FINISH,
                 lambda w, v=deep_any: (*_lease(w), "paused", v, None), "RL006"),
            Case(f"release_lease error {shape}", "worker", RELEASE5,
                 lambda w, v=deep_obj: (*_lease(w), "worker_error", v), "RL006"),
            Case(f"resolve_call receipt {shape}", "operator", RESOLVE,
                 lambda w, v=deep_obj: (w.unknown_key, "applied", v, "alice", None), "RL006"),
        ]  # fmt: skip
    # The reproduction of issue 7, and the same 2000 levels for every JSON argument.
    r = ISSUE_REPRO
    cases += [
        Case("issue 7 repro: submit_run deep1", "worker",
             f"SELECT * FROM runledger.submit_run('deep1', 'scripted', '1', {r})",
             lambda w: (), "RL006"),
        Case("2000 levels: checkpoint", "worker",
             f"SELECT runledger.checkpoint(%s, %s, %s, 0, {r})", _lease, "RL006"),
        Case("2000 levels: record_turn_v4 args", "worker",
             "SELECT runledger.record_turn_v4(%s, %s, %s, 1, jsonb_build_array("
             f"jsonb_build_object('call_id', 'c1', 'tool', 't', 'args', {r})),"
             " NULL, NULL, NULL, NULL, false, NULL)",
             _lease, "RL006"),
        Case("2000 levels: complete_call result", "worker",
             f"SELECT runledger.complete_call(%s, %s, %s, %s, 'failed', {r}, NULL)",
             lambda w: (*_lease(w), w.key), "RL006"),
        Case("2000 levels: complete_call receipt", "worker",
             f"SELECT runledger.complete_call(%s, %s, %s, %s, 'succeeded', NULL, {r})",
             lambda w: (*_lease(w), w.key), "RL006"),
        Case("2000 levels: complete_calls result", "worker",
             "SELECT runledger.complete_calls(%s, %s, %s, ARRAY[%s], ARRAY['failed'],"
             f" ARRAY[{r}], ARRAY[NULL::jsonb])",
             lambda w: (*_lease(w), w.key), "RL006"),
        Case("2000 levels: finish_run result", "worker",
             f"SELECT runledger.finish_run(%s, %s, %s, 'paused', {r}, NULL)", _lease, "RL006"),
        Case("2000 levels: release_lease error", "worker",
             f"SELECT runledger.release_lease(%s, %s, %s, 'worker_error', {r})", _lease,
             "RL006"),
        Case("2000 levels: resolve_call receipt", "operator",
             f"SELECT runledger.resolve_call(%s, 'applied', {r}, 'alice', NULL)",
             lambda w: (w.unknown_key,), "RL006"),
    ]  # fmt: skip
    return cases


NUL = "convert_from('\\x610062'::bytea, 'UTF8')"  # 'a', NUL, 'b' as a raw client sends it


def worker_id_cases() -> list[Case]:
    """NULL, empty, 201 characters, 10 kB and a NUL, for each function taking a worker id."""
    bad: dict[str, Any] = {"NULL": None, "empty": "", "201 chars": "w" * 201, "10 kB": "w" * 10_000}
    cases: list[Case] = []
    for label, wid in bad.items():
        cases += [
            Case(f"claim_runs_v4 worker id {label}", "worker", CLAIM,
                 lambda w, x=wid: (x, [FLOW_REF]), "RL006"),
            Case(f"register_worker_v2 worker id {label}", "worker", REGISTER,
                 lambda w, x=wid: (x, "host", [FLOW_REF]), "RL006"),
            Case(f"renew_leases worker id {label}", "worker", RENEW,
                 lambda w, x=wid: (x, [w.lease.run_id], [w.lease.lease_id]), "RL006"),
            Case(f"renew_leases worker id {label}, nothing to renew", "worker", RENEW,
                 lambda w, x=wid: (x, [], []), "RL006"),
            Case(f"heartbeat_worker worker id {label}", "worker", HEARTBEAT,
                 lambda w, x=wid: (x, False), "RL006"),
            Case(f"heartbeat_worker stop, worker id {label}", "worker", HEARTBEAT,
                 lambda w, x=wid: (x, True), "RL006"),
            Case(f"report_stale_write worker id {label}", "worker", STALE,
                 lambda w, x=wid: ("r1", x, "checkpoint", "lease lost"), "RL006"),
        ]  # fmt: skip
    cases += [
        Case("claim_runs_v4 worker id NUL", "worker",
             f"SELECT * FROM runledger.claim_runs_v4({NUL}, ARRAY['demo@1'], '30 s', 5)",
             lambda w: (), "22021"),
        Case("register_worker_v2 worker id NUL", "worker",
             f"SELECT runledger.register_worker_v2({NUL}, 'h', 1, ARRAY['demo@1'], false)",
             lambda w: (), "22021"),
        Case("renew_leases worker id NUL", "worker",
             f"SELECT * FROM runledger.renew_leases({NUL}, %s::text[], %s::uuid[], '30 s')",
             lambda w: ([w.lease.run_id], [w.lease.lease_id]), "22021"),
        Case("heartbeat_worker worker id NUL", "worker",
             f"SELECT runledger.heartbeat_worker({NUL}, true)", lambda w: (), "22021"),
        Case("report_stale_write worker id NUL", "worker",
             f"SELECT runledger.report_stale_write('r1', {NUL}, NULL, 1, 'op', 'm')",
             lambda w: (), "22021"),
    ]  # fmt: skip
    return cases


def text_cases() -> list[Case]:
    """Every text (and array) argument over its cap; NULL or empty where a value is needed."""
    big = "x" * 2_097_152  # the 2 MiB of issue 7, item 8
    k = "r1:0:c1"
    return [
        # submit_run: run id, flow name and version
        Case("submit_run run id 129 chars", "worker", SUBMIT,
             lambda w: ("r" * 129, "demo", "1", Jsonb({})), "RL006"),
        Case("submit_run run id NULL", "worker", SUBMIT,
             lambda w: (None, "demo", "1", Jsonb({})), "RL006"),
        Case("submit_run flow 129 chars", "worker", SUBMIT,
             lambda w: ("n1", "f" * 129, "1", Jsonb({})), "RL006"),
        Case("submit_run flow 2 MiB", "worker", SUBMIT,
             lambda w: ("n1", big, "1", Jsonb({})), "RL006"),
        Case("submit_run flow NULL", "worker", SUBMIT,
             lambda w: ("n1", None, "1", Jsonb({})), "RL006"),
        Case("submit_run version 65 chars", "worker", SUBMIT,
             lambda w: ("n1", "demo", "1" * 65, Jsonb({})), "RL006"),
        Case("submit_run version NULL", "worker", SUBMIT,
             lambda w: ("n1", "demo", None, Jsonb({})), "RL006"),
        # submit_run_v2: the traceparent (revision 0017), and the checks before it
        Case("submit_run_v2 traceparent malformed", "worker", SUBMIT_V2,
             lambda w: ("n1", "demo", "1", Jsonb({}), "00-abc-def-01"), "RL006"),
        Case("submit_run_v2 traceparent uppercase", "worker", SUBMIT_V2,
             lambda w: ("n1", "demo", "1", Jsonb({}), TRACEPARENT.upper()), "RL006"),
        Case("submit_run_v2 traceparent zero trace id", "worker", SUBMIT_V2,
             lambda w: ("n1", "demo", "1", Jsonb({}), f"00-{'0' * 32}-{'1' * 16}-01"), "RL006"),
        Case("submit_run_v2 traceparent 2 MiB", "worker", SUBMIT_V2,
             lambda w: ("n1", "demo", "1", Jsonb({}), big), "RL006"),
        Case("submit_run_v2 traceparent NUL", "worker",
             f"SELECT * FROM runledger.submit_run_v2('n1', 'demo', '1', '{{}}', 0, NULL, {NUL})",
             lambda w: (), "22021"),
        Case("submit_run_v2 run id NULL", "worker", SUBMIT_V2,
             lambda w: (None, "demo", "1", Jsonb({}), TRACEPARENT), "RL006"),
        Case("submit_run_v2 input deep", "worker", SUBMIT_V2,
             lambda w: ("n1", "demo", "1", Jsonb(nest_object(LIMIT + 1, "objects")), TRACEPARENT),
             "RL006"),
        # flow references (arrays)
        Case("claim_runs_v4 flows 1001 elements", "worker", CLAIM,
             lambda w: ("w1", [FLOW_REF] * 1001), "RL006"),
        Case("claim_runs_v4 flow reference 10 kB", "worker", CLAIM,
             lambda w: ("w1", ["f" * 10_000 + "@1"]), "RL006"),
        Case("claim_runs_v4 flow reference NULL", "worker", CLAIM,
             lambda w: ("w1", [None]), "RL006"),
        Case("register_worker_v2 flows 1001 elements", "worker", REGISTER,
             lambda w: ("w9", "host", [FLOW_REF] * 1001), "RL006"),
        Case("register_worker_v2 flows NULL", "worker", REGISTER,
             lambda w: ("w9", "host", None), "RL006"),
        Case("register_worker_v2 hostname 256 chars", "worker", REGISTER,
             lambda w: ("w9", "h" * 256, [FLOW_REF]), "RL006"),
        # renew_leases: the run ids
        Case("renew_leases run id 129 chars", "worker", RENEW,
             lambda w: ("w1", ["r" * 129], [w.lease.lease_id]), "RL006"),
        Case("renew_leases run id NULL", "worker", RENEW,
             lambda w: ("w1", [None], [w.lease.lease_id]), "RL006"),
        Case("renew_leases 10001 run ids", "worker", RENEW,
             lambda w: ("w1", ["r1"] * 10_001, [w.lease.lease_id] * 10_001), "RL006"),
        Case("renew_leases arrays of two lengths", "worker", RENEW,
             lambda w: ("w1", ["r1", "r2"], [w.lease.lease_id]), "RL006"),
        # the idempotency key
        Case("dispatch_call key NULL", "worker", DISPATCH,
             lambda w: (*_lease(w), None), "RL006"),
        Case("dispatch_call key empty", "worker", DISPATCH,
             lambda w: (*_lease(w), ""), "RL006"),
        Case("dispatch_call key 301 chars", "worker", DISPATCH,
             lambda w: (*_lease(w), "x" * 301), "RL006"),
        Case("complete_call key empty", "worker", COMPLETE,
             lambda w: (*_lease(w), "", "succeeded", None, None), "RL006"),
        Case("complete_call key 2 MiB", "worker", COMPLETE,
             lambda w: (*_lease(w), big, "succeeded", None, None), "RL006"),
        Case("complete_call outcome 2 MiB", "worker", COMPLETE,
             lambda w: (*_lease(w), k, big, None, None), "RL006"),
        Case("complete_calls key empty", "worker", COMPLETE_CALLS,
             lambda w: (*_lease(w), "", "succeeded", None, None), "RL006"),
        Case("complete_calls key 2 MiB", "worker", COMPLETE_CALLS,
             lambda w: (*_lease(w), big, "succeeded", None, None), "RL006"),
        Case("complete_calls outcome 2 MiB", "worker", COMPLETE_CALLS,
             lambda w: (*_lease(w), k, big, None, None), "RL006"),
        Case("resolve_call key 301 chars", "operator", RESOLVE,
             lambda w: ("x" * 301, "applied", None, "alice", None), "RL006"),
        Case("resolve_call key NULL", "operator", RESOLVE,
             lambda w: (None, "applied", None, "alice", None), "RL006"),
        Case("resolve_call key empty", "operator", RESOLVE,
             lambda w: ("", "applied", None, "alice", None), "RL006"),
        # reasons
        Case("finish_run reason 1001 chars", "worker", FINISH,
             lambda w: (*_lease(w), "paused", None, "x" * 1001), "RL006"),
        Case("finish_run reason 2 MiB (issue 7)", "worker", FINISH,
             lambda w: (*_lease(w), "paused", None, big), "RL006"),
        Case("finish_run status 2 MiB", "worker", FINISH,
             lambda w: (*_lease(w), big, None, None), "RL006"),
        Case("release_lease reason NULL", "worker", RELEASE5,
             lambda w: (*_lease(w), None, None), "RL006"),
        Case("release_lease reason empty", "worker", RELEASE5,
             lambda w: (*_lease(w), "", None), "RL006"),
        Case("release_lease reason 201 chars", "worker", RELEASE5,
             lambda w: (*_lease(w), "x" * 201, None), "RL006"),
        Case("cancel_run reason 1001 chars", "operator", CANCEL,
             lambda w: ("q1", "alice", "x" * 1001), "RL006"),
        Case("cancel_run reason 2 MiB (issue 7)", "operator", CANCEL,
             lambda w: ("r1", "op", big), "RL006"),
        # actors and the note
        Case("cancel_run actor empty", "operator", CANCEL,
             lambda w: ("q1", "", None), "RL006"),
        Case("cancel_run actor 201 chars", "operator", CANCEL,
             lambda w: ("q1", "a" * 201, None), "RL006"),
        Case("cancel_run run id 10 kB", "operator", CANCEL,
             lambda w: ("r" * 10_000, "alice", None), "RL006"),
        Case("retry_run actor empty", "operator", RETRY,
             lambda w: ("f1", ""), "RL006"),
        Case("retry_run actor 201 chars", "operator", RETRY,
             lambda w: ("f1", "a" * 201), "RL006"),
        Case("retry_run run id NULL", "operator", RETRY,
             lambda w: (None, "alice"), "RL006"),
        Case("resolve_call actor NULL", "operator", RESOLVE,
             lambda w: (w.unknown_key, "applied", None, None, None), "RL006"),
        Case("resolve_call actor empty", "operator", RESOLVE,
             lambda w: (w.unknown_key, "applied", None, "", None), "RL006"),
        Case("resolve_call actor 201 chars", "operator", RESOLVE,
             lambda w: (w.unknown_key, "applied", None, "a" * 201, None), "RL006"),
        Case("resolve_call note 4001 chars", "operator", RESOLVE,
             lambda w: (w.unknown_key, "abandoned", None, "alice", "n" * 4001), "RL006"),
        Case("resolve_call note 2 MiB (issue 7)", "operator", RESOLVE,
             lambda w: (w.unknown_key, "abandoned", None, "alice", big), "RL006"),
        Case("resolve_call resolution 2 MiB", "operator", RESOLVE,
             lambda w: (w.unknown_key, big, None, "alice", None), "RL006"),
        # report_stale_write
        Case("report_stale_write run that does not exist", "worker", STALE,
             lambda w: ("no-such-run", "w1", "checkpoint", "lease lost"), "RL003"),
        Case("report_stale_write run id invalid", "worker", STALE,
             lambda w: ("bad run id", "w1", "checkpoint", "lease lost"), "RL006"),
        Case("report_stale_write run id NULL", "worker", STALE,
             lambda w: (None, "w1", "checkpoint", "lease lost"), "RL006"),
        Case("report_stale_write operation NULL", "worker", STALE,
             lambda w: ("r1", "w1", None, "lease lost"), "RL006"),
        Case("report_stale_write operation empty", "worker", STALE,
             lambda w: ("r1", "w1", "", "lease lost"), "RL006"),
        Case("report_stale_write operation 101 chars", "worker", STALE,
             lambda w: ("r1", "w1", "o" * 101, "lease lost"), "RL006"),
        Case("report_stale_write message 4001 chars", "worker", STALE,
             lambda w: ("r1", "w1", "checkpoint", "m" * 4001), "RL006"),
        Case("report_stale_write message 2 MiB", "worker", STALE,
             lambda w: ("r1", "w1", "checkpoint", big), "RL006"),
    ]  # fmt: skip


REFUSALS = [*json_cases(), *worker_id_cases(), *text_cases()]


def test_the_case_names_are_unique_and_every_class_is_there() -> None:
    names = [c.name for c in REFUSALS]
    assert len(names) == len(set(names))
    assert len(REFUSALS) >= 140, len(REFUSALS)  # reported in the closing note of issue 7
    assert {c.code for c in REFUSALS} == {"RL003", "RL006", "22021"}


@pytest.mark.parametrize("case", REFUSALS, ids=lambda c: c.name)
def test_hostile_input_is_refused_and_writes_nothing(
    case: Case, world: World, sessions: dict[str, Conn]
) -> None:
    conn = sessions[f"runledger_{case.role}"]
    with refused_untouched(sessions["admin"], case.code, case.name):
        conn.execute(case.sql, case.args(world))  # type: ignore[call-overload]


def test_the_depth_refusal_names_the_argument_and_the_limit(
    world: World, sessions: dict[str, Conn]
) -> None:
    w = sessions["runledger_worker"]
    with refused_untouched(sessions["admin"], "RL006", "state") as caught:
        w.execute(CHECKPOINT, (*_lease(world), Jsonb(nest(LIMIT + 1))))
    diag = caught.value.diag
    assert diag.message_primary == f"state nests deeper than {LIMIT} levels"
    assert diag.message_detail and "a scalar is depth 0" in diag.message_detail
    assert diag.message_hint == "the limit is runledger.settings.max_json_depth"
    calls = Jsonb([call(x=nest(LIMIT + 1))])
    with refused_untouched(sessions["admin"], "RL006", "calls") as caught:
        w.execute(RECORD_TURN, (*_lease(world), calls))
    assert caught.value.diag.message_primary == f"calls nests deeper than {LIMIT + 2} levels"


def test_a_text_refusal_names_the_argument_and_its_cap(
    world: World, sessions: dict[str, Conn]
) -> None:
    op = sessions["runledger_operator"]
    with refused_untouched(sessions["admin"], "RL006", "note") as caught:
        op.execute(RESOLVE, (world.unknown_key, "abandoned", None, "alice", "n" * 4001))
    assert caught.value.diag.message_primary == "note must be 0-4000 characters, got 4001"
    assert "Caps and limits" in (caught.value.diag.message_hint or "")


# -- the boundaries are accepted, and stored exactly ----------------------------------------------


@pytest.mark.parametrize("shape", SHAPES)
def test_json_at_the_limit_is_accepted_by_every_json_argument(
    shape: str, worker: Conn, operator: Conn, admin_conn: Conn
) -> None:
    obj, any_ = nest_object(LIMIT, shape), nest(LIMIT, shape)
    assert depth_of(obj) == depth_of(any_) == LIMIT
    submit(worker, "r1", obj)
    assert run_row(admin_conn, "r1")["input"] == obj
    lease = claim(worker, "w1", max_runs=1)[0]
    assert scalar(worker, CHECKPOINT, (*_lease_of(lease), Jsonb(obj))) == 1
    assert run_row(admin_conn, "r1")["state"] == obj
    # each call's args may nest as deep as any value; so may another member of a call
    record_turn(worker, lease, 0, [{"call_id": "c1", "tool": "t", "args": obj, "meta": any_}])
    assert call_row(admin_conn, "r1:0:c1")["args"] == obj
    worker.execute(DISPATCH, (*_lease_of(lease), "r1:0:c1"))
    complete(worker, lease, "r1:0:c1", "unknown", any_, obj)
    row = call_row(admin_conn, "r1:0:c1")
    assert (row["error"], row["receipt"]) == (any_, obj)
    finish(worker, lease, "paused", any_, reason="unknown")
    operator.execute(RESOLVE, ("r1:0:c1", "applied", Jsonb(obj), "alice", None))
    assert call_row(admin_conn, "r1:0:c1")["receipt"] == obj
    lease = claim(worker, "w1", max_runs=1)[0]
    worker.execute(RELEASE5, (*_lease_of(lease), "worker_error", Jsonb(obj)))
    [*_, released] = events(admin_conn, "r1", "lease_released")
    assert released["detail"]["error"] == obj


def _lease_of(lease: Lease) -> tuple[Any, ...]:
    return (lease.run_id, lease.lease_id, lease.token)


def test_finish_run_result_at_the_limit_is_stored(worker: Conn, admin_conn: Conn) -> None:
    lease = submit_and_claim(worker)
    value = nest(LIMIT, "mixed")
    finish(worker, lease, "succeeded", value)
    assert run_row(admin_conn, "r1")["result"] == value


def test_the_limit_is_the_settings_row(worker: Conn, admin_conn: Conn) -> None:
    admin_conn.execute("UPDATE runledger.settings SET max_json_depth = 5")
    submit(worker, "five", nest(5))
    with refused_untouched(admin_conn, "RL006", "six") as caught:
        submit(worker, "six", nest(6))
    assert caught.value.diag.message_primary == "input nests deeper than 5 levels"
    lease = claim(worker, "w1", max_runs=1)[0]
    record_turn(worker, lease, 0, [call(x=nest(4))])  # args of depth 5
    with refused_untouched(admin_conn, "RL006", "args of depth 6"):
        record_turn(worker, lease, 1, [call("c2", x=nest(5))])
    for bad in (0, 1001):
        with sqlstate("23514", bad):  # ck_settings_max_json_depth
            admin_conn.execute("UPDATE runledger.settings SET max_json_depth = %s", (bad,))


def test_text_at_its_cap_is_accepted_and_stored_whole(
    worker: Conn, operator: Conn, admin_conn: Conn
) -> None:
    wid = "w" * 200
    worker.execute(REGISTER, (wid, "h" * 255, [FLOW_REF]))
    worker.execute(HEARTBEAT, (wid, False))
    assert one(admin_conn, "SELECT hostname FROM runledger.workers WHERE worker_id = %s", (wid,))
    lease = submit_and_claim(worker, "r1", wid)
    assert [r["run_id"] for r in rows(worker, RENEW, (wid, ["r1"], [lease.lease_id]))] == ["r1"]
    k = dispatched_call(worker, lease)
    complete(worker, lease, k, "unknown", {"error": "timeout"})
    finish(worker, lease, "paused", None, reason="p" * 1000)
    assert run_row(admin_conn, "r1")["pause_reason"] == "p" * 1000
    operator.execute(RESOLVE, (k, "abandoned", None, "a" * 200, "n" * 4000))
    assert call_row(admin_conn, k)["resolution_note"] == "n" * 4000
    # str() of a refusal with its DETAIL and HINT fits the message cap whole
    message = "m" * 4000
    worker.execute(STALE, ("r1", wid, "o" * 100, message))
    [stale] = events(admin_conn, "r1", "stale_write_rejected")
    assert (stale["actor"], stale["detail"]["message"]) == (wid, message)
    assert stale["detail"]["operation"] == "o" * 100
    submit(worker, "q1")
    operator.execute(CANCEL, ("q1", "a" * 200, "c" * 1000))
    assert run_row(admin_conn, "q1")["error"] == {"reason": "cancelled", "note": "c" * 1000}
    [again] = claim(worker, wid, max_runs=1)
    finish(worker, again, "failed", None, reason="f" * 1000)
    operator.execute(RETRY, ("r1", None))  # NULL actor: the default 'operator'
    assert events(admin_conn, "r1", "run_requeued")[-1]["actor"] == "operator"


# -- a lease that expires while its write waits on the row lock ---------------------------------


WRITES: dict[str, Callable[[Conn, Lease, str], None]] = {
    "checkpoint": lambda c, lease, k: c.execute(CHECKPOINT, (*_lease_of(lease), Jsonb({"s": 1}))),
    "complete_call": lambda c, lease, k: complete(c, lease, k, "succeeded", {"ok": True}),
    "dispatch_call": lambda c, lease, k: c.execute(DISPATCH, (*_lease_of(lease), k)),
    "finish_run": lambda c, lease, k: finish(c, lease, "paused", None, reason="p"),
    "release_lease": lambda c, lease, k: c.execute(
        "SELECT runledger.release_lease(%s, %s, %s)", _lease_of(lease)
    ),
    "release_lease/5": lambda c, lease, k: c.execute(
        RELEASE5, (*_lease_of(lease), "worker_error", None)
    ),
}


@pytest.mark.parametrize("expires", [True, False], ids=["expires while waiting", "control"])
@pytest.mark.parametrize("write", sorted(WRITES))
def test_a_write_that_waited_on_the_row_lock_past_expiry_is_refused(
    write: str, expires: bool, connect: Connect, admin_conn: Conn
) -> None:
    worker = connect("runledger_worker")
    lease = submit_and_claim(worker, lease_seconds=30)
    k = dispatched_call(worker, lease)
    holder = connect("admin")
    pid = int(scalar(worker, "SELECT pg_backend_pid()"))
    with ThreadPoolExecutor(max_workers=1) as pool:
        holder.execute("BEGIN")
        holder.execute("SELECT 1 FROM runledger.runs WHERE run_id = 'r1' FOR NO KEY UPDATE")
        before = everything(admin_conn)
        blocked: Future[None] = pool.submit(WRITES[write], worker, lease, k)
        try:
            wait_until(
                "the write to wait on the row lock", lambda: waiting_on_a_lock(admin_conn, pid)
            )
            if expires:
                admin_conn.execute(
                    "UPDATE runledger.settings SET clock_offset = clock_offset + interval '31 s'"
                )
        finally:
            holder.execute("ROLLBACK")
        if not expires:
            blocked.result(timeout=30)
            assert everything(admin_conn) != before
            return
        with sqlstate("RL001", write) as caught:
            blocked.result(timeout=30)
    assert caught.value.diag.message_primary.startswith("lease expired on run r1")
    after = everything(admin_conn)
    for table in ALL_TABLES[:-1]:  # settings: the clock moved, as the test meant it to
        assert after[table] == before[table], f"runledger.{table} changed"


# -- one live session per worker id ------------------------------------------------------------


def _register(
    conn: Conn, worker_id: str = "dup", hostname: str = "host-a", pid: int = 4242
) -> None:
    conn.execute(
        "SELECT runledger.register_worker_v2(%s, %s, %s, %s::text[], false)",
        (worker_id, hostname, pid, [FLOW_REF]),
    )


def _backend_pid(conn: Conn) -> int:
    return int(scalar(conn, "SELECT pg_backend_pid()"))


def _gone(admin: Conn, pid: int) -> Callable[[], bool]:
    return lambda: one(admin, "SELECT 1 FROM pg_stat_activity WHERE pid = %s", (pid,)) is None


def _worker_row(admin: Conn, worker_id: str = "dup") -> dict[str, Any]:
    row = one(admin, "SELECT * FROM runledger.workers WHERE worker_id = %s", (worker_id,))
    assert row is not None
    return row


def test_a_second_live_session_is_refused_the_worker_id(connect: Connect, admin_conn: Conn) -> None:
    first, second = connect("runledger_worker"), connect("runledger_worker")
    _register(first, hostname="host-a", pid=4242)
    row = _worker_row(admin_conn)
    assert row["session_pid"] == _backend_pid(first)
    assert row["session_started_at"] == scalar(
        admin_conn,
        "SELECT backend_start FROM pg_stat_activity WHERE pid = %s",
        (row["session_pid"],),
    )
    with refused_untouched(admin_conn, "RL008", "second session") as caught:
        _register(second, hostname="host-b", pid=999)
    diag = caught.value.diag
    assert diag.message_primary == "worker id dup is in use by a live worker"
    assert diag.message_detail and "host host-a pid 4242 since" in diag.message_detail
    assert diag.message_hint and "--worker-id" in diag.message_hint
    # the holder's own session may register again (a reconnect of the same connection)
    _register(first, hostname="host-a", pid=4243)
    assert _worker_row(admin_conn)["pid"] == 4243


def test_the_id_is_taken_over_once_the_first_session_has_ended(
    connect: Connect, admin_conn: Conn, database_url: str
) -> None:
    first = psycopg.connect(database_url, autocommit=True, row_factory=dict_row)
    first.execute("SET ROLE runledger_worker")
    _register(first)
    pid = _backend_pid(first)
    second = connect("runledger_worker")
    with refused_untouched(admin_conn, "RL008", "while the first is open"):
        _register(second, hostname="host-b")
    first.close()
    wait_until("the first backend to exit", _gone(admin_conn, pid))
    _register(second, hostname="host-b", pid=77)
    row = _worker_row(admin_conn)
    assert (row["hostname"], row["pid"], row["session_pid"]) == ("host-b", 77, _backend_pid(second))


def test_the_id_is_taken_over_from_a_killed_worker_process(
    connect: Connect, admin_conn: Conn, database_url: str
) -> None:
    code = (
        "import sys, psycopg\n"
        "c = psycopg.connect(sys.argv[1], autocommit=True)\n"
        "c.execute('SET ROLE runledger_worker')\n"
        "c.execute(\"SELECT runledger.register_worker_v2('dup', 'host-k', 1,"
        " ARRAY['demo@1'], false)\")\n"
        "print(c.info.backend_pid, flush=True)\n"
        "sys.stdin.read()\n"
    )
    proc = subprocess.Popen(
        [sys.executable, "-c", code, database_url],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
    )
    try:
        assert proc.stdout is not None
        pid = int(proc.stdout.readline())
        second = connect("runledger_worker")
        with refused_untouched(admin_conn, "RL008", "while the process lives"):
            _register(second)
        os.kill(proc.pid, signal.SIGKILL)
        proc.wait(timeout=30)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait(timeout=30)
    wait_until("the killed worker's backend to exit", _gone(admin_conn, pid))
    _register(second, hostname="host-b")
    assert _worker_row(admin_conn)["session_pid"] == _backend_pid(second)


def test_the_id_is_taken_over_after_a_clean_stop(connect: Connect, admin_conn: Conn) -> None:
    first, second = connect("runledger_worker"), connect("runledger_worker")
    _register(first)
    first.execute(HEARTBEAT, ("dup", True))
    assert _worker_row(admin_conn)["stopped_at"] is not None
    _register(second, hostname="host-b")
    row = _worker_row(admin_conn)
    assert (row["hostname"], row["stopped_at"]) == ("host-b", None)
    # and now the first, still connected, is the one refused
    with refused_untouched(admin_conn, "RL008", "the stopped worker comes back"):
        _register(first)


def test_a_reused_pid_is_not_mistaken_for_the_registered_session(
    connect: Connect, admin_conn: Conn
) -> None:
    """The recorded session is (pid, backend_start): the same pid of a later backend is
    another session, so the id can be taken over."""
    first, second = connect("runledger_worker"), connect("runledger_worker")
    _register(first)
    admin_conn.execute(
        "UPDATE runledger.workers SET session_started_at = session_started_at - interval '1 h'"
    )
    _register(second, hostname="host-b")
    assert _worker_row(admin_conn)["session_pid"] == _backend_pid(second)


def test_a_worker_registered_before_0003_can_be_taken_over(
    connect: Connect, admin_conn: Conn
) -> None:
    _register(connect("runledger_worker"))
    admin_conn.execute("UPDATE runledger.workers SET session_pid = NULL, session_started_at = NULL")
    second = connect("runledger_worker")
    _register(second, hostname="host-b")
    assert _worker_row(admin_conn)["session_pid"] == _backend_pid(second)


def test_two_sessions_registering_a_new_id_at_once(connect: Connect, admin_conn: Conn) -> None:
    """The second waits on the first's uncommitted insert, then is judged against it."""
    first, second = connect("runledger_worker"), connect("runledger_worker")
    pid = _backend_pid(second)
    with ThreadPoolExecutor(max_workers=1) as pool:
        first.execute("BEGIN")
        _register(first)
        blocked = pool.submit(_register, second, "dup", "host-b")
        try:
            wait_until("the second register to wait", lambda: waiting_on_a_lock(admin_conn, pid))
        finally:
            first.execute("COMMIT")
        with sqlstate("RL008", "second at once"):
            blocked.result(timeout=30)
    row = _worker_row(admin_conn)
    assert (row["hostname"], row["session_pid"]) == ("host-a", _backend_pid(first))


def test_other_worker_ids_are_not_affected(connect: Connect, admin_conn: Conn) -> None:
    first, second = connect("runledger_worker"), connect("runledger_worker")
    _register(first, "w-a")
    _register(second, "w-b")
    assert {r["worker_id"] for r in rows(admin_conn, "SELECT * FROM runledger.workers")} == {
        "w-a",
        "w-b",
    }
