"""``probe@1`` for tests/process/test_tracing.py: one call whose result lists the
OpenTelemetry modules the worker process has imported by then, then the end."""

from __future__ import annotations

import sys
from typing import Any

from runledger.flows import Flow, HistoryTurn, PolicyContext, ToolCall, ToolContext

probe = Flow("probe", version="1")


@probe.tool(safety="read_only")
def modules(ctx: ToolContext) -> dict[str, Any]:
    return {"otel": sorted(m for m in sys.modules if m.split(".")[0] == "opentelemetry")}


@probe.policy
def decide(ctx: PolicyContext, history: list[HistoryTurn]) -> list[ToolCall]:
    return [] if history else [ToolCall("modules", {})]
