"""The reads both stores make: runs, calls, the journal, events, workers. All safe to
repeat, each one statement through :meth:`Executor.read`; the stores call them."""

from __future__ import annotations

import uuid
from dataclasses import dataclass
from typing import Any

from runledger import errors
from runledger.db.execution import Executor
from runledger.db.rows import Journal, call_from_row, journal_from, run_from_row
from runledger.db.validate import check_text
from runledger.model import RUN_ID_RE, Call, Event, Run


@dataclass(frozen=True, slots=True)
class Registration:
    """Who holds a worker id: the process that registered it (``hostname``, ``pid``),
    the backend pid of the database session it registered on, and whether that very
    session is still open as the id's listener (same backend start, same application
    name: not a later backend that reuses the pid)."""

    hostname: str
    pid: int
    session_pid: int | None
    session_open: bool
    # the process as its host names it (workers.process), the registering process's own
    # id, and, for a worker registered without a session of its own, how many seconds
    # until it has been silent long enough for its id to be free (None: it has a session,
    # or no silence was given)
    process: str | None = None
    incarnation: uuid.UUID | None = None
    free_in: float | None = None


async def get_run(ex: Executor, run_id: str) -> Run:
    check_text("run id", run_id)
    if not RUN_ID_RE.fullmatch(run_id):
        raise errors.InvalidInput(f"invalid run id {run_id[:200]!r}", run_id=None)
    rows = await ex.read(
        "SELECT * FROM runledger.runs WHERE run_id = %s", (run_id,), fields={"run_id": run_id}
    )
    if not rows:
        raise errors.RunNotFound(f"run {run_id} not found", run_id=run_id)
    return run_from_row(rows[0])


async def get_call(ex: Executor, idempotency_key: str) -> Call:
    check_text("idempotency key", idempotency_key)
    rows = await ex.read(
        "SELECT * FROM runledger.run_calls WHERE idempotency_key = %s", (idempotency_key,)
    )
    if not rows:
        raise errors.RunNotFound(f"call {idempotency_key} not found")
    return call_from_row(rows[0])


async def list_calls(ex: Executor, run_id: str) -> list[Call]:
    check_text("run id", run_id)
    rows = await ex.read(
        "SELECT * FROM runledger.run_calls WHERE run_id = %s ORDER BY turn, position",
        (run_id,),
    )
    return [call_from_row(r) for r in rows]


async def load_journal(ex: Executor, run_id: str) -> Journal:
    """The run's recorded turns (with each decision's record and output) and calls (with
    each call's provider id), and its stalled-claim count, in one round trip."""
    check_text("run id", run_id)
    rows = await ex.read(
        """SELECT r.stalled_claims,
                  (SELECT coalesce(json_agg(json_build_object('turn', t.turn, 'calls', t.calls,
                                                             'record', t.record,
                                                             'output', t.output)
                                            ORDER BY t.turn), '[]'::json)
                   FROM runledger.run_turns t WHERE t.run_id = r.run_id) AS turns,
                  (SELECT coalesce(json_agg(c ORDER BY c.turn, c.position), '[]'::json)
                   FROM runledger.run_calls c WHERE c.run_id = r.run_id) AS calls
           FROM runledger.runs r WHERE r.run_id = %s""",
        (run_id,),
        fields={"run_id": run_id},
    )
    if not rows:
        raise errors.RunNotFound(f"run {run_id} not found", run_id=run_id)
    row = rows[0]
    return journal_from(row["stalled_claims"], row["turns"], row["calls"])


async def list_turns(ex: Executor, run_id: str) -> list[tuple[int, list[dict[str, Any]]]]:
    check_text("run id", run_id)
    rows = await ex.read(
        "SELECT turn, calls FROM runledger.run_turns WHERE run_id = %s ORDER BY turn",
        (run_id,),
    )
    return [(int(r["turn"]), list(r["calls"])) for r in rows]


async def list_events(ex: Executor, run_id: str) -> list[Event]:
    check_text("run id", run_id)
    rows = await ex.read(
        "SELECT * FROM runledger.run_events WHERE run_id = %s ORDER BY event_id", (run_id,)
    )
    return [_event(r) for r in rows]


# what tells how a lease of the run was used and how it ended
LEASE_KINDS = [
    "claimed",
    "takeover",
    "call_dispatched",
    "send_released",
    "renewal_failed",
    "lease_released",
    "stale_write_rejected",
    "failover_detected",
]


async def last_claims(ex: Executor, run_id: str, claims: int, limit: int = 500) -> list[Event]:
    """The run's events of :data:`LEASE_KINDS` from its ``claims``-th last claim
    (``claimed`` or ``takeover``) on, oldest first; from its first event when it has
    fewer claims; the last ``limit`` of them."""
    check_text("run id", run_id)
    rows = await ex.read(
        "SELECT * FROM (SELECT e.* FROM runledger.run_events e"
        " WHERE e.run_id = %s AND e.kind = ANY (%s::text[])"
        " AND e.event_id >= coalesce((SELECT c.event_id FROM runledger.run_events c"
        "   WHERE c.run_id = %s AND c.kind IN ('claimed', 'takeover')"
        "   ORDER BY c.event_id DESC OFFSET %s LIMIT 1), 0)"
        " ORDER BY e.event_id DESC LIMIT %s) x ORDER BY x.event_id",
        (run_id, LEASE_KINDS, run_id, max(claims - 1, 0), limit),
        fields={"run_id": run_id},
    )
    return [_event(r) for r in rows]


def _event(r: dict[str, Any]) -> Event:
    return Event(
        event_id=r["event_id"],
        run_id=r["run_id"],
        at=r["at"],
        kind=r["kind"],
        actor=r["actor"],
        fencing_token=r["fencing_token"],
        state_version=r["state_version"],
        detail=r["detail"],
    )


async def worker_registration(ex: Executor, worker_id: str) -> Registration | None:
    """``worker_id``'s row in ``workers`` (None when it was never registered), with
    whether the session it was registered on is still open."""
    check_text("worker id", worker_id)
    rows = await ex.read(
        "SELECT w.hostname, w.pid, w.session_pid,"
        " EXISTS (SELECT 1 FROM pg_catalog.pg_stat_activity a"
        "         WHERE a.pid = w.session_pid AND a.backend_start = w.session_started_at"
        "           AND a.application_name = left('runledger-listener:' || w.worker_id, 63))"
        " AS session_open, w.process, w.incarnation,"
        " CASE WHEN w.session_pid IS NULL AND w.stopped_at IS NULL THEN"
        "   extract(epoch FROM w.heartbeat_at + w.silent_after - runledger.now())::float8"
        " END AS free_in"
        " FROM runledger.workers w WHERE w.worker_id = %s",
        (worker_id,),
    )
    return Registration(**rows[0]) if rows else None


async def known_flows(ex: Executor) -> set[str]:
    """Every ``name@version`` a worker ever registered."""
    rows = await ex.read("SELECT DISTINCT unnest(flows) AS flow FROM runledger.workers", ())
    return {r["flow"] for r in rows}
