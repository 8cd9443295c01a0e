"""The operator's reads: runs, one run whole, workers, calls waiting for a person.

Read-only queries for ``runledger list | show | workers | unknown``
(:mod:`runledger.cli.reads`; the event log of ``runledger events`` is
:mod:`runledger.db.event_log`), on one synchronous connection in a read-only session.
Every time is judged by the database clock (``runledger.now()``, read once per query),
never the local one. Each function returns plain JSON-able dicts: the ``--json`` shapes
that docs/operating.md documents.

Liveness, one rule for ``show`` and ``workers``: a worker heartbeats every third of its
lease (with each renewal). It is

- ``stopped`` when its row has ``stopped_at`` (it drained and said so);
- ``silent`` when not stopped and its last heartbeat is ``silent_after`` seconds old or
  older (the CLI's default: the lease length, i.e. three missed heartbeats, after which
  no lease it held can still be live);
- ``alive`` otherwise.
"""

from __future__ import annotations

import datetime as dt
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

import psycopg
from psycopg.rows import dict_row
from psycopg.types.json import set_json_loads

from runledger import errors
from runledger.config import connection_settings
from runledger.db.decode import Undecodable, safe_loads
from runledger.db.pooler import read_only_session
from runledger.db.validate import check_text
from runledger.model import RUN_ID_RE

Row = dict[str, Any]

MAX_LIMIT = 10_000
TIMELINE_LIMIT = 200  # events of one run that ``show`` returns (the newest)
NO_LIVE_WORKER = "lease expired, no live worker"


@dataclass(frozen=True, slots=True, kw_only=True)
class Since:
    """A lower bound in time: ``ago`` before the database's now, or an absolute ``at``."""

    ago: dt.timedelta | None = None
    at: dt.datetime | None = None


@contextmanager
def read_connection(url: str, connect_timeout: float | None) -> Iterator[psycopg.Connection[Row]]:
    """A read-only autocommit connection that decodes JSON safely (never prepared:
    each query is planned with its own parameters, so ``%s IS NULL`` folds away).

    A driver error inside the block leaves it as a one-line runledger error: a lost
    connection is :class:`~runledger.errors.DatabaseUnavailable`, a refusal with a
    runledger SQLSTATE its own exception, anything else (a missing privilege) a
    :class:`~runledger.errors.RunLedgerError` that names what the commands need."""
    from runledger.db.connecting import connect_error, connect_timeout_param

    kwargs: dict[str, Any] = {"application_name": "runledger-cli"}
    if connect_timeout is not None:
        kwargs["connect_timeout"] = connect_timeout_param(connect_timeout)
    try:
        conn = psycopg.connect(url, autocommit=True, row_factory=dict_row, **kwargs)
    except (psycopg.Error, OSError) as exc:
        raise connect_error(exc, url, connect_timeout) from None
    try:
        conn.prepare_threshold = None
        # a read of several statements in conn.transaction() sees one snapshot
        conn.isolation_level = psycopg.IsolationLevel.REPEATABLE_READ
        set_json_loads(safe_loads, conn)
        # read-only, except on a transaction pooler's session (it would stay read-only for
        # the pooler's next client there: a worker)
        read_only_session(conn, url, connection_settings().pooler)
        yield conn
    except psycopg.Error as exc:
        raise driver_error(exc, "the read", READ_GRANTS) from None
    finally:
        conn.close()


def driver_error(
    exc: psycopg.Error,
    what: str,
    grants: str,
    conn: psycopg.Connection[Any] | None = None,
) -> errors.RunLedgerError:
    """A driver error as the one-line runledger error a command prints: a lost
    connection, a refusal with its runledger SQLSTATE (a standby's refusal of a write,
    told apart on ``conn``), or ``what`` refused (``grants`` as the hint for a missing
    privilege); its SQLSTATE is named."""
    from runledger.db.sqlstate import is_connection_error, map_error

    if is_connection_error(exc):
        return errors.DatabaseUnavailable(
            f"lost the connection to the database during {what}: {_first_line(exc)}"
        )
    mapped = map_error(exc, conn=conn)
    if mapped is not None:
        return mapped
    hint = grants if exc.sqlstate == "42501" else None
    code = f" (SQLSTATE {exc.sqlstate})" if exc.sqlstate else ""
    return errors.RunLedgerError(
        f"the database refused {what}: {_first_line(exc)}{code}", hint=hint
    )


READ_GRANTS = (
    "the read commands need SELECT on the runledger tables and views and EXECUTE on "
    "runledger.now(); runledger_operator has both"
)


def _first_line(exc: BaseException) -> str:
    lines = [line.strip() for line in str(exc).splitlines() if line.strip()]
    return lines[0] if lines else type(exc).__name__


