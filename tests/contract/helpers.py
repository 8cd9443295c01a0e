"""Small helpers for the contract tests: call the SQL functions as a worker would.

Every helper takes a psycopg connection (dict rows, autocommit) and calls one
contract function with bound parameters, exactly as a client in any language would.
"""

from __future__ import annotations

import contextlib
import datetime as dt
import time
import uuid
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from typing import Any

import psycopg
import pytest
from psycopg.rows import dict_row
from psycopg.types.json import Jsonb

FLOW = "demo"
VERSION = "1"
FLOW_REF = f"{FLOW}@{VERSION}"
LEASE_SECONDS = 30

Conn = psycopg.Connection[Any]
Row = dict[str, Any]


@dataclass(frozen=True, slots=True)
class Lease:
    """What claim_runs_v4 handed to one worker for one run."""

    run_id: str
    lease_id: uuid.UUID
    token: int
    state_version: int
    takeover: bool
    lease_expires_at: dt.datetime
    worker_id: str


# -- assertions -----------------------------------------------------------------------


class Caught:
    """The driver error caught by :func:`sqlstate` (``.value``), like pytest's ExceptionInfo."""

    value: psycopg.Error


@contextlib.contextmanager
def sqlstate(code: str, case: object = "") -> Iterator[Caught]:
    """Expect a driver error with exactly this SQLSTATE; ``case`` labels a failure."""
    caught = Caught()
    label = f"[{case!r}] " if case != "" else ""
    try:
        yield caught
    except psycopg.Error as exc:
        caught.value = exc
        assert exc.sqlstate == code, f"{label}expected SQLSTATE {code}, got {exc.sqlstate}: {exc}"
    else:
        pytest.fail(f"{label}expected SQLSTATE {code}, but the statement was accepted")


TABLES = ("runs", "run_turns", "run_calls", "run_events", "workers")


def snapshot(admin: Conn) -> dict[str, list[Row]]:
    """Every row of every runledger table, in a stable order."""
    out: dict[str, list[Row]] = {}
    with admin.cursor(row_factory=dict_row) as cur:
        for table in TABLES:
            cur.execute(f"SELECT * FROM runledger.{table} ORDER BY 1, 2")  # type: ignore[arg-type]
            out[table] = cur.fetchall()
    return out


@contextlib.contextmanager
def unchanged(admin: Conn, case: object = "") -> Iterator[None]:
    """Assert that nothing in any runledger table changed inside the block."""
    before = snapshot(admin)
    yield
    after = snapshot(admin)
    label = f"[{case!r}] " if case != "" else ""
    for table in TABLES:
        assert after[table] == before[table], f"{label}runledger.{table} changed"


@contextlib.contextmanager
def refused(admin: Conn, code: str, case: object = "") -> Iterator[Caught]:
    """Expect SQLSTATE ``code`` and no change at all in the runledger tables."""
    with unchanged(admin, case), sqlstate(code, case) as caught:
        yield caught


# -- reads ----------------------------------------------------------------------------


def one(conn: Conn, sql: str, params: Sequence[Any] = ()) -> Row | None:
    with conn.cursor(row_factory=dict_row) as cur:
        cur.execute(sql, params)  # type: ignore[arg-type]
        return cur.fetchone()


def rows(conn: Conn, sql: str, params: Sequence[Any] = ()) -> list[Row]:
    with conn.cursor(row_factory=dict_row) as cur:
        cur.execute(sql, params)  # type: ignore[arg-type]
        return cur.fetchall()


def scalar(conn: Conn, sql: str, params: Sequence[Any] = ()) -> Any:
    row = conn.execute(sql, params).fetchone()  # type: ignore[arg-type]
    assert row is not None
    return row[0] if isinstance(row, tuple) else next(iter(row.values()))


def run_row(conn: Conn, run_id: str) -> Row:
    row = one(conn, "SELECT * FROM runledger.runs WHERE run_id = %s", (run_id,))
    assert row is not None, f"run {run_id} not found"
    return row


def call_row(conn: Conn, key: str) -> Row:
    row = one(conn, "SELECT * FROM runledger.run_calls WHERE idempotency_key = %s", (key,))
    assert row is not None, f"call {key} not found"
    return row


def events(conn: Conn, run_id: str, kind: str | None = None) -> list[Row]:
    found = rows(
        conn, "SELECT * FROM runledger.run_events WHERE run_id = %s ORDER BY event_id", (run_id,)
    )
    return [e for e in found if kind is None or e["kind"] == kind]


