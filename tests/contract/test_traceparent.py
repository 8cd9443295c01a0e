"""submit_run_v2 and claim_runs_v4 (revision 0017): the submitter's W3C trace context is
stored on the run, refused when malformed (RL006, nothing written), kept on resubmission,
and returned with the claim; submit_run stores none."""

from __future__ import annotations

import datetime as dt
from typing import Any

import psycopg
import pytest
from psycopg.types.json import Jsonb

from .helpers import FLOW_REF, one, refused, rows, run_row, sqlstate, submit, unchanged

Conn = psycopg.Connection[Any]

TP = "00-0af7651916cd43dd8448eb211c80319c-b7ad6b7169203331-01"
SUBMIT_V2 = "SELECT * FROM runledger.submit_run_v2(%s, 'demo', '1', %s, 0, NULL, %s)"
CLAIM_V4 = "SELECT * FROM runledger.claim_runs_v4('w1', %s::text[], %s, 10)"


def submit_v2(conn: Conn, run_id: str, traceparent: str | None, input: Any = None) -> Any:
    row = one(conn, SUBMIT_V2, (run_id, Jsonb(input or {"n": 1}), traceparent))
    assert row is not None
    return (row["run_id"], row["created"])


def test_submit_run_v2_stores_the_traceparent_and_claim_runs_v4_returns_it(
    worker: Conn, admin_conn: Conn
) -> None:
    assert submit_v2(worker, "t1", TP) == ("t1", True)
    assert submit_v2(worker, "t2", None) == ("t2", True)
    submit(worker, "t3")  # submit_run: no trace context
    assert run_row(admin_conn, "t1")["traceparent"] == TP
    assert run_row(admin_conn, "t2")["traceparent"] is None
    assert run_row(admin_conn, "t3")["traceparent"] is None
    [ev] = rows(admin_conn, "SELECT kind FROM runledger.run_events WHERE run_id = 't1'")
    assert ev["kind"] == "submitted"

    claimed = rows(worker, CLAIM_V4, ([FLOW_REF], dt.timedelta(seconds=30)))
    assert {r["run_id"]: r["traceparent"] for r in claimed} == {"t1": TP, "t2": None, "t3": None}
    # everything else as claim_runs_v3 returns it
    first = next(r for r in claimed if r["run_id"] == "t1")
    assert (first["fencing_token"], first["takeover"], first["stalled_claims"]) == (1, False, 1)
    assert (first["turns"], first["calls"], first["failover_turn"]) == ([], [], None)


def test_a_resubmission_keeps_the_first_traceparent(worker: Conn, admin_conn: Conn) -> None:
    submit_v2(worker, "t1", TP)
    other = "00-11111111111111111111111111111111-2222222222222222-00"
    with unchanged(admin_conn):
        assert submit_v2(worker, "t1", other) == ("t1", False)
        assert submit_v2(worker, "t1", None) == ("t1", False)
        assert submit(worker, "t1") == ("t1", False)
    assert run_row(admin_conn, "t1")["traceparent"] == TP
    # the identity of a run is still checked first
    with refused(admin_conn, "RL005"):
        submit_v2(worker, "t1", TP, {"other": 1})


MALFORMED = {
    "version 01": "01-0af7651916cd43dd8448eb211c80319c-b7ad6b7169203331-01",
    "version ff": "ff-0af7651916cd43dd8448eb211c80319c-b7ad6b7169203331-01",
    "uppercase": "00-0AF7651916CD43DD8448EB211C80319C-B7AD6B7169203331-01",
    "short trace id": "00-0af7651916cd43dd8448eb211c8031-b7ad6b7169203331-01",
    "long parent id": "00-0af7651916cd43dd8448eb211c80319c-b7ad6b716920333100-01",
    "one-digit flags": "00-0af7651916cd43dd8448eb211c80319c-b7ad6b7169203331-1",
    "zero trace id": "00-00000000000000000000000000000000-b7ad6b7169203331-01",
    "zero parent id": "00-0af7651916cd43dd8448eb211c80319c-0000000000000000-01",
    "trailing data": TP + "-extra",
    "trailing newline": TP + "\n",
    "empty": "",
    "not hex": "00-0af7651916cd43dd8448eb211c80319z-b7ad6b7169203331-01",
    "2 MiB": "0" * 2_097_152,
}


@pytest.mark.parametrize("value", list(MALFORMED.values()), ids=list(MALFORMED))
def test_a_malformed_traceparent_is_refused_and_nothing_is_written(
    value: str, worker: Conn, admin_conn: Conn
) -> None:
    with refused(admin_conn, "RL006", value[:40]) as caught:
        submit_v2(worker, "t1", value)
    diag = caught.value.diag
    assert (diag.message_primary or "").startswith("invalid traceparent")
    assert len(diag.message_primary or "") < 200  # the value is cut, not echoed whole
    assert "W3C traceparent" in (diag.message_detail or "")


def test_the_table_refuses_a_malformed_traceparent_written_past_the_functions(
    admin_conn: Conn, worker: Conn
) -> None:
    """ck_runs_traceparent: the second wall, for the owner's own writes."""
    submit_v2(worker, "t1", TP)
    with sqlstate("23514"):
        admin_conn.execute("UPDATE runledger.runs SET traceparent = 'x' WHERE run_id = 't1'")
    assert run_row(admin_conn, "t1")["traceparent"] == TP


def test_submit_run_v2_is_the_operators_too(operator: Conn, admin_conn: Conn) -> None:
    assert submit_v2(operator, "t9", TP) == ("t9", True)
    assert run_row(admin_conn, "t9")["traceparent"] == TP
