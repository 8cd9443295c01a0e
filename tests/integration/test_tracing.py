"""The spans of a run (runledger.worker.tracing), from an in-process worker, caught by the
SDK's in-memory exporter: the tree, its attributes and statuses, the submitter's trace
continued, and the trace ids on the JSON log lines.

The process's global TracerProvider can be set once: the fixture sets one whose sampler
records only while a test of this module runs (elsewhere its spans are not recorded).
"""

from __future__ import annotations

import io
import json
import logging
from collections.abc import Iterator, Sequence
from typing import Any

import pytest
from opentelemetry import context as otel_context
from opentelemetry import trace
from opentelemetry.sdk.trace import ReadableSpan, TracerProvider
from opentelemetry.sdk.trace.export import SimpleSpanProcessor
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter
from opentelemetry.sdk.trace.sampling import Decision, Sampler, SamplingResult
from opentelemetry.trace import StatusCode

from runledger import errors
from runledger.client import Client
from runledger.flows import Flow, NotApplied, ToolCall
from runledger.tracecontext import derived, format_traceparent
from runledger.worker import _JsonFormatter
from tests.integration.conftest import Db, StartWorker


class _Switch(Sampler):
    on = False

    def should_sample(
        self,
        parent_context: otel_context.Context | None,
        trace_id: int,
        name: str,
        kind: Any = None,
        attributes: Any = None,
        links: Sequence[Any] | None = None,
        trace_state: Any = None,
    ) -> SamplingResult:
        decision = Decision.RECORD_AND_SAMPLE if self.on else Decision.DROP
        return SamplingResult(decision, attributes if self.on else None)

    def get_description(self) -> str:
        return "switch"


_SWITCH = _Switch()
_EXPORTER = InMemorySpanExporter()


@pytest.fixture
def spans() -> Iterator[InMemorySpanExporter]:
    current = trace.get_tracer_provider()
    if not isinstance(current, TracerProvider):
        provider = TracerProvider(sampler=_SWITCH)
        provider.add_span_processor(SimpleSpanProcessor(_EXPORTER))
        trace.set_tracer_provider(provider)
    assert trace.get_tracer_provider().sampler is _SWITCH  # type: ignore[attr-defined]
    _EXPORTER.clear()
    _SWITCH.on = True
    try:
        yield _EXPORTER
    finally:
        _SWITCH.on = False
        _EXPORTER.clear()


def _of_run(spans: InMemorySpanExporter, trace_id: int) -> list[ReadableSpan]:
    return [s for s in spans.get_finished_spans() if s.context.trace_id == trace_id]


def _one(found: list[ReadableSpan], name: str) -> ReadableSpan:
    named = [s for s in found if s.name == name]
    assert len(named) == 1, (name, [s.name for s in found])
    return named[0]


def _parent(span: ReadableSpan) -> int | None:
    return None if span.parent is None else span.parent.span_id


def _traced_flow() -> Flow:
    flow = Flow("traced", "1")
    app = trace.get_tracer("app")

    @flow.tool(safety="read_only")
    def lookup(ctx: Any, name: str) -> dict[str, Any]:
        return {"email": f"{name}@example.com"}

    @flow.tool(safety="unsafe")
    def charge(ctx: Any, amount: int) -> dict[str, Any]:
        raise NotApplied("card declined")

    @flow.tool(safety="idempotent")
    async def notify(ctx: Any, to: str) -> dict[str, Any]:
        with app.start_as_current_span("http POST /notify"):  # the tool's own span
            return {"sent": to}

    @flow.policy
    def decide(ctx: Any, history: list[Any]) -> Any:
        if ctx.turn == 0:
            return [ToolCall("lookup", {"name": "ana"}), ToolCall("charge", {"amount": 7})]
        if ctx.turn == 1:
            return [ToolCall("notify", {"to": history[0].calls[0].result["email"]})]
        return []

    return flow


