"""Values and states shared by every layer; mirrors the CHECK lists of the schema.

Imports nothing of runledger. The regular expressions here are the same ones the
SQL functions enforce, so a client can refuse bad input before a round trip; the
database stays the authority.
"""

from __future__ import annotations

import datetime as dt
import re
import uuid
from dataclasses import dataclass
from enum import StrEnum
from typing import Any, NewType, TypeVar

RunId = NewType("RunId", str)
FencingToken = NewType("FencingToken", int)
LeaseId = NewType("LeaseId", uuid.UUID)
IdempotencyKey = NewType("IdempotencyKey", str)

RUN_ID_RE = re.compile(r"[A-Za-z0-9][A-Za-z0-9._:@-]{0,127}")
FLOW_NAME_RE = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]{0,127}")
FLOW_VERSION_RE = re.compile(r"[A-Za-z0-9][A-Za-z0-9._+-]{0,63}")
CALL_ID_RE = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]{0,63}")
# a W3C traceparent, version 00 (runs.traceparent; neither id may be all zeros)
TRACEPARENT_RE = re.compile(r"00-[0-9a-f]{32}-[0-9a-f]{16}-[0-9a-f]{2}")

# How deeply a JSON argument may nest; the database enforces the same limit
# (``runledger.settings.max_json_depth``). A scalar is depth 0, ``{"a": 1}`` and ``[]``
# are depth 1, ``{"a": [1]}`` is depth 2.
MAX_JSON_DEPTH = 64

_T = TypeVar("_T")
_new = object.__new__
_set = object.__setattr__


def evolve(obj: _T, **changes: Any) -> _T:
    """``dataclasses.replace`` for this module's frozen, slotted dataclasses, which have
    no ``__post_init__``: a copy with ``changes`` (a name that is not a field raises
    ``AttributeError``). Half the cost of ``replace``, which goes through ``fields()``
    and ``__init__``; the worker makes a few per tool call."""
    new = _new(type(obj))
    for name in type(obj).__slots__:  # type: ignore[attr-defined]
        _set(new, name, getattr(obj, name))
    for name, value in changes.items():
        _set(new, name, value)
    return new


class RunStatus(StrEnum):
    QUEUED = "queued"
    RUNNING = "running"
    PAUSED = "paused"
    SUCCEEDED = "succeeded"
    FAILED = "failed"
    CANCELLED = "cancelled"

    @property
    def finished(self) -> bool:
        return self in (RunStatus.SUCCEEDED, RunStatus.FAILED, RunStatus.CANCELLED)


class CallStatus(StrEnum):
    PLANNED = "planned"
    DISPATCHED = "dispatched"
    SUCCEEDED = "succeeded"
    FAILED = "failed"
    UNKNOWN = "unknown"

    @property
    def terminal(self) -> bool:
        return self in (CallStatus.SUCCEEDED, CallStatus.FAILED)


class Approval(StrEnum):
    """A call's human approval (``run_calls.approval``; ``None``: the call needs none)."""

    PENDING = "pending"  # recorded with "approval": true; never dispatched until decided
    APPROVED = "approved"  # dispatched like any call
    DENIED = "denied"  # failed, never sent: error {reason: "denied", note, actor}


class Outcome(StrEnum):
    """What ``complete_call`` records."""

    SUCCEEDED = "succeeded"
    FAILED = "failed"
    UNKNOWN = "unknown"
    NOT_APPLIED = "not_applied"  # certainly no effect: back to planned, sent again later


class FinishStatus(StrEnum):
    """What ``finish_run`` accepts."""

    SUCCEEDED = "succeeded"
    FAILED = "failed"
    PAUSED = "paused"


class Resolution(StrEnum):
    """How an operator resolves an ``unknown`` call."""

    APPLIED = "applied"
    NOT_APPLIED = "not_applied"
    ABANDONED = "abandoned"


class Safety(StrEnum):
    """A tool's safety class, declared by its author."""

    IDEMPOTENT = "idempotent"
    LOOKUP = "lookup"
    UNSAFE = "unsafe"
    READ_ONLY = "read_only"


