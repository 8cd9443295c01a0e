"""What a write of the store did, as typed values.

A write's result is built either from the function's reply or, when the connection
dropped while the statement was in flight, by its read-back (:mod:`runledger.db.landed`)
from what the row and the journal show. Both paths give the same value.
"""

from __future__ import annotations

from dataclasses import dataclass

from runledger.model import (
    Approval,
    CallStatus,
    IdempotencyKey,
    Outcome,
    Resolution,
    RunId,
    RunStatus,
)


@dataclass(frozen=True, slots=True, kw_only=True)
class Dispatched:
    idempotency_key: IdempotencyKey
    attempt: int


@dataclass(frozen=True, slots=True, kw_only=True)
class Checkpointed:
    run_id: RunId
    state_version: int


@dataclass(frozen=True, slots=True, kw_only=True)
class Completed:
    idempotency_key: IdempotencyKey
    outcome: Outcome
    status: CallStatus  # what the outcome leaves: not_applied -> planned


@dataclass(frozen=True, slots=True, kw_only=True)
class Advanced:
    """A call completed and the next one dispatched, in one transaction
    (``complete_call_v2``)."""

    idempotency_key: IdempotencyKey  # the completed call
    outcome: Outcome
    next_key: IdempotencyKey
    attempt: int  # the next call's attempt number


@dataclass(frozen=True, slots=True, kw_only=True)
class Batched:
    """The results of several calls of one run, committed together (``complete_calls``)."""

    idempotency_keys: tuple[IdempotencyKey, ...]
    outcomes: tuple[Outcome, ...]


@dataclass(frozen=True, slots=True, kw_only=True)
class Recorded:
    """A decision recorded (``record_turn_v3``/``_v4``), with the checkpoint before it and,
    for the final decision, the run's success; ``attempts``: the attempt number of each
    call dispatched with it (``record_turn_v4``), in the order asked."""

    run_id: RunId
    turn: int
    state_version: int
    finished: bool
    attempts: tuple[int, ...] = ()


@dataclass(frozen=True, slots=True, kw_only=True)
class Finished:
    run_id: RunId
    status: RunStatus


@dataclass(frozen=True, slots=True, kw_only=True)
class Released:
    run_id: RunId
    reason: str | None


@dataclass(frozen=True, slots=True, kw_only=True)
class Resolved:
    idempotency_key: IdempotencyKey
    resolution: Resolution
    status: CallStatus  # applied -> succeeded, not_applied -> planned, abandoned -> failed


@dataclass(frozen=True, slots=True, kw_only=True)
class Decided:
    """An approval decided: approved (the call stays planned, to be dispatched) or denied
    (the call failed, never sent)."""

    idempotency_key: IdempotencyKey
    approval: Approval
    status: CallStatus


@dataclass(frozen=True, slots=True, kw_only=True)
class Requeued:
    run_id: RunId


@dataclass(frozen=True, slots=True, kw_only=True)
class Pruned:
    runs: int


@dataclass(frozen=True, slots=True, kw_only=True)
class PrunedRecords:
    """What ``prune_records`` deleted: checkpoints of the event chains and their heads
    (``carried`` of them copied into a new checkpoint: they still pin a chain), the event
    chains of runs already gone (``chains``), the records of pruned checkpoints and of
    pruned chains, workers, commit guarantees. ``more``: the call left some to delete."""

    checkpoints: int = 0
    heads: int = 0
    carried: int = 0
    chains: int = 0
    checkpoint_prunes: int = 0
    chain_prunes: int = 0
    workers: int = 0
    commit_guarantees: int = 0
    more: bool = False

    def __add__(self, other: PrunedRecords) -> PrunedRecords:
        """The counts of both, ``more`` the later one's."""
        counts = {f: getattr(self, f) + getattr(other, f) for f in PRUNED_RECORD_COUNTS}
        return PrunedRecords(**counts, more=other.more)


PRUNED_RECORD_COUNTS = (
    "checkpoints",
    "heads",
    "carried",
    "chains",
    "checkpoint_prunes",
    "chain_prunes",
    "workers",
    "commit_guarantees",
)


CALL_STATUS_AFTER: dict[Outcome, CallStatus] = {
    Outcome.SUCCEEDED: CallStatus.SUCCEEDED,
    Outcome.FAILED: CallStatus.FAILED,
    Outcome.UNKNOWN: CallStatus.UNKNOWN,
    Outcome.NOT_APPLIED: CallStatus.PLANNED,  # certainly no effect: to be sent again
}

RESOLVED_STATUS: dict[Resolution, CallStatus] = {
    Resolution.APPLIED: CallStatus.SUCCEEDED,
    Resolution.NOT_APPLIED: CallStatus.PLANNED,
    Resolution.ABANDONED: CallStatus.FAILED,
}

DECIDED_STATUS: dict[Approval, CallStatus] = {
    Approval.APPROVED: CallStatus.PLANNED,  # dispatched by the next holder
    Approval.DENIED: CallStatus.FAILED,  # never sent
}
DECIDED_EVENT: dict[Approval, str] = {
    Approval.APPROVED: "call_approved",
    Approval.DENIED: "call_denied",
}
