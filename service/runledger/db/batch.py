"""A batch of runs named by one id prefix (``{prefix}-*``), on a synchronous autocommit
connection of the caller's: submit one run, count those settled, see who holds one, and
read what an audit of the batch compares with the provider's record.

``runledger demo`` (:mod:`runledger.demo.run`, :mod:`runledger.demo.report`) is the user:
its runs are one batch, submitted and watched from one connection while workers run
them. Each read is its own statement (autocommit: no shared snapshot).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, NamedTuple

import psycopg
from psycopg.types.json import Jsonb

Conn = psycopg.Connection[Any]


def _like(prefix: str) -> str:
    return f"{prefix}-%"


def submit(
    conn: Conn,
    run_id: str,
    flow: str,
    version: str,
    payload: dict[str, Any],
    priority: int,
) -> None:
    """Submit ``run_id`` of ``flow@version`` with ``payload`` as its input."""
    conn.execute(
        "SELECT * FROM runledger.submit_run(%s, %s, %s, %s, %s)",
        (run_id, flow, version, Jsonb(payload), priority),
    )


def settled(conn: Conn, prefix: str) -> int:
    """How many runs of the batch are succeeded, paused, failed or cancelled."""
    row = conn.execute(
        "SELECT count(*) FROM runledger.runs WHERE run_id LIKE %s "
        "AND status IN ('succeeded', 'paused', 'failed', 'cancelled')",
        (_like(prefix),),
    ).fetchone()
    return int(row[0]) if row is not None else 0


def status_and_owner(conn: Conn, run_id: str) -> tuple[str, Any] | None:
    """``(status, lease_owner)`` of ``run_id`` (the owner None when no lease is held);
    None when there is no such run."""
    row = conn.execute(
        "SELECT status, lease_owner FROM runledger.runs WHERE run_id = %s", (run_id,)
    ).fetchone()
    return (str(row[0]), row[1]) if row else None


class BatchCall(NamedTuple):
    """One call of a run of the batch, as the journal has it."""

    run_id: Any
    tool: Any
    idempotency_key: Any
    status: Any
    attempts: Any
    has_receipt: Any  # a lookup found its effect (it was not sent again)
    args: Any


@dataclass(frozen=True, slots=True, kw_only=True)
class BatchRecord:
    """What the journal says of a batch."""

    statuses: dict[str, int]  # runs per status
    takeovers: int  # ``takeover`` events
    calls: list[BatchCall]  # by run, turn, position
    paused: list[str]  # the paused runs, by id
    failed: dict[str, Any]  # run id -> error, of runs neither succeeded nor paused
    sample: tuple[str, Any] | None  # the first succeeded run (by id) and its result


def read_batch(conn: Conn, prefix: str) -> BatchRecord:
    """The journal's record of the batch ``prefix``."""
    like = _like(prefix)
    statuses = {
        str(s): int(n)
        for s, n in conn.execute(
            "SELECT status, count(*) FROM runledger.runs WHERE run_id LIKE %s GROUP BY 1",
            (like,),
        ).fetchall()
    }
    row = conn.execute(
        "SELECT count(*) FROM runledger.run_events WHERE run_id LIKE %s AND kind = 'takeover'",
        (like,),
    ).fetchone()
    takeovers = int(row[0]) if row else 0
    calls = [
        BatchCall(*c)
        for c in conn.execute(
            "SELECT run_id, tool, idempotency_key, status, attempts, receipt IS NOT NULL, args "
            "FROM runledger.run_calls WHERE run_id LIKE %s ORDER BY run_id, turn, position",
            (like,),
        ).fetchall()
    ]
    paused = [
        str(r)
        for (r,) in conn.execute(
            "SELECT run_id FROM runledger.runs WHERE run_id LIKE %s AND status = 'paused' "
            "ORDER BY run_id",
            (like,),
        ).fetchall()
    ]
    failed: dict[str, Any] = dict(
        conn.execute(
            "SELECT run_id, error FROM runledger.runs WHERE run_id LIKE %s "
            "AND status NOT IN ('succeeded', 'paused') ORDER BY run_id",
            (like,),
        ).fetchall()
    )
    sample = conn.execute(
        "SELECT run_id, result FROM runledger.runs WHERE run_id LIKE %s "
        "AND status = 'succeeded' ORDER BY run_id LIMIT 1",
        (like,),
    ).fetchone()
    return BatchRecord(
        statuses=statuses,
        takeovers=takeovers,
        calls=calls,
        paused=paused,
        failed=failed,
        sample=(str(sample[0]), sample[1]) if sample else None,
    )
