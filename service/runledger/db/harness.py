"""What the test harness (:mod:`runledger.testing`) reads and writes, on a synchronous
connection of its own: the database clock's offset (the owner's row that tests move to
expire leases, docs/design.md "Time") and who holds a run."""

from __future__ import annotations

import datetime as dt
from typing import Any

import psycopg

Conn = psycopg.Connection[Any]


def _first(conn: Conn, sql: Any, params: tuple[Any, ...] = ()) -> Any:
    cur = conn.execute(sql, params)
    row = cur.fetchone()
    if row is None:
        return None
    return next(iter(row.values())) if isinstance(row, dict) else row[0]


def clock_offset(conn: Conn) -> dt.timedelta:
    """How far the database clock (``runledger.now()``) is moved from the server's."""
    offset: dt.timedelta = _first(conn, "SELECT clock_offset FROM runledger.settings")
    return offset


def advance_clock(conn: Conn, seconds: float) -> None:
    """Move the database clock ``seconds`` forward (an owner's write)."""
    conn.execute(
        "UPDATE runledger.settings SET clock_offset = clock_offset + %s",
        (dt.timedelta(seconds=seconds),),
    )


def database_now(conn: Conn) -> dt.datetime:
    """``runledger.now()``: the time every lease and deadline is judged by."""
    now: dt.datetime = _first(conn, "SELECT runledger.now()")
    return now


def running_holder(conn: Conn, run_id: str) -> str | None:
    """The worker id whose lease a running run is under (None: not running)."""
    owner = _first(
        conn,
        "SELECT lease_owner FROM runledger.runs WHERE run_id = %s AND status = 'running'",
        (run_id,),
    )
    return None if owner is None else str(owner)