def chain_links(conn: Conn, run_id: str) -> list[bool]:
    """Per event of the run, in order: is its hash _event_hash over its run's previous
    event's hash and its own columns (the chain of revision 0016)?"""
    found = rows(
        conn,
        "SELECT e.hash = runledger._event_hash(lag(e.hash) OVER w, e.event_id, e.run_id, e.at,"
        " e.kind, e.actor, e.fencing_token, e.state_version, e.detail) AS ok"
        " FROM runledger.run_events e WHERE e.run_id = %s WINDOW w AS (ORDER BY e.event_id)",
        (run_id,),
    )
    return [bool(r["ok"]) for r in found]


def wait_until(what: str, predicate: Callable[[], bool], timeout: float = 30.0) -> None:
    """Poll ``predicate`` until it holds; fail after ``timeout`` seconds."""
    deadline = time.monotonic() + timeout
    while not predicate():
        if time.monotonic() > deadline:
            pytest.fail(f"timed out waiting for {what}")
        time.sleep(0.01)


def waiting_on_a_lock(admin: Conn, pid: int) -> bool:
    row = one(admin, "SELECT wait_event_type FROM pg_stat_activity WHERE pid = %s", (pid,))
    return row is not None and row["wait_event_type"] == "Lock"


def count(conn: Conn, table: str) -> int:
    return int(scalar(conn, f"SELECT count(*) FROM runledger.{table}"))


# -- worker side ----------------------------------------------------------------------


def submit(
    conn: Conn,
    run_id: str,
    input: Any = None,
    *,
    flow: str = FLOW,
    version: str = VERSION,
    priority: int = 0,
    available_at: dt.datetime | None = None,
) -> tuple[str, bool]:
    payload = Jsonb({"n": 1} if input is None else input)
    row = one(
        conn,
        "SELECT * FROM runledger.submit_run(%s, %s, %s, %s, %s, %s)",
        (run_id, flow, version, payload, priority, available_at),
    )
    assert row is not None
    return row["run_id"], row["created"]


def claim(
    conn: Conn,
    worker_id: str = "w1",
    flows: Sequence[str] = (FLOW_REF,),
    *,
    lease_seconds: float = LEASE_SECONDS,
    max_runs: int = 10,
) -> list[Lease]:
    found = rows(
        conn,
        "SELECT * FROM runledger.claim_runs_v4(%s, %s::text[], %s, %s)",
        (worker_id, list(flows), dt.timedelta(seconds=lease_seconds), max_runs),
    )
    return [
        Lease(
            run_id=r["run_id"],
            lease_id=r["lease_id"],
            token=r["fencing_token"],
            state_version=r["state_version"],
            takeover=r["takeover"],
            lease_expires_at=r["lease_expires_at"],
            worker_id=worker_id,
        )
        for r in found
    ]


def submit_and_claim(
    conn: Conn,
    run_id: str = "r1",
    worker_id: str = "w1",
    *,
    input: Any = None,
    lease_seconds: float = LEASE_SECONDS,
) -> Lease:
    submit(conn, run_id, input)
    got = claim(conn, worker_id, lease_seconds=lease_seconds, max_runs=1)
    assert [c.run_id for c in got] == [run_id]
    return got[0]


def checkpoint(conn: Conn, lease: Lease, expected: int, state: Any) -> int:
    return int(
        scalar(
            conn,
            "SELECT runledger.checkpoint(%s, %s, %s, %s, %s)",
            (lease.run_id, lease.lease_id, lease.token, expected, Jsonb(state)),
        )
    )


def call(call_id: str = "c1", tool: str = "create_ticket", **args: Any) -> dict[str, Any]:
    return {"call_id": call_id, "tool": tool, "args": args}


def key(run_id: str, turn: int, call_id: str) -> str:
    return f"{run_id}:{turn}:{call_id}"


def record_turn(conn: Conn, lease: Lease, turn: int, calls: Any) -> None:
    """A decision alone: no record, output, checkpoint, finish or dispatch."""
    record_v2(conn, lease, turn, calls)


def dispatch(conn: Conn, lease: Lease, idempotency_key: str) -> int:
    return int(
        scalar(
            conn,
            "SELECT runledger.dispatch_call(%s, %s, %s, %s)",
            (lease.run_id, lease.lease_id, lease.token, idempotency_key),
        )
    )


def complete(
    conn: Conn,
    lease: Lease,
    idempotency_key: str,
    outcome: str = "succeeded",
    result: Any = None,
    receipt: Any = None,
) -> None:
    conn.execute(
        "SELECT runledger.complete_call(%s, %s, %s, %s, %s, %s, %s)",
        (
            lease.run_id,
            lease.lease_id,
            lease.token,
            idempotency_key,
            outcome,
            None if result is None else Jsonb(result),
            None if receipt is None else Jsonb(receipt),
        ),
    )


def finish(
    conn: Conn,
    lease: Lease,
    status: str = "succeeded",
    result: Any = None,
    reason: str | None = None,
) -> None:
    conn.execute(
        "SELECT runledger.finish_run(%s, %s, %s, %s, %s, %s)",
        (
            lease.run_id,
            lease.lease_id,
            lease.token,
            status,
            None if result is None else Jsonb(result),
            reason,
        ),
    )