def plain(value: Any) -> Any:
    if isinstance(value, Undecodable):
        return str(value)
    if isinstance(value, dt.datetime):
        return value.isoformat()
    if isinstance(value, dt.timedelta):
        return value.total_seconds()
    if isinstance(value, dict):
        return {k: plain(v) for k, v in value.items()}
    if isinstance(value, list):
        return [plain(v) for v in value]
    return value


def db_now(conn: psycopg.Connection[Row]) -> dt.datetime:
    row = conn.execute("SELECT runledger.now() AS now").fetchone()
    assert row is not None
    now: dt.datetime = row["now"]
    return now


def since_at(conn: psycopg.Connection[Row], since: Since | None) -> dt.datetime | None:
    if since is None:
        return None
    if since.at is not None:
        return since.at
    assert since.ago is not None
    row = conn.execute("SELECT runledger.now() - %s::interval AS at", (since.ago,)).fetchone()
    assert row is not None
    at: dt.datetime = row["at"]
    return at


def check_run_id(run_id: str) -> None:
    check_text("run id", run_id)
    if not RUN_ID_RE.fullmatch(run_id):
        raise errors.InvalidInput(f"invalid run id {run_id[:200]!r}", run_id=None)


# -- list -------------------------------------------------------------------------------

# A running run's lease as the operator reads it: NULL (not running), 'live', 'expired,
# holder alive' (it is fenced at its next write), or NO_LIVE_WORKER. %(silent_after)s.
_LEASE_STATE = """
CASE WHEN l.status <> 'running' THEN NULL
     WHEN l.lease_expires_at > clock.now THEN 'live'
     WHEN w.stopped_at IS NULL AND w.heartbeat_at > clock.now - %(silent_after)s::interval
          THEN 'expired, holder alive'
     ELSE 'lease expired, no live worker' END
"""

# Newest first: ix_runs_created_at (revision 0012) read backwards, or, with a rare
# --status, ix_runs_status (docs/operating.md, "Cost"). The holders are looked up for the
# `limit` rows only.
_LIST = (
    """
WITH clock AS (SELECT runledger.now() AS now)
SELECT l.*, extract(epoch FROM l.lease_expires_at - clock.now)::float8 AS expires_in_seconds,
       """
    + _LEASE_STATE
    + """ AS lease_state,
       coalesce(c.unknown_calls, 0)::int AS unknown_calls,
       coalesce(c.awaiting_approval, 0)::int AS awaiting_approval
FROM (
    SELECT run_id, flow, flow_version, status, priority, claims, fencing_token,
           state_version, lease_owner, lease_expires_at, pause_reason,
           created_at, updated_at, finished_at
    FROM runledger.runs
    WHERE (%(statuses)s::text[] IS NULL OR status = ANY(%(statuses)s::text[]))
      AND (%(flow)s::text IS NULL OR flow = %(flow)s::text)
      AND (%(version)s::text IS NULL OR flow_version = %(version)s::text)
      AND (%(since)s::timestamptz IS NULL OR created_at >= %(since)s::timestamptz)
      -- a page after the last one shown (the console's "older"): the same index, from there
      AND (%(before_at)s::timestamptz IS NULL
           OR (created_at, run_id) < (%(before_at)s::timestamptz, %(before_id)s::text))
    ORDER BY created_at DESC, run_id DESC
    LIMIT %(limit)s
) l CROSS JOIN clock
LEFT JOIN runledger.workers w ON w.worker_id = l.lease_owner AND l.status = 'running'
-- the listed runs' calls only, by the primary key; a finished call is never waiting
LEFT JOIN LATERAL (
    SELECT count(*) FILTER (WHERE x.status = 'unknown') AS unknown_calls,
           count(*) FILTER (WHERE x.approval = 'pending' AND x.status = 'planned')
               AS awaiting_approval
    FROM runledger.run_calls x
    WHERE x.run_id = l.run_id AND l.status IN ('running', 'paused', 'cancelled', 'failed')
) c ON true
ORDER BY l.created_at DESC, l.run_id DESC
"""
)


def list_runs(
    conn: psycopg.Connection[Row],
    *,
    statuses: Sequence[str] = (),
    flow: str | None = None,
    since: Since | None = None,
    limit: int = 50,
    silent_after: float = 30.0,
    before: tuple[dt.datetime, str] | None = None,
) -> Row:
    """``{"now", "runs": [...]}``, newest first; ``flow`` is ``name`` or ``name@version``.

    ``before``: a ``(created_at, run_id)`` of a run listed earlier; only the runs after it
    in this order (the next page, read from the same index)."""
    name, _, version = (flow or "").partition("@")
    if before is not None:
        check_run_id(before[1])
    now = db_now(conn)
    rows = conn.execute(
        _LIST,
        {
            "statuses": list(statuses) or None,
            "flow": name or None,
            "version": version or None,
            "since": since_at(conn, since),
            "before_at": None if before is None else before[0],
            "before_id": None if before is None else before[1],
            "limit": max(1, min(limit, MAX_LIMIT)),
            "silent_after": dt.timedelta(seconds=silent_after),
        },
    ).fetchall()
    return {
        "now": plain(now),
        "silent_after_seconds": silent_after,
        "runs": [plain(r) for r in rows],
    }