def flow_ref(name: str, version: str) -> str:
    """The ``name@version`` string workers claim by."""
    return f"{name}@{version}"


def parse_flow_ref(ref: str) -> tuple[str, str]:
    """Split ``name@version``; raises ``ValueError`` on anything else."""
    name, sep, version = ref.partition("@")
    if not sep or not FLOW_NAME_RE.fullmatch(name) or not FLOW_VERSION_RE.fullmatch(version):
        raise ValueError(f"not a flow reference of the form name@version: {ref!r}")
    return name, version


def idempotency_key(run_id: str, turn: int, call_id: str) -> IdempotencyKey:
    return IdempotencyKey(f"{run_id}:{turn}:{call_id}")


@dataclass(frozen=True, slots=True, kw_only=True)
class SubmitResult:
    run_id: RunId
    created: bool


@dataclass(frozen=True, slots=True, kw_only=True)
class ClaimedRun:
    run_id: RunId
    flow: str
    flow_version: str
    input: dict[str, Any]
    state: dict[str, Any] | None
    state_version: int
    fencing_token: FencingToken
    lease_id: LeaseId
    lease_expires_at: dt.datetime
    takeover: bool
    # the W3C trace context the run was submitted with (None: none)
    traceparent: str | None = None


@dataclass(frozen=True, slots=True, kw_only=True)
class RenewedLease:
    run_id: RunId
    lease_expires_at: dt.datetime


@dataclass(frozen=True, slots=True, kw_only=True)
class Run:
    run_id: RunId
    flow: str
    flow_version: str
    status: RunStatus
    input: dict[str, Any]
    state: dict[str, Any] | None
    state_version: int
    fencing_token: int
    lease_id: uuid.UUID | None
    lease_owner: str | None
    lease_expires_at: dt.datetime | None
    claims: int
    stalled_claims: int
    priority: int
    available_at: dt.datetime
    pause_reason: str | None
    result: Any
    error: Any
    created_at: dt.datetime
    updated_at: dt.datetime
    finished_at: dt.datetime | None


@dataclass(frozen=True, slots=True, kw_only=True)
class Call:
    run_id: RunId
    turn: int
    call_id: str
    position: int
    tool: str
    args: dict[str, Any]
    idempotency_key: IdempotencyKey
    status: CallStatus
    attempts: int
    result: Any
    receipt: Any
    error: Any
    dispatched_token: int | None
    completed_token: int | None
    provider_id: str | None = None  # the model's id for the call (never part of the key)
    approval: Approval | None = None  # None: the call needs no approval
    approval_by: str | None = None  # who approved or denied it
    # who dispatched it last ("failover": a failover marked it, its dispatch may be lost);
    # None: never dispatched on this timeline
    dispatched_by: str | None = None
    dispatched_at: dt.datetime | None = None  # the last dispatch (database clock)


@dataclass(frozen=True, slots=True, kw_only=True)
class CallSender:
    """Who sent a call that is in flight (``call_sender``, revision 0031), as its current
    holder sees it before it recovers the call."""

    sender: str | None  # the worker id that dispatched the current attempt
    sender_token: int
    attempt: int
    dispatched_at: dt.datetime | None
    # None: the sender can no longer be sending it; else until when it may be
    until: dt.datetime | None
    released: dict[str, Any] | None  # what the sender (or the holder) said when released
    # the sender's process: the one that claimed the run under its token (that claim's
    # event), else its worker's registered one (workers.process)
    process: str | None
    registered_at: dt.datetime | None  # when that process was recorded (claim or registration)
    now: dt.datetime  # the database clock when this was read


@dataclass(frozen=True, slots=True, kw_only=True)
class Turn:
    """One recorded decision: its calls as recorded (``run_turns.calls``), the
    provider-native message (``record``) and, for the final one, its ``output``."""

    turn: int
    calls: list[dict[str, Any]]
    record: dict[str, Any] | None = None
    output: Any = None


@dataclass(frozen=True, slots=True, kw_only=True)
class Event:
    event_id: int
    run_id: str
    at: dt.datetime
    kind: str
    actor: str | None
    fencing_token: int | None
    state_version: int | None
    detail: dict[str, Any]
