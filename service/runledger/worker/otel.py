"""``runledger worker --otel``: an OpenTelemetry SDK TracerProvider for the worker process,
configured from the standard environment, so that the spans of
:mod:`runledger.worker.tracing` go somewhere without code of the user's.

- the exporters named by ``OTEL_TRACES_EXPORTER`` (comma-separated; default ``otlp``, as
  the specification says; ``none`` for none), loaded by name from the
  ``opentelemetry_traces_exporter`` entry points that the exporter packages register
  (``otlp`` is ``opentelemetry-exporter-otlp``'s, ``console`` the SDK's), each behind a
  batch span processor;
- with ``--otel-file PATH``: also every span as one JSON line appended to ``PATH`` when it
  ends (a simple, synchronous processor: a worker killed afterwards has lost none of the
  spans it ended). Only the file when ``OTEL_TRACES_EXPORTER`` is not set;
- the resource: ``service.name`` from ``OTEL_SERVICE_NAME``, else ``runledger-worker``;
  ``OTEL_RESOURCE_ATTRIBUTES`` as the SDK reads it.

Imported only for ``--otel``: it imports the SDK (the ``otel`` extra; without it the
import fails, and the CLI says :data:`runledger.worker.tracing.INSTALL_HINT`).
"""

from __future__ import annotations

import json
import os
import threading
from collections.abc import Sequence
from importlib.metadata import entry_points
from typing import Any

from opentelemetry import trace
from opentelemetry.sdk.resources import Resource
from opentelemetry.sdk.trace import ReadableSpan, TracerProvider
from opentelemetry.sdk.trace.export import (
    BatchSpanProcessor,
    SimpleSpanProcessor,
    SpanExporter,
    SpanExportResult,
)


class ExporterNotFound(ValueError):
    """``OTEL_TRACES_EXPORTER`` names an exporter that no installed package provides."""


def configure(file: str | None) -> TracerProvider:
    """Install a TracerProvider as the global one; returns it. Raises
    :class:`ExporterNotFound` for an exporter name no installed package provides."""
    names = os.environ.get("OTEL_TRACES_EXPORTER")
    wanted = [n.strip() for n in (names or ("" if file else "otlp")).split(",") if n.strip()]
    exporters = [_exporter(n) for n in wanted if n != "none"]
    service = os.environ.get("OTEL_SERVICE_NAME") or "runledger-worker"
    provider = TracerProvider(resource=Resource.create({"service.name": service}))
    for exporter in exporters:
        provider.add_span_processor(BatchSpanProcessor(exporter))
    if file:
        provider.add_span_processor(SimpleSpanProcessor(JsonLinesExporter(file)))
    trace.set_tracer_provider(provider)
    return provider


def _exporter(name: str) -> SpanExporter:
    found = entry_points(group="opentelemetry_traces_exporter", name=name)
    if not found:
        known = sorted(e.name for e in entry_points(group="opentelemetry_traces_exporter"))
        hint = " (pip install opentelemetry-exporter-otlp)" if name == "otlp" else ""
        raise ExporterNotFound(
            f"OTEL_TRACES_EXPORTER={name}: no installed package provides it{hint}; "
            f"installed: {', '.join(known) or 'none'} (or use --otel-file PATH)"
        )
    exporter: SpanExporter = next(iter(found)).load()()
    return exporter


def span_record(span: ReadableSpan) -> dict[str, Any]:
    """One ended span as the JSON object of a line of ``--otel-file``."""
    ctx = span.get_span_context()
    assert ctx is not None
    parent = span.parent
    return {
        "name": span.name,
        "trace_id": f"{ctx.trace_id:032x}",
        "span_id": f"{ctx.span_id:016x}",
        "parent_span_id": None if parent is None else f"{parent.span_id:016x}",
        "kind": span.kind.name,
        "start_ns": span.start_time,
        "end_ns": span.end_time,
        "status": span.status.status_code.name,
        "status_description": span.status.description,
        "attributes": dict(span.attributes or {}),
        "events": [{"name": e.name, "attributes": dict(e.attributes or {})} for e in span.events],
        "service": span.resource.attributes.get("service.name"),
        "pid": os.getpid(),
    }


class JsonLinesExporter(SpanExporter):
    """Appends each span as one JSON line to a file: one ``write`` per batch on a file
    opened for appending, so several processes can share the file."""

    def __init__(self, path: str) -> None:
        self.path = path
        self._lock = threading.Lock()
        self._fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)

    def export(self, spans: Sequence[ReadableSpan]) -> SpanExportResult:
        data = "".join(json.dumps(span_record(s), default=str) + "\n" for s in spans)
        with self._lock:
            try:
                os.write(self._fd, data.encode("utf-8"))
            except OSError:
                return SpanExportResult.FAILURE
        return SpanExportResult.SUCCESS

    def shutdown(self) -> None:
        with self._lock:
            if self._fd >= 0:
                os.close(self._fd)
                self._fd = -1

    def force_flush(self, timeout_millis: int = 30_000) -> bool:
        return True
