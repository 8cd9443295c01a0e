"""The W3C trace context of a run (revision 0017): what ``runs.traceparent`` holds, and
the context a run submitted without one is traced under.

Nothing here imports OpenTelemetry: :func:`current_traceparent` looks for it among the
modules the process has imported already (a process that never imported
``opentelemetry.trace`` has no span to continue).

A run submitted without a trace context is traced under one derived from its run id
(:func:`derived`): the trace id is the first 16 bytes of the SHA-256 of the run id, the
parent span id the next 8. Every worker that drives the run computes the same context,
so the spans of a run taken over after a crash land in the same trace with nothing
written at claim; the derived parent span itself is never exported.
"""

from __future__ import annotations

import hashlib
import sys

from runledger.model import TRACEPARENT_RE

SAMPLED = 0x01


def format_traceparent(trace_id: int, span_id: int, flags: int) -> str:
    return f"00-{trace_id:032x}-{span_id:016x}-{flags:02x}"


def parse_traceparent(value: str) -> tuple[int, int, int] | None:
    """(trace id, parent span id, flags) of a version-00 traceparent; None if malformed."""
    if TRACEPARENT_RE.fullmatch(value) is None:
        return None
    trace_id, span_id, flags = int(value[3:35], 16), int(value[36:52], 16), int(value[53:], 16)
    if trace_id == 0 or span_id == 0:
        return None
    return trace_id, span_id, flags


def derived(run_id: str) -> tuple[int, int, int]:
    """The trace context of a run submitted without one: (trace id, parent span id,
    flags), a function of the run id alone, sampled."""
    digest = hashlib.sha256(run_id.encode("utf-8")).digest()
    trace_id = int.from_bytes(digest[:16], "big") or 1
    span_id = int.from_bytes(digest[16:24], "big") or 1
    return trace_id, span_id, SAMPLED


def run_context(run_id: str, traceparent: str | None) -> tuple[int, int, int]:
    """The parent context of a run's spans: the stored one, else the derived one."""
    stored = parse_traceparent(traceparent) if traceparent is not None else None
    return stored if stored is not None else derived(run_id)


def current_traceparent() -> str | None:
    """The traceparent of the caller's active span, if OpenTelemetry is in use and a valid
    span is active; else None (and nothing is imported)."""
    trace = sys.modules.get("opentelemetry.trace")
    if trace is None:
        return None
    ctx = trace.get_current_span().get_span_context()
    if not ctx.is_valid:
        return None
    return format_traceparent(ctx.trace_id, ctx.span_id, int(ctx.trace_flags))
