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
from runledger.flows import Flow, NotApplied, Receipt, ToolCall, ToolContext
from runledger.model import Safety

__all__ = [
    "Client",
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
    "VersionConflict",
]
