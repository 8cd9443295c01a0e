"""Tracing across real worker processes (``runledger worker --otel-file``): a worker
SIGKILLed at a named crash point and the one that takes the run over write their spans
into one trace; a worker without ``--otel`` never imports OpenTelemetry."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from runledger.testing import wait_for
from runledger.tracecontext import derived
from tests.process.conftest import LEASE, call_rows, run_row, submit, wait_status

pytestmark = pytest.mark.process


def _spans(path: Path) -> list[dict[str, Any]]:
    if not path.exists():
        return []
    return [json.loads(line) for line in path.read_text().splitlines() if line]


def test_a_run_taken_over_after_a_sigkill_continues_its_trace(
    workers: Any,
    provider: Any,
    admin_conn: Any,
    db_clock: Any,
    lease_args: list[str],
    tmp_path: Path,
) -> None:
    out = tmp_path / "spans.jsonl"
    args = [*lease_args, "--otel-file", str(out)]
    plan = [
        [{"tool": "ticket", "args": {"title": "a"}}],
        [{"tool": "ticket", "args": {"title": "b"}}],
    ]
    submit(admin_conn, "traced-kill", plan)
    # killed once turn 1 is recorded: turn 0 and its call are over, turn 1's call is not sent
    (first,) = workers.start(1, env={"RUNLEDGER_CRASH_AT": "after_record_turn:1"}, args=args)
    assert workers.wait(first, timeout=30) == -9, workers.log(first)
    assert run_row(admin_conn, "traced-kill")["fencing_token"] == 1
    db_clock.advance(LEASE + 1)
    (second,) = workers.start(1, args=args)
    wait_status(admin_conn, "traced-kill", ("succeeded",))
    spans = wait_for(
        lambda: (s := _spans(out)) and any(x["name"] == "run scripted" for x in s) and s,
        what="the second worker's run span",
    )

    trace_id, parent_id, _ = derived("traced-kill")
    assert {s["trace_id"] for s in spans} == {f"{trace_id:032x}"}
    by_pid: dict[int, list[dict[str, Any]]] = {}
    for s in spans:
        by_pid.setdefault(s["pid"], []).append(s)
    assert len(by_pid) == 2, sorted((s["pid"], s["name"]) for s in spans)
    killed, taker = sorted(
        by_pid.values(), key=lambda x: any(s["name"] == "run scripted" for s in x)
    )
    # the killed worker: what it ended before the kill (its run span and turn 1 never end)
    assert sorted(s["name"] for s in killed) == ["call ticket", "turn 0"]
    [call0] = [s for s in killed if s["name"] == "call ticket"]
    assert call0["attributes"]["runledger.idempotency_key"] == "traced-kill:0:c0"
    assert call0["attributes"]["runledger.outcome"] == "succeeded"
    # the worker that took over: a run span under the same parent, with the new token
    names = sorted(s["name"] for s in taker)
    assert names == ["call ticket", "run scripted", "turn 1", "turn 2"], names
    [root] = [s for s in taker if s["name"] == "run scripted"]
    assert root["parent_span_id"] == f"{parent_id:016x}"
    assert root["attributes"]["runledger.takeover"] is True
    assert root["attributes"]["runledger.fencing_token"] == 2
    assert root["attributes"]["runledger.worker_id"] == workers.worker_id(second)
    assert root["attributes"]["runledger.status"] == "succeeded"
    [turn1] = [s for s in taker if s["name"] == "turn 1"]
    assert turn1["attributes"]["runledger.resumed"] is True
    assert turn1["parent_span_id"] == root["span_id"]
    [call1] = [s for s in taker if s["name"] == "call ticket"]
    assert call1["parent_span_id"] == turn1["span_id"]
    assert call1["attributes"]["runledger.idempotency_key"] == "traced-kill:1:c0"
    assert len(provider.client.effects("traced-kill:0:c0")) == 1


def test_a_worker_without_otel_never_imports_opentelemetry(
    workers: Any, admin_conn: Any, tmp_path: Path
) -> None:
    """The probe's call lists the OpenTelemetry modules of the worker process: none
    without --otel (nothing of runledger imports it), the SDK's with it."""
    from psycopg.types.json import Jsonb

    workers.flows = ["tests.process.otel_flows:probe"]
    out = tmp_path / "spans.jsonl"
    for run_id in ("plain", "traced"):
        admin_conn.execute(
            "SELECT * FROM runledger.submit_run(%s, 'probe', '1', %s)", (run_id, Jsonb({}))
        )
        (i,) = workers.start(1, args=["--otel-file", str(out)] if run_id == "traced" else [])
        wait_status(admin_conn, run_id, ("succeeded",))
        workers.terminate(i)
        assert workers.wait(i) == 0
    [plain] = call_rows(admin_conn, "plain")
    assert plain["result"] == {"otel": []}
    [traced] = call_rows(admin_conn, "traced")
    assert "opentelemetry.sdk.trace" in traced["result"]["otel"]
    assert "call modules" in {s["name"] for s in _spans(out)}