# -- workers ----------------------------------------------------------------------------

_WORKERS = """
WITH clock AS (SELECT runledger.now() AS now),
held AS (
    SELECT r.lease_owner, count(*) AS runs_held
    FROM runledger.runs r, clock
    WHERE r.status = 'running' AND r.lease_expires_at > clock.now
    GROUP BY r.lease_owner
)
SELECT w.worker_id, w.hostname, w.pid, w.flows, w.started_at, w.heartbeat_at, w.stopped_at,
       CASE WHEN w.stopped_at IS NOT NULL THEN 'stopped'
            WHEN w.heartbeat_at <= clock.now - %(silent_after)s::interval THEN 'silent'
            ELSE 'alive' END AS liveness,
       extract(epoch FROM clock.now - w.heartbeat_at)::float8 AS heartbeat_age_seconds,
       coalesce(h.runs_held, 0)::int AS runs_held,
       extract(epoch FROM w.clock_offset)::float8 AS clock_offset_seconds
FROM runledger.workers w CROSS JOIN clock
LEFT JOIN held h ON h.lease_owner = w.worker_id
"""


def workers(
    conn: psycopg.Connection[Row],
    *,
    silent_after: float,
    liveness: Sequence[str] = (),
    limit: int = 50,
) -> Row:
    """``{"now", "silent_after_seconds", "workers": [...]}``: alive first, then silent,
    then stopped; within each, the latest heartbeat first."""
    now = db_now(conn)
    rows = conn.execute(
        "SELECT * FROM ("
        + _WORKERS
        + """) w
        WHERE %(liveness)s::text[] IS NULL OR liveness = ANY(%(liveness)s::text[])
        ORDER BY array_position(ARRAY['alive', 'silent', 'stopped'], liveness),
                 heartbeat_at DESC, worker_id
        LIMIT %(limit)s""",
        {
            "silent_after": dt.timedelta(seconds=silent_after),
            "liveness": list(liveness) or None,
            "limit": max(1, min(limit, MAX_LIMIT)),
        },
    ).fetchall()
    return {
        "now": plain(now),
        "silent_after_seconds": silent_after,
        "workers": [plain(r) for r in rows],
    }


# -- show -------------------------------------------------------------------------------

_RUN = """
SELECT r.*, runledger.now() AS now,
       extract(epoch FROM r.lease_expires_at - runledger.now())::float8 AS expires_in_seconds
FROM runledger.runs r WHERE r.run_id = %s
"""

_HOLDER = "SELECT * FROM (" + _WORKERS + ") w WHERE worker_id = %(worker_id)s"

_TURNS = (
    "SELECT turn, fencing_token, created_at FROM runledger.run_turns "
    "WHERE run_id = %s ORDER BY turn"
)
_TURNS_WITH_RECORDS = (
    "SELECT turn, fencing_token, created_at, record, output FROM runledger.run_turns "
    "WHERE run_id = %s ORDER BY turn"
)

_CALLS = """
SELECT turn, call_id, idempotency_key, tool, status, approval, attempts, args, result,
       receipt, error, dispatched_by, dispatched_token, dispatched_at, completed_by,
       completed_token, completed_at, resolved_by, resolved_at, resolution_note,
       approval_by, approval_note
FROM runledger.run_calls WHERE run_id = %s ORDER BY turn, position
"""

_TIMELINE = """
SELECT * FROM (
    SELECT event_id, at, kind, actor, fencing_token, state_version, detail
    FROM runledger.run_timeline WHERE run_id = %s ORDER BY event_id DESC LIMIT %s
) e ORDER BY event_id
"""


def lease_verdict(lease: Row) -> str:
    """The lease state ``list`` shows too: ``live``, ``expired, holder alive`` (it is
    fenced at its next write; any worker of the flow may take the run over), or
    :data:`NO_LIVE_WORKER` (the holder stopped, is silent, or has no workers row)."""
    holder = lease.get("holder")
    if not lease["expired"]:
        return "live"
    if holder is not None and holder["liveness"] == "alive":
        return "expired, holder alive"
    return NO_LIVE_WORKER


