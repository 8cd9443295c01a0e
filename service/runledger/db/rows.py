"""Rows of the run tables -> the frozen dataclasses of :mod:`runledger.model`."""

from __future__ import annotations

import datetime as dt
import decimal
from dataclasses import dataclass
from typing import Any

from runledger.model import (
    Approval,
    Call,
    CallStatus,
    IdempotencyKey,
    Run,
    RunId,
    RunStatus,
    Turn,
)

Row = dict[str, Any]


@dataclass(frozen=True, slots=True, kw_only=True)
class Journal:
    stalled_claims: int
    turns: list[Turn]
    calls: list[Call]


@dataclass(frozen=True, slots=True, kw_only=True)
class ClaimedJournal:
    """What ``claim_runs_v2`` returns with a claimed run, not yet unpacked: the stalled-claim
    count, and the turns and calls as the driver decoded them (each one JSON value, which
    may be :class:`~runledger.db.decode.Undecodable`), or ``None`` when the claim did not
    carry the journal (a run claimed again without progress)."""

    stalled_claims: int
    turns: Any
    calls: Any
    # claim_runs_v3: the turn from which a failover makes never-dispatched calls suspect
    # of having been sent on a lost timeline; None when no failover affected the run
    failover_turn: int | None = None

    @property
    def included(self) -> bool:
        return self.turns is not None and self.calls is not None

    def journal(self) -> Journal:
        """The journal; raises (``TypeError`` and the like) when a part of it could not be
        decoded as a whole: the caller finds the value call by call."""
        return journal_from(self.stalled_claims, self.turns, self.calls)


def journal_from(stalled_claims: int, turns: Any, calls: Any) -> Journal:
    """A journal from its aggregated turns and calls (JSON arrays of rows)."""
    return Journal(
        stalled_claims=stalled_claims,
        turns=[turn_from_row(t) for t in turns],
        calls=[call_from_row(c) for c in calls],
    )


def run_from_row(r: Row) -> Run:
    return Run(
        run_id=RunId(r["run_id"]),
        flow=r["flow"],
        flow_version=r["flow_version"],
        status=RunStatus(r["status"]),
        input=r["input"],
        state=r["state"],
        state_version=r["state_version"],
        fencing_token=r["fencing_token"],
        lease_id=r["lease_id"],
        lease_owner=r["lease_owner"],
        lease_expires_at=r["lease_expires_at"],
        claims=r["claims"],
        stalled_claims=r["stalled_claims"],
        priority=r["priority"],
        available_at=r["available_at"],
        pause_reason=r["pause_reason"],
        result=r["result"],
        error=r["error"],
        created_at=r["created_at"],
        updated_at=r["updated_at"],
        finished_at=r["finished_at"],
    )


def call_from_row(r: Row) -> Call:
    return Call(
        run_id=RunId(r["run_id"]),
        turn=r["turn"],
        call_id=r["call_id"],
        position=r["position"],
        tool=r["tool"],
        args=r["args"],
        idempotency_key=IdempotencyKey(r["idempotency_key"]),
        status=CallStatus(r["status"]),
        attempts=r["attempts"],
        result=r["result"],
        receipt=r["receipt"],
        error=r["error"],
        dispatched_token=r["dispatched_token"],
        completed_token=r["completed_token"],
        provider_id=r.get("provider_id"),
        approval=Approval(r["approval"]) if r.get("approval") is not None else None,
        approval_by=r.get("approval_by"),
        dispatched_by=r.get("dispatched_by"),
        dispatched_at=_instant(r.get("dispatched_at")),
    )


def _instant(value: Any) -> dt.datetime | None:
    """A ``timestamptz`` as a row gives it, or as the claim's JSON does (ISO 8601)."""
    if value is None or isinstance(value, dt.datetime):
        return value
    return dt.datetime.fromisoformat(value)


def turn_from_row(r: Row) -> Turn:
    return Turn(
        turn=int(r["turn"]),
        calls=list(r["calls"]),
        record=r.get("record"),
        output=r.get("output"),
    )


def _jsonb_key(key: str) -> tuple[int, bytes]:
    raw = key.encode()
    return len(raw), raw


def as_stored(value: Any) -> Any:
    """``value`` as ``jsonb`` gives it back: object keys in jsonb's order (shorter first,
    then by their UTF-8 bytes), tuples as lists, and a float written with a positive
    exponent as the integer jsonb's ``numeric`` keeps. What the worker keeps in memory of
    a write is then what a reload of the journal would show."""
    if isinstance(value, dict):
        keys = sorted(value, key=_jsonb_key) if len(value) > 1 else value
        return {k: as_stored(value[k]) for k in keys}
    if isinstance(value, list | tuple):
        return [as_stored(v) for v in value]
    if isinstance(value, float) and "e+" in repr(value):
        return int(decimal.Decimal(repr(value)))
    return value
