"""docs/audit.md: every check `runledger audit` runs is documented there, and its five
queries run as printed, as the auditor role, and answer what they say they answer."""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

import psycopg
from psycopg.rows import dict_row

from runledger.audit import ANCHOR_CHECK, CHECKS
from runledger.testing import DbClock
from tests.contract.helpers import (
    LEASE_SECONDS,
    claim,
    complete,
    dispatch,
    dispatched_call,
    finish,
    report_stale_write,
    resolve,
    submit_and_claim,
)

DOC = Path(__file__).resolve().parents[2] / "docs" / "audit.md"


def _queries() -> list[str]:
    return re.findall(r"```sql\n(.*?)```", DOC.read_text(encoding="utf-8"), re.S)


def test_every_check_is_documented() -> None:
    text = DOC.read_text(encoding="utf-8")
    for check in (*CHECKS, ANCHOR_CHECK):
        assert f"| `{check.name}` |" in text, check.name


def test_the_five_queries_answer_as_the_auditor(
    admin_conn: psycopg.Connection[Any], database_url: str, db_clock: DbClock
) -> None:
    queries = _queries()
    assert len(queries) == 5
    with psycopg.connect(database_url, autocommit=True, row_factory=dict_row) as w:
        w.execute("SET ROLE runledger_worker")
        first = submit_and_claim(w, "ticket-77", "w1")
        key = dispatched_call(w, first)
        db_clock.advance(LEASE_SECONDS + 1)  # w1's lease expires; w2 takes the run over
        (second,) = claim(w, "w2", max_runs=1)
        assert second.takeover
        report_stale_write(w, first, "complete_call")
        assert dispatch(w, second, key) == 2  # sent again under the same key
        complete(w, second, key, "unknown", None, None)
        finish(w, second, "paused", None, reason="a call is unknown")
    admin_conn.execute("SET ROLE runledger_operator")
    resolve(admin_conn, key, "applied", {"ticket": "T-77"}, actor="alice", note="seen in CRM")
    admin_conn.execute("RESET ROLE")
    admin_conn.execute("SELECT * FROM runledger.checkpoint_events('test', interval '0')")
    with psycopg.connect(database_url, autocommit=True, row_factory=dict_row) as a:
        a.execute("SET ROLE runledger_auditor")
        twice, leases, stale, decided, chain = (a.execute(q).fetchall() for q in queries)  # type: ignore[call-overload]
    assert [(r["idempotency_key"], r["attempts"]) for r in twice] == [(key, 2)]
    assert [r["kind"] for r in leases][:2] == ["claimed", "takeover"]
    assert leases[1]["previous_owner"] == "w1" and leases[1]["worker_id"] == "w2"
    assert [(r["stale_worker"], r["operation"]) for r in stale] == [("w1", "complete_call")]
    assert stale[0]["stale_token"] < stale[0]["current_token"]
    assert [(r["kind"], r["actor"], r["idempotency_key"]) for r in decided][:2] == [
        ("run_requeued", "alice", None),
        ("call_resolved", "alice", key),
    ]
    assert decided[1]["status"] == "succeeded" and decided[1]["resolution_note"] == "seen in CRM"
    assert chain and all(r["link_ok"] for r in chain)
    assert chain[-1]["checkpointed_as_head_by"] == 1
