"""OpenTelemetry spans of the runs a worker drives (the ``otel`` extra).

One trace per run. Each holder of the run's lease makes, under the run's trace context
(:func:`runledger.tracecontext.run_context`: the one stored at submit, else the one derived
from the run id):

- ``run <flow>`` (kind CONSUMER), from the claim to the end of this holder's work on it,
  with ``runledger.run_id``, ``runledger.flow``, ``runledger.flow_version``,
  ``runledger.fencing_token``, ``runledger.worker_id``, ``runledger.takeover``, and at the
  end ``runledger.status`` (and ``runledger.reason``) or ``runledger.stopped`` (why this
  holder stopped: ``draining``, ``lease_lost``, ``lease_expired``, ``fenced``, ``error``);
- ``turn N`` under it, from the policy's decision to the last of the turn's calls
  (``runledger.turn``, ``runledger.resumed`` for a turn recorded by an earlier holder,
  ``runledger.calls`` and ``runledger.final`` once decided);
- ``call <tool>`` under the turn, one per call this holder settles
  (``runledger.idempotency_key``, ``runledger.tool``, ``runledger.call_id``,
  ``runledger.turn``, ``runledger.recovered`` for a call found in flight, then
  ``runledger.attempt``, ``runledger.outcome`` and ``runledger.settled``); status error
  when the call failed or is unknown. The tool runs with this span current, so spans
  the tool makes (an instrumented HTTP client) are its children.

A worker that takes a run over continues the same trace: its ``run`` span has the same
parent. A worker killed mid-run exports nothing of the spans it had open.

Nothing here imports OpenTelemetry: spans are made only when the process has imported
``opentelemetry.trace`` (a TracerProvider configured by the user's code, by
``runledger worker --otel``, or by ``opentelemetry-instrument``) and a TracerProvider is
set (checked at each claim: one set later counts from the next run). Otherwise each hook
is one attribute check (``ActiveRun.trace is None``).
"""

from __future__ import annotations

import asyncio
import functools
import sys
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import Any, Concatenate, ParamSpec, TypeVar

from runledger import errors
from runledger.model import Call, CallStatus, FinishStatus
from runledger.tracecontext import run_context
from runledger.worker.runs import ActiveRun, Draining, LocalLeaseExpired

S = TypeVar("S")
P = ParamSpec("P")
R = TypeVar("R")

TRACER_NAME = "runledger"
INSTALL_HINT = (
    "--otel needs the OpenTelemetry SDK: pip install 'runledger-pg[otel]' "
    "(opentelemetry-api and opentelemetry-sdk)"
)


@dataclass(slots=True)
class RunTrace:
    """The spans of one held run (``ActiveRun.trace``)."""

    ot: Any  # the opentelemetry.trace module
    otc: Any  # the opentelemetry.context module
    tracer: Any
    span: Any
    token: object
    turn: int | None = None
    turn_span: Any = None
    turn_token: object = None


def _api() -> tuple[Any, Any] | None:
    """The OpenTelemetry modules, when this process uses them and a TracerProvider is
    configured; else None (the API's no-op would record nothing: the spans are skipped)."""
    ot = sys.modules.get("opentelemetry.trace")
    otc = sys.modules.get("opentelemetry.context")
    if ot is None or otc is None:
        return None
    if isinstance(ot.get_tracer_provider(), ot.ProxyTracerProvider | ot.NoOpTracerProvider):
        return None
    return ot, otc


class _RunSpan:
    """``async with run(active, worker_id)``: the run span of this holder, current for
    the run's task."""

    __slots__ = ("active", "worker_id")

    def __init__(self, active: ActiveRun, worker_id: str) -> None:
        self.active = active
        self.worker_id = worker_id

    async def __aenter__(self) -> None:
        api = _api()
        if api is None:
            return
        ot, otc = api
        c = self.active.claim
        trace_id, span_id, flags = run_context(c.run_id, c.traceparent)
        parent = ot.NonRecordingSpan(
            ot.SpanContext(trace_id, span_id, is_remote=True, trace_flags=ot.TraceFlags(flags))
        )
        tracer = ot.get_tracer(TRACER_NAME)
        span = tracer.start_span(
            f"run {c.flow}",
            context=ot.set_span_in_context(parent),
            kind=ot.SpanKind.CONSUMER,
            attributes={
                "runledger.run_id": c.run_id,
                "runledger.flow": c.flow,
                "runledger.flow_version": c.flow_version,
                "runledger.fencing_token": c.fencing_token,
                "runledger.worker_id": self.worker_id,
                "runledger.takeover": c.takeover,
            },
        )
        token = otc.attach(ot.set_span_in_context(span))
        self.active.trace = RunTrace(ot=ot, otc=otc, tracer=tracer, span=span, token=token)

    async def __aexit__(self, exc_type: object, exc: BaseException | None, tb: object) -> None:
        t = self.active.trace
        if t is None:
            return
        self.active.trace = None
        _end_turn(t, exc)
        if exc is not None:
            _stopped(t, t.span, exc)
        t.otc.detach(t.token)
        t.span.end()


def run(active: ActiveRun, worker_id: str) -> _RunSpan:
    """The run span around this holder's work on ``active`` (an async context manager)."""
    return _RunSpan(active, worker_id)


