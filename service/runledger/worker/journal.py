"""The journal of a held run, kept in memory for the rest of the lease.

Loaded once (with the claim, or read after the crash-loop check), then kept up to date
from this holder's own committed writes: a recorded decision adds its turn and its
planned calls (their keys are ``{run_id}:{turn}:{call_id}``, deterministic), a dispatch
and a completion update their call. While the lease is held no one else writes the run's
turns or calls (an operator's ``cancel_run`` ends the lease, and the next write is
refused), so this equals what a reload would read; values are kept as ``jsonb`` gives
them back (:func:`~runledger.db.rows.as_stored`). A refused write ends this holder's work
on the run; the next holder loads the journal from the database.
"""

from __future__ import annotations

from typing import Any

from runledger.db.results import CALL_STATUS_AFTER
from runledger.db.rows import Journal, as_stored
from runledger.model import (
    Approval,
    Call,
    CallStatus,
    IdempotencyKey,
    Outcome,
    RunId,
    Turn,
    evolve,
)


class LocalJournal:
    def __init__(self, run_id: str, journal: Journal) -> None:
        self.run_id = run_id
        self.turns: list[Turn] = list(journal.turns)
        self.calls: list[Call] = list(journal.calls)
        self._at: dict[str, int] = {c.idempotency_key: i for i, c in enumerate(self.calls)}

    def recorded(
        self,
        turn: int,
        calls: list[dict[str, Any]],
        record: dict[str, Any] | None,
        output: Any,
    ) -> None:
        """``record_turn`` committed this decision: its turn, and its calls planned."""
        stored: list[dict[str, Any]] = as_stored(calls)
        self.turns.append(
            Turn(turn=turn, calls=stored, record=as_stored(record), output=as_stored(output))
        )
        for position, x in enumerate(stored):
            key = IdempotencyKey(f"{self.run_id}:{turn}:{x['call_id']}")
            self._at[key] = len(self.calls)
            self.calls.append(
                Call(
                    run_id=RunId(self.run_id),
                    turn=turn,
                    call_id=x["call_id"],
                    position=position,
                    tool=x["tool"],
                    args=x.get("args", {}),
                    idempotency_key=key,
                    status=CallStatus.PLANNED,
                    attempts=0,
                    result=None,
                    receipt=None,
                    error=None,
                    dispatched_token=None,
                    completed_token=None,
                    provider_id=x.get("provider_id"),
                    approval=Approval.PENDING if x.get("approval") is True else None,
                )
            )

    def call(self, key: str) -> Call | None:
        at = self._at.get(key)
        return None if at is None else self.calls[at]

    def _update(self, key: str, **changes: Any) -> None:
        at = self._at.get(key)
        if at is not None:
            self.calls[at] = evolve(self.calls[at], **changes)

    def dispatched(self, key: str, attempt: int, token: int, by: str = "") -> None:
        # by: the dispatcher; any value but None says "dispatched on this timeline" to
        # calls.suspect (docs/failover.md)
        self._update(
            key,
            status=CallStatus.DISPATCHED,
            attempts=attempt,
            dispatched_token=token,
            dispatched_by=by,
        )

    def completed(self, key: str, outcome: Outcome, result: Any, receipt: Any, token: int) -> None:
        """What ``complete_call`` leaves, outcome by outcome (see docs/design.md)."""
        if outcome is Outcome.NOT_APPLIED:
            self._update(
                key,
                status=CallStatus.PLANNED,
                result=None,
                receipt=None,
                error=as_stored(result),
                completed_token=None,
            )
            return
        succeeded = outcome is Outcome.SUCCEEDED
        self._update(
            key,
            status=CALL_STATUS_AFTER[outcome],
            result=as_stored(result) if succeeded else None,
            error=None if succeeded else as_stored(result),
            receipt=as_stored(receipt),
            completed_token=token,
        )
