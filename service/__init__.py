"""runledger: durable, fenced execution of AI-agent runs on PostgreSQL."""

from __future__ import annotations

from service.client import Client
from service.errors import (
    InvalidInput,
    InvalidTransition,
    LeaseLost,
    RunConflict,
    RunLedgerError,
    RunNotFound,
    VersionConflict,
)
from service.flows import Flow, NotApplied, Receipt, ToolCall, ToolContext
from service.model import Safety

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
