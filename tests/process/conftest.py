from __future__ import annotations

from typing import Any

import psycopg
import pytest

from runledger.testing import wait_for

LEASE = 5.0


def run_row(conn: psycopg.Connection[Any], run_id: str) -> dict[str, Any]:
    cur = conn.execute(
        "SELECT status, fencing_token, lease_owner, pause_reason, claims FROM runledger.runs "
        "WHERE run_id = %s",
        (run_id,),
    )
    row = cur.fetchone()
    assert row is not None, f"no run {run_id}"
    return dict(zip([d.name for d in cur.description or []], row, strict=True))


def call_rows(conn: psycopg.Connection[Any], run_id: str) -> list[dict[str, Any]]:
    cur = conn.execute(
        "SELECT idempotency_key, tool, status, attempts, result, receipt, error, "
        "dispatched_token, completed_token, completed_by FROM runledger.run_calls "
        "WHERE run_id = %s ORDER BY turn, position",
        (run_id,),
    )
    names = [d.name for d in cur.description or []]
    return [dict(zip(names, r, strict=True)) for r in cur.fetchall()]


def events(
    conn: psycopg.Connection[Any], run_id: str, kind: str | None = None
) -> list[dict[str, Any]]:
    cur = conn.execute(
        "SELECT kind, actor, fencing_token, detail FROM runledger.run_events "
        "WHERE run_id = %s AND (%s::text IS NULL OR kind = %s) ORDER BY event_id",
        (run_id, kind, kind),
    )
    names = [d.name for d in cur.description or []]
    return [dict(zip(names, r, strict=True)) for r in cur.fetchall()]


def submit(
    conn: psycopg.Connection[Any],
    run_id: str,
    plan: list[list[dict[str, Any]]],
    flow: str = "scripted",
) -> None:
    from psycopg.types.json import Jsonb

    conn.execute(
        "SELECT * FROM runledger.submit_run(%s, %s, '1', %s)", (run_id, flow, Jsonb({"plan": plan}))
    )


def wait_status(
    conn: psycopg.Connection[Any], run_id: str, statuses: tuple[str, ...], timeout: float = 30.0
) -> dict[str, Any]:
    return wait_for(
        lambda: (r := run_row(conn, run_id))["status"] in statuses and r,
        timeout=timeout,
        what=f"run {run_id} in {statuses}",
    )


@pytest.fixture
def lease_args() -> list[str]:
    return ["--lease-seconds", str(LEASE)]