def show_run(
    conn: psycopg.Connection[Row], run_id: str, *, silent_after: float, records: bool = False
) -> Row:
    """The run, its lease (with the holder's liveness), its turns with their calls, and
    its newest :data:`TIMELINE_LIMIT` events (oldest first), from one snapshot. With
    ``records``, each turn also has its decision ``record`` and ``output`` (the console's
    run page; ``show --json`` leaves them out)."""
    check_run_id(run_id)
    with conn.transaction():  # repeatable read: the run, its calls and events agree
        return _show_run(conn, run_id, silent_after=silent_after, records=records)


def _show_run(
    conn: psycopg.Connection[Row], run_id: str, *, silent_after: float, records: bool
) -> Row:
    row = conn.execute(_RUN, (run_id,)).fetchone()
    if row is None:
        raise errors.RunNotFound(f"run {run_id} not found", run_id=run_id)
    now = row.pop("now")
    expires_in = row.pop("expires_in_seconds")
    lease: Row | None = None
    if row["lease_id"] is not None:
        holder = conn.execute(
            _HOLDER,
            {"silent_after": dt.timedelta(seconds=silent_after), "worker_id": row["lease_owner"]},
        ).fetchone()
        lease = {
            "owner": row["lease_owner"],
            "lease_id": str(row["lease_id"]),
            "fencing_token": row["fencing_token"],
            "expires_at": row["lease_expires_at"],
            "expires_in_seconds": expires_in,
            "expired": expires_in <= 0,
            "holder": holder,
        }
        lease["verdict"] = lease_verdict(lease)
    turns = conn.execute(
        _TURNS_WITH_RECORDS if records else _TURNS,
        (run_id,),
    ).fetchall()
    by_turn: dict[int, list[Row]] = {t["turn"]: [] for t in turns}
    for c in conn.execute(_CALLS, (run_id,)).fetchall():
        by_turn.setdefault(c["turn"], []).append(c)
    events = conn.execute(_TIMELINE, (run_id, TIMELINE_LIMIT + 1)).fetchall()
    truncated = len(events) > TIMELINE_LIMIT
    run = {k: v for k, v in row.items() if k not in ("lease_id",)}
    run["lease_id"] = None if row["lease_id"] is None else str(row["lease_id"])
    shown: Row = plain(
        {
            "now": now,
            "silent_after_seconds": silent_after,
            "run": run,
            "lease": lease,
            "turns": [{**t, "calls": by_turn.get(t["turn"], [])} for t in turns],
            "timeline": events[1:] if truncated else events,
            "timeline_truncated": truncated,
        }
    )
    return shown


# -- unknown ----------------------------------------------------------------------------

# From runs by status (ix_runs_status), then each run's calls by the primary key: there is
# no index on run_calls.status (docs/design.md, run_calls). A call waits for a person when
# it is unknown, or awaits approval (pending, never sent).
_WAITING = """
SELECT r.run_id, r.status AS run_status, r.flow, r.flow_version, r.fencing_token AS run_token,
       r.lease_owner, r.pause_reason,
       c.idempotency_key, c.turn, c.call_id, c.tool, c.status, c.approval, c.attempts,
       c.dispatched_by, c.dispatched_token, c.dispatched_at, c.completed_by,
       c.completed_token, c.completed_at, c.error,
       CASE WHEN c.status = 'unknown' THEN 'unknown' ELSE 'approval' END AS waits_for
FROM runledger.runs r
-- OFFSET 0 keeps the subquery a per-run probe of pk_run_calls: flattened into a join, the
-- planner may read every call of every run instead
CROSS JOIN LATERAL (
    SELECT * FROM runledger.run_calls x
    WHERE x.run_id = r.run_id
      AND (x.status = 'unknown' OR (x.approval = 'pending' AND x.status = 'planned'))
    OFFSET 0
) c
WHERE r.status = ANY(%(run_statuses)s::text[])
ORDER BY coalesce(c.dispatched_at, r.updated_at), c.idempotency_key
LIMIT %(limit)s
"""

WAITING_RUN_STATUSES = ("paused", "running")
FINISHED_RUN_STATUSES = ("cancelled", "failed")


def waiting_calls(
    conn: psycopg.Connection[Row], *, include_finished: bool = False, limit: int = 1000
) -> Row:
    """``{"now", "calls": [...]}``: every call of a paused or running run (and, with
    ``include_finished``, of a cancelled or failed one) that is unknown or awaits
    approval, oldest first."""
    statuses = WAITING_RUN_STATUSES + (FINISHED_RUN_STATUSES if include_finished else ())
    now = db_now(conn)
    rows = conn.execute(
        _WAITING, {"run_statuses": list(statuses), "limit": max(1, min(limit, MAX_LIMIT))}
    ).fetchall()
    return {"now": plain(now), "calls": [plain(r) for r in rows]}