def _stopped(t: RunTrace, span: Any, exc: BaseException) -> None:
    """Why this holder stopped, on ``span``: the fencing exceptions by name, anything
    else recorded as an exception."""
    error = t.ot.StatusCode.ERROR
    if isinstance(exc, Draining):
        span.set_attribute("runledger.stopped", "draining")
    elif isinstance(exc, errors.LeaseLost):
        span.set_attribute("runledger.stopped", "lease_lost")
        span.set_status(t.ot.Status(error, "lease lost: a write was refused"))
    elif isinstance(exc, LocalLeaseExpired):
        span.set_attribute("runledger.stopped", "lease_expired")
        span.set_status(t.ot.Status(error, "the local lease deadline passed"))
    elif isinstance(exc, asyncio.CancelledError):
        span.set_attribute("runledger.stopped", "fenced")
        span.set_status(t.ot.Status(error, "fenced: the run's task was cancelled"))
    else:
        span.set_attribute("runledger.stopped", "error")
        span.record_exception(exc)
        span.set_status(t.ot.Status(error, f"{type(exc).__name__}: {exc}"[:500]))


def _end_turn(t: RunTrace, exc: BaseException | None = None) -> None:
    if t.turn_span is None:
        return
    if exc is not None:
        _stopped(t, t.turn_span, exc)
    t.otc.detach(t.turn_token)
    t.turn_span.end()
    t.turn, t.turn_span, t.turn_token = None, None, None


def turn(active: ActiveRun, number: int, *, resumed: bool = False) -> None:
    """Turn ``number`` starts (or goes on: nothing changes if it is the current one): the
    previous turn's span ends, this one's starts, current for the run's task."""
    t = active.trace
    if t is None or t.turn == number:
        return
    _end_turn(t)
    span = t.tracer.start_span(
        f"turn {number}",
        context=t.ot.set_span_in_context(t.span),
        attributes={"runledger.turn": number, "runledger.resumed": resumed},
    )
    t.turn, t.turn_span = number, span
    t.turn_token = t.otc.attach(t.ot.set_span_in_context(span))


def decided(active: ActiveRun, calls: int) -> None:
    """The turn's decision is recorded: ``calls`` calls (none: the final decision)."""
    t = active.trace
    if t is None or t.turn_span is None:
        return
    t.turn_span.set_attribute("runledger.calls", calls)
    t.turn_span.set_attribute("runledger.final", calls == 0)


def finished(active: ActiveRun, status: FinishStatus, reason: str | None) -> None:
    """The run ended (succeeded, failed or paused) under this holder."""
    t = active.trace
    if t is None:
        return
    t.span.set_attribute("runledger.status", str(status))
    if reason is not None:
        t.span.set_attribute("runledger.reason", reason)
    if status is FinishStatus.FAILED:
        t.span.set_status(t.ot.Status(t.ot.StatusCode.ERROR, reason or "failed"))


_CALL_ERRORS = (CallStatus.FAILED, CallStatus.UNKNOWN)


def call_span(
    settle: Callable[Concatenate[S, ActiveRun, Any, Call, P], Awaitable[R]],
) -> Callable[Concatenate[S, ActiveRun, Any, Call, P], Awaitable[R]]:
    """Decorates ``Calls.settle``: the call's span around it, current while it runs."""

    @functools.wraps(settle)
    async def traced(
        self: S, active: ActiveRun, flow: Any, call: Call, /, *args: P.args, **kwargs: P.kwargs
    ) -> R:
        t = active.trace
        if t is None:
            return await settle(self, active, flow, call, *args, **kwargs)
        parent = t.turn_span if t.turn == call.turn and t.turn_span is not None else t.span
        span = t.tracer.start_span(
            f"call {call.tool}",
            context=t.ot.set_span_in_context(parent),
            attributes={
                "runledger.idempotency_key": call.idempotency_key,
                "runledger.tool": call.tool,
                "runledger.call_id": call.call_id,
                "runledger.turn": call.turn,
                "runledger.recovered": call.status is CallStatus.DISPATCHED
                and kwargs.get("dispatched") is None,
            },
        )
        token = t.otc.attach(t.ot.set_span_in_context(span))
        try:
            result = await settle(self, active, flow, call, *args, **kwargs)
        except BaseException as exc:
            _stopped(t, span, exc)
            raise
        else:
            _settled(t, span, active, call, result)
            return result
        finally:
            t.otc.detach(token)
            span.end()

    return traced


def _settled(t: RunTrace, span: Any, active: ActiveRun, call: Call, result: Any) -> None:
    settled = result[0] if isinstance(result, tuple) and result else result
    span.set_attribute("runledger.settled", str(getattr(settled, "value", settled)))
    now = active.journal.call(call.idempotency_key) if active.journal is not None else None
    if now is None:
        return
    span.set_attribute("runledger.attempt", now.attempts)
    span.set_attribute("runledger.outcome", str(now.status))
    if now.status in _CALL_ERRORS:
        message = (now.error or {}).get("message") if isinstance(now.error, dict) else None
        span.set_status(
            t.ot.Status(t.ot.StatusCode.ERROR, f"{now.status}: {message or call.tool}"[:500])
        )


def log_fields() -> dict[str, str]:
    """``trace_id`` and ``span_id`` of the span current where a log line is written (for
    the JSON log lines), when one is recording; else nothing."""
    ot = sys.modules.get("opentelemetry.trace")
    if ot is None:
        return {}
    span = ot.get_current_span()
    if not span.is_recording():
        return {}
    ctx = span.get_span_context()
    return {"trace_id": f"{ctx.trace_id:032x}", "span_id": f"{ctx.span_id:016x}"}
