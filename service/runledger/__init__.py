"""runledger: durable, fenced execution of AI-agent runs on PostgreSQL."""

from __future__ import annotations

from runledger.client import Client
from runledger.errors import (
    InvalidInput,
    InvalidTransition,
    LeaseLost,
    RunConflict,
    RunLedgerError,
    RunNotFound,
    VersionConflict,
)
from runledger.flows import (
    Decision,
    Flow,
    NotApplied,
    Receipt,
    ToolCall,
    ToolContext,
    Unknowable,
    tool_context,
)
from runledger.model import Safety

__all__ = [
    "Client",
    "Decision",
    "Flow",
    "InvalidInput",
    "InvalidTransition",
    "LeaseLost",
    "NotApplied",
    "Receipt",
    "RunConflict",
    "RunLedgerError",
    "RunNotFound",
    "Safety",
    "ToolCall",
    "ToolContext",
    "Unknowable",
    "VersionConflict",
    "tool_context",
]