async def test_a_run_is_one_trace_of_run_turn_and_call_spans(
    db: Db, start_worker: StartWorker, spans: InMemorySpanExporter
) -> None:
    flow = _traced_flow()
    lines = io.StringIO()
    handler = logging.StreamHandler(lines)
    handler.setFormatter(_JsonFormatter())
    writes_log = logging.getLogger("runledger.worker.writes")
    writes_log.addHandler(handler)
    writes_log.setLevel(logging.INFO)
    try:
        await db.submit("tr-1", flow)
        w = await start_worker(flow)
        run = await db.wait_status("tr-1", "succeeded", "failed", "paused")
        await w.stop()
    finally:
        writes_log.removeHandler(handler)
    assert run["status"] == "succeeded"
    assert run["traceparent"] is None  # submitted without a trace context

    trace_id, parent_id, _ = derived("tr-1")
    found = _of_run(spans, trace_id)
    assert sorted(s.name for s in found) == [
        "call charge",
        "call lookup",
        "call notify",
        "http POST /notify",
        "run traced",
        "turn 0",
        "turn 1",
        "turn 2",
    ]
    root = _one(found, "run traced")
    assert _parent(root) == parent_id and root.parent is not None and root.parent.is_remote
    assert root.kind is trace.SpanKind.CONSUMER
    assert dict(root.attributes or {}) == {
        "runledger.run_id": "tr-1",
        "runledger.flow": "traced",
        "runledger.flow_version": "1",
        "runledger.fencing_token": 1,
        "runledger.worker_id": w.worker_id,
        "runledger.takeover": False,
        "runledger.status": "succeeded",
    }
    assert root.status.status_code is StatusCode.UNSET

    turns = {n: _one(found, f"turn {n}") for n in (0, 1, 2)}
    for n, t in turns.items():
        assert _parent(t) == root.context.span_id
        assert t.attributes is not None
        assert (t.attributes["runledger.turn"], t.attributes["runledger.resumed"]) == (n, False)
    assert [(t.attributes or {})["runledger.calls"] for t in turns.values()] == [2, 1, 0]
    assert [(t.attributes or {})["runledger.final"] for t in turns.values()] == [
        False,
        False,
        True,
    ]

    lookup, charge, notify = (_one(found, f"call {x}") for x in ("lookup", "charge", "notify"))
    assert _parent(lookup) == _parent(charge) == turns[0].context.span_id
    assert _parent(notify) == turns[1].context.span_id
    assert dict(lookup.attributes or {}) == {
        "runledger.idempotency_key": "tr-1:0:c0",
        "runledger.tool": "lookup",
        "runledger.call_id": "c0",
        "runledger.turn": 0,
        "runledger.recovered": False,
        "runledger.settled": "done",
        "runledger.attempt": 1,
        "runledger.outcome": "succeeded",
    }
    assert lookup.status.status_code is StatusCode.UNSET
    assert (charge.attributes or {})["runledger.outcome"] == "failed"
    assert charge.status.status_code is StatusCode.ERROR
    assert charge.status.description == "failed: charge"  # NotApplied has a reason, no message
    assert (notify.attributes or {})["runledger.outcome"] == "succeeded"
    # the tool ran with its call span current: its own span is a child of it
    assert _parent(_one(found, "http POST /notify")) == notify.context.span_id

    # every lifecycle line carries the trace and the span current where it is written: a
    # call dispatched with its decision, the turn's; its completion, the call's
    logged = [json.loads(line) for line in lines.getvalue().splitlines()]
    dispatched = {x["call"]: x for x in logged if x["msg"] == "call dispatched"}
    completed = {x["call"]: x for x in logged if x["msg"] == "call completed"}
    assert set(dispatched) == set(completed) == {"tr-1:0:c0", "tr-1:0:c1", "tr-1:1:c0"}
    assert {x["trace_id"] for x in logged} == {f"{trace_id:032x}"}
    assert dispatched["tr-1:1:c0"]["span_id"] == f"{turns[1].context.span_id:016x}"
    assert completed["tr-1:1:c0"]["span_id"] == f"{notify.context.span_id:016x}"
    assert completed["tr-1:0:c1"]["span_id"] == f"{charge.context.span_id:016x}"
    finished = next(x for x in logged if x["msg"] == "run finished")
    assert finished["span_id"] == f"{turns[2].context.span_id:016x}"


async def test_a_run_submitted_in_a_span_continues_the_submitters_trace(
    db: Db, database_url: str, start_worker: StartWorker, spans: InMemorySpanExporter
) -> None:
    flow = _traced_flow()
    app = trace.get_tracer("app")
    with Client(database_url) as client:
        with app.start_as_current_span("handle request") as submitter:
            submitted = client.submit(flow, {}, run_id="tr-2")
        with pytest.raises(errors.InvalidInput, match="invalid traceparent"):
            client.submit(flow, {}, run_id="tr-bad", traceparent="00-nope-01")
        # an explicit one wins over the active span
        explicit = format_traceparent(0xABC, 0xDEF, 1)
        with app.start_as_current_span("another"):
            client.submit(flow, {}, run_id="tr-3", traceparent=explicit)
    assert submitted.created
    ctx = submitter.get_span_context()
    row = await db.run("tr-2")
    assert row["traceparent"] == format_traceparent(ctx.trace_id, ctx.span_id, int(ctx.trace_flags))
    assert (await db.run("tr-3"))["traceparent"] == explicit
    assert await db.rows("SELECT 1 FROM runledger.runs WHERE run_id = 'tr-bad'") == []

    w = await start_worker(flow)
    await db.wait_status("tr-2", "succeeded")
    await db.wait_status("tr-3", "succeeded")
    await w.stop()
    found = _of_run(spans, ctx.trace_id)
    names = sorted(s.name for s in found)
    assert names.count("run traced") == 1 and "handle request" in names
    assert _parent(_one(found, "run traced")) == ctx.span_id
    assert {s.context.trace_id for s in found} == {ctx.trace_id}
    other = _of_run(spans, 0xABC)
    assert _parent(_one(other, "run traced")) == 0xDEF
