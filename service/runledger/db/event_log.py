"""The event log for ``runledger events``: the newest events that match, and a follower
that polls for new ones without losing those committed out of order. Read-only, on a
connection of :func:`runledger.db.inspect.read_connection`.

And where new events are announced: at commit, each one an operator watches is NOTIFYed
on :data:`EVENTS_CHANNEL` as ``'<event_id> <run_id> <kind>'`` (revision 0015; the console
listens, :func:`listen_for_events`).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import psycopg

from runledger.db.inspect import MAX_LIMIT, Row, Since, check_run_id, plain, since_at

_EVENTS = """
SELECT * FROM (
    SELECT run_id, event_id, at, kind, actor, fencing_token, state_version, detail
    FROM runledger.run_timeline
    WHERE (%(run_id)s::text IS NULL OR run_id = %(run_id)s::text)
      AND (%(kinds)s::text[] IS NULL OR kind = ANY(%(kinds)s::text[]))
      AND (%(since)s::timestamptz IS NULL OR at >= %(since)s::timestamptz)
      AND (%(until)s::bigint IS NULL OR event_id <= %(until)s::bigint)
    ORDER BY event_id DESC
    LIMIT %(limit)s
) e ORDER BY event_id
"""

EVENTS_CHANNEL = "runledger_events"


async def listen_for_events(conn: psycopg.AsyncConnection[Any]) -> None:
    """LISTEN on ``conn`` (an autocommit session of the caller's) for :data:`EVENTS_CHANNEL`."""
    await conn.execute("LISTEN " + EVENTS_CHANNEL)


def events(
    conn: psycopg.Connection[Row],
    *,
    run_id: str | None = None,
    kinds: Sequence[str] = (),
    since: Since | None = None,
    limit: int = 50,
    until: int | None = None,
) -> list[Row]:
    """The newest ``limit`` events matching (with ids up to ``until``), oldest first."""
    if run_id is not None:
        check_run_id(run_id)
    rows = conn.execute(
        _EVENTS,
        {
            "run_id": run_id,
            "kinds": list(kinds) or None,
            "since": since_at(conn, since),
            "until": until,
            "limit": max(1, min(limit, MAX_LIMIT)),
        },
    ).fetchall()
    return [plain(r) for r in rows]


# Every committed id after the watermark (the primary key only), and the gaps rechecked.
_FOLLOW_IDS = """
SELECT event_id FROM runledger.run_events
WHERE event_id > %(after)s OR event_id = ANY(%(gaps)s::bigint[])
ORDER BY event_id LIMIT %(limit)s
"""

_FOLLOW = """
SELECT run_id, event_id, at, kind, actor, fencing_token, state_version, detail
FROM runledger.run_timeline
WHERE ((event_id > %(after)s AND event_id <= %(top)s) OR event_id = ANY(%(gaps)s::bigint[]))
  AND (%(run_id)s::text IS NULL OR run_id = %(run_id)s::text)
  AND (%(kinds)s::text[] IS NULL OR kind = ANY(%(kinds)s::text[]))
ORDER BY event_id
"""


class EventFollower:
    """The events committed since the last poll, none lost to out-of-order commits.

    Event ids come from a sequence: a transaction that took id 10 may commit after one
    that took id 11. An id below the newest one seen that is not (yet) committed is a
    gap, asked for again on each of the next ``recheck_polls`` polls (a rolled-back
    transaction leaves its id unused for good)."""

    def __init__(
        self,
        conn: psycopg.Connection[Row],
        *,
        after: int,
        run_id: str | None = None,
        kinds: Sequence[str] = (),
        recheck_polls: int = 20,
        batch: int = 5000,
    ) -> None:
        self.conn = conn
        self.after = after
        self.run_id = run_id
        self.kinds = list(kinds) or None
        self.recheck_polls = recheck_polls
        self.batch = batch
        self.gaps: dict[int, int] = {}  # event id -> polls left

    def poll(self) -> list[Row]:
        with self.conn.transaction():  # one snapshot for the ids and the rows
            return self._poll()

    def _poll(self) -> list[Row]:
        gaps = list(self.gaps)
        ids = [
            r["event_id"]
            for r in self.conn.execute(
                _FOLLOW_IDS, {"after": self.after, "gaps": gaps, "limit": self.batch}
            ).fetchall()
        ]
        fresh = [i for i in ids if i > self.after]
        top = fresh[-1] if fresh else self.after
        rows = self.conn.execute(
            _FOLLOW,
            {
                "after": self.after,
                "top": top,
                "gaps": gaps,
                "run_id": self.run_id,
                "kinds": self.kinds,
            },
        ).fetchall()
        committed = set(ids) | {r["event_id"] for r in rows}
        for event_id in gaps:
            self.gaps[event_id] -= 1
            if event_id in committed or self.gaps[event_id] <= 0:
                del self.gaps[event_id]
        fresh_set = set(fresh)
        for event_id in range(self.after + 1, top):
            if event_id not in fresh_set and event_id not in committed:
                self.gaps[event_id] = self.recheck_polls
        self.after = top
        return [plain(r) for r in rows]


def last_event_id(conn: psycopg.Connection[Row]) -> int:
    row = conn.execute(
        "SELECT coalesce(max(event_id), 0) AS last FROM runledger.run_events"
    ).fetchone()
    assert row is not None
    last: int = row["last"]
    return last
