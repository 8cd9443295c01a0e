"""Checkpoints of the event chains (revision 0016, docs/audit.md), for
``runledger checkpoint``; workers make theirs through :meth:`Store.checkpoint_events`."""

from __future__ import annotations

import datetime as dt
import time
from typing import Any

import psycopg
from psycopg.rows import dict_row

from runledger.db.connecting import connect_error, connect_timeout_param
from runledger.db.inspect import driver_error

PATIENCE = 5.0  # s: how long a checkpoint on demand keeps trying for the table lock


def checkpoint_now(url: str, actor: str, *, connect_timeout: float | None = None) -> dict[str, Any]:
    """A checkpoint now, whatever the age of the last one. ``checkpoint_events`` gives up
    on its table lock after its lock_timeout when event writers hold the table; this
    tries again for up to :data:`PATIENCE` s. The newest checkpoint, ``created`` false
    when no event came since the last one (or the lock never came)."""
    kwargs: dict[str, Any] = {"application_name": "runledger-checkpoint"}
    if connect_timeout is not None:
        kwargs["connect_timeout"] = connect_timeout_param(connect_timeout)
    try:
        conn = psycopg.connect(url, autocommit=True, row_factory=dict_row, **kwargs)
    except (psycopg.Error, OSError) as exc:
        raise connect_error(exc, url, connect_timeout) from None
    try:
        return _checkpoint(conn, actor)
    except psycopg.Error as exc:
        raise driver_error(exc, "the checkpoint", CHECKPOINT_GRANTS, conn) from None
    finally:
        conn.close()


CHECKPOINT_GRANTS = "checkpoint_events is granted to runledger_worker, and so to runledger_operator"


def _checkpoint(conn: psycopg.Connection[Any], actor: str) -> dict[str, Any]:
    deadline = time.monotonic() + PATIENCE
    while True:
        row = conn.execute(
            "SELECT * FROM runledger.checkpoint_events(%s, %s)", (actor, dt.timedelta(0))
        ).fetchone()
        assert row is not None
        if row["created"] or time.monotonic() >= deadline:
            return dict(row)
        newer = conn.execute(
            "SELECT EXISTS (SELECT 1 FROM runledger.run_events e WHERE e.event_id > %s) AS newer",
            (row["through_event_id"],),
        ).fetchone()
        if newer is None or not newer["newer"]:
            return dict(row)
        time.sleep(0.1)