def release(conn: Conn, lease: Lease) -> None:
    conn.execute(
        "SELECT runledger.release_lease(%s, %s, %s)", (lease.run_id, lease.lease_id, lease.token)
    )


def renew(
    conn: Conn, worker_id: str, leases: Sequence[Lease], *, lease_seconds: float = LEASE_SECONDS
) -> list[Row]:
    return rows(
        conn,
        "SELECT * FROM runledger.renew_leases(%s, %s::text[], %s::uuid[], %s)",
        (
            worker_id,
            [x.run_id for x in leases],
            [x.lease_id for x in leases],
            dt.timedelta(seconds=lease_seconds),
        ),
    )


def report_stale_write(
    conn: Conn, lease: Lease, operation: str, message: str = "lease lost"
) -> None:
    conn.execute(
        "SELECT runledger.report_stale_write(%s, %s, %s, %s, %s, %s)",
        (lease.run_id, lease.worker_id, lease.lease_id, lease.token, operation, message),
    )


def plan_call(conn: Conn, lease: Lease, turn: int = 0, call_id: str = "c1") -> str:
    """Record a one-call turn; return the call's idempotency key."""
    record_turn(conn, lease, turn, [call(call_id)])
    return key(lease.run_id, turn, call_id)


def dispatched_call(conn: Conn, lease: Lease, turn: int = 0, call_id: str = "c1") -> str:
    k = plan_call(conn, lease, turn, call_id)
    assert dispatch(conn, lease, k) == 1
    return k


# -- operator side --------------------------------------------------------------------


def resolve(
    conn: Conn,
    idempotency_key: str,
    resolution: str,
    receipt: Any = None,
    actor: str = "alice",
    note: str | None = None,
) -> None:
    conn.execute(
        "SELECT runledger.resolve_call(%s, %s, %s, %s, %s)",
        (idempotency_key, resolution, None if receipt is None else Jsonb(receipt), actor, note),
    )


def cancel(conn: Conn, run_id: str, actor: str = "alice", reason: str | None = None) -> None:
    conn.execute("SELECT runledger.cancel_run(%s, %s, %s)", (run_id, actor, reason))


def retry(conn: Conn, run_id: str, actor: str = "alice") -> None:
    conn.execute("SELECT runledger.retry_run(%s, %s)", (run_id, actor))


def set_payload_cap(admin: Conn, cap: int) -> None:
    admin.execute("UPDATE runledger.settings SET max_payload_bytes = %s", (cap,))


def paused_on_unknown(conn: Conn, lease: Lease, call_ids: Sequence[str] = ("c1",)) -> list[str]:
    """Record turn 0 with these calls, dispatch them, report each unknown, pause the run."""
    record_turn(conn, lease, 0, [call(c) for c in call_ids])
    keys = [key(lease.run_id, 0, c) for c in call_ids]
    for k in keys:
        dispatch(conn, lease, k)
        complete(conn, lease, k, "unknown", {"error": "timeout"})
    finish(conn, lease, "paused", reason="unknown outcome")
    return keys


# -- approvals ------------------------------------------------------------------------


def record_v2(
    conn: Conn, lease: Lease, turn: int, calls: Any, record: Any = None, output: Any = None
) -> None:
    """A decision with the model's record and output (record_turn_v4 without its
    checkpoint, finish or dispatch)."""
    conn.execute(
        "SELECT runledger.record_turn_v4(%s, %s, %s, %s, %s, %s, %s, NULL, NULL, false, NULL)",
        (
            lease.run_id,
            lease.lease_id,
            lease.token,
            turn,
            Jsonb(calls),
            None if record is None else Jsonb(record),
            None if output is None else Jsonb(output),
        ),
    )


def approve(
    conn: Conn, idempotency_key: str, actor: str | None = "alice", note: str | None = None
) -> None:
    conn.execute("SELECT runledger.approve_call(%s, %s, %s)", (idempotency_key, actor, note))


def deny(
    conn: Conn, idempotency_key: str, reason: str | None = "too risky", actor: str | None = "alice"
) -> None:
    conn.execute("SELECT runledger.deny_call(%s, %s, %s)", (idempotency_key, actor, reason))


def paused_awaiting_approval(
    conn: Conn, lease: Lease, call_ids: Sequence[str] = ("c1",), turn: int = 0
) -> list[str]:
    """Record ``turn`` with these calls, each needing approval, and pause the run."""
    record_v2(conn, lease, turn, [{**call(c), "approval": True} for c in call_ids])
    finish(conn, lease, "paused", reason="awaits approval")
    return [key(lease.run_id, turn, c) for c in call_ids]
