"""The reads of a worker's health endpoints (``runledger worker --http-port``).

Each is one cheap statement on a pool connection, sent at scrape time, never on the
worker's hot path:

- :func:`queue_depth`: queued and running runs per ``name@version`` the worker serves,
  through ``ix_runs_claimable`` (a partial index on exactly those two statuses);
- :func:`takeover_holder`: why a run this worker took over could be taken (``expired``
  or ``session_ended``), from its ``takeover`` event (one row, by ``ix_run_events_run_id``);
- :func:`schema_revision`: the revision in ``runledger.alembic_version``, or, for a role
  that may not read it (``runledger_worker`` is granted only what a worker needs), None.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import psycopg
from psycopg.rows import tuple_row

from runledger.model import parse_flow_ref

QUEUE_STATUSES = ("queued", "running")


async def queue_depth(
    conn: psycopg.AsyncConnection[Any], flows: Sequence[str]
) -> dict[tuple[str, str], int]:
    """``{(flow ref, status): runs}`` for every flow in ``flows`` and both statuses (0 where
    there are none)."""
    pairs = [parse_flow_ref(f) for f in flows]
    cur = conn.cursor(row_factory=tuple_row)
    await cur.execute(
        "SELECT r.flow, r.flow_version, r.status, count(*) AS n FROM runledger.runs r "
        "JOIN unnest(%s::text[], %s::text[]) AS f(name, version) "
        "ON r.flow = f.name AND r.flow_version = f.version "
        "WHERE r.status IN ('queued', 'running') GROUP BY 1, 2, 3",
        ([n for n, _ in pairs], [v for _, v in pairs]),
    )
    found = {(f, s): 0 for f in flows for s in QUEUE_STATUSES}
    for name, version, status, n in await cur.fetchall():
        found[(f"{name}@{version}", status)] = int(n)
    return found


async def takeover_holder(
    conn: psycopg.AsyncConnection[Any], run_id: str, fencing_token: int
) -> str | None:
    """``detail.holder`` of the ``takeover`` event that granted ``fencing_token``."""
    cur = conn.cursor(row_factory=tuple_row)
    await cur.execute(
        "SELECT detail->>'holder' FROM runledger.run_events "
        "WHERE run_id = %s AND kind = 'takeover' AND fencing_token = %s "
        "ORDER BY event_id DESC LIMIT 1",
        (run_id, fencing_token),
    )
    row = await cur.fetchone()
    return None if row is None or row[0] is None else str(row[0])


async def schema_revision(conn: psycopg.AsyncConnection[Any]) -> str | None:
    """The schema's revision; None if this role may not read it (raises if it is absent:
    ``UndefinedTable``)."""
    cur = conn.cursor(row_factory=tuple_row)
    await cur.execute(
        "SELECT has_table_privilege('runledger.alembic_version', 'SELECT') AS readable"
    )
    row = await cur.fetchone()
    if row is None or not row[0]:
        return None
    await cur.execute("SELECT version_num FROM runledger.alembic_version")
    found = await cur.fetchone()
    return str(found[0]) if found else ""
