"""Read-backs: did a write land before the connection dropped?

Each method answers for one write that is not safe to repeat, from what that write
leaves in the tables, and returns the write's typed result (:mod:`runledger.db.results`)
or ``None`` when the write did not land and must be sent again. Each function writes
exactly one event in its own transaction, so the journal is the witness that does not
move afterwards:

- a worker write carries its fencing token, current for one lease only: the event of
  that kind with our token (and the version, the key and the attempt where one lease
  can write several) says the write landed, whatever happened to the row since;
- an operator write carries no token: the store notes the run's last event id (a
  *mark*) before sending, and looks for the event written after it.
"""

from __future__ import annotations

import datetime as dt
from collections.abc import Sequence
from typing import Any

from psycopg.types.json import Jsonb

from runledger.db.execution import Executor
from runledger.db.results import (
    CALL_STATUS_AFTER,
    DECIDED_EVENT,
    DECIDED_STATUS,
    RESOLVED_STATUS,
    Advanced,
    Batched,
    Checkpointed,
    Completed,
    Decided,
    Dispatched,
    Finished,
    Pruned,
    Recorded,
    Released,
    Requeued,
    Resolved,
)
from runledger.model import (
    Approval,
    CallStatus,
    FinishStatus,
    IdempotencyKey,
    Outcome,
    Resolution,
    RunId,
    RunStatus,
)

# The event each write writes (literal kinds, so a grep finds them).
CALL_EVENT: dict[Outcome, str] = {
    Outcome.SUCCEEDED: "call_succeeded",
    Outcome.FAILED: "call_failed",
    Outcome.UNKNOWN: "call_unknown",
    Outcome.NOT_APPLIED: "call_not_applied",
}
FINISH_EVENT: dict[FinishStatus, str] = {
    FinishStatus.SUCCEEDED: "run_succeeded",
    FinishStatus.FAILED: "run_failed",
    FinishStatus.PAUSED: "run_paused",
}
FINISHED_STATUS: dict[FinishStatus, RunStatus] = {
    FinishStatus.SUCCEEDED: RunStatus.SUCCEEDED,
    FinishStatus.FAILED: RunStatus.FAILED,
    FinishStatus.PAUSED: RunStatus.PAUSED,
}
FINISHED_RUNS = ["succeeded", "failed", "cancelled"]  # what prune_runs deletes


class ReadBacks:
    """The read-backs of every write that is not safe to repeat, over ``executor``."""

    def __init__(self, executor: Executor) -> None:
        self.executor = executor

    async def _journaled(
        self,
        run_id: str,
        kind: str,
        *,
        fencing_token: int | None = None,
        state_version: int | None = None,
        actor: str | None = None,
        after: int = 0,
        detail: dict[str, Any] | None = None,
    ) -> bool:
        """Whether the run has an event of ``kind`` with these fields (``detail`` is
        matched by containment), newer than event id ``after``."""
        rows = await self.executor.read(
            """SELECT 1 AS found FROM runledger.run_events e
               WHERE e.run_id = %s AND e.kind = %s AND e.event_id > %s
                 AND (%s::bigint IS NULL OR e.fencing_token = %s::bigint)
                 AND (%s::bigint IS NULL OR e.state_version = %s::bigint)
                 AND (%s::text IS NULL OR e.actor = %s::text)
                 AND e.detail @> %s::jsonb
               LIMIT 1""",
            (
                run_id,
                kind,
                after,
                fencing_token,
                fencing_token,
                state_version,
                state_version,
                actor,
                actor,
                Jsonb(detail or {}),
            ),
        )
        return bool(rows)

    async def event_mark(self, run_id: str) -> int:
        """The run's newest event id (0 for none): what an operator write is checked after."""
        rows = await self.executor.read(
            "SELECT coalesce(max(e.event_id), 0) AS mark FROM runledger.run_events e"
            " WHERE e.run_id = %s",
            (run_id,),
        )
        return int(rows[0]["mark"])

    async def _call_row(self, run_id: str | None, key: str) -> dict[str, Any] | None:
        rows = await self.executor.read(
            "SELECT run_id, status, attempts, dispatched_token, completed_token"
            " FROM runledger.run_calls WHERE idempotency_key = %s"
            " AND (%s::text IS NULL OR run_id = %s::text)",
            (key, run_id, run_id),
        )
        return rows[0] if rows else None

    # -- worker writes: our fencing token is the witness -------------------------------

    async def checkpointed(
        self, run_id: str, fencing_token: int, expected_version: int
    ) -> Checkpointed | None:
        version = expected_version + 1
        if await self._journaled(
            run_id, "checkpoint", fencing_token=fencing_token, state_version=version
        ):
            return Checkpointed(run_id=RunId(run_id), state_version=version)
        return None

    async def dispatched(
        self, run_id: str, key: str, fencing_token: int, attempts_seen: int | None = None
    ) -> Dispatched | None:
        """Dispatched under our token. When the call was already dispatched under this
        lease, only ``attempts_seen`` (the attempts before this dispatch) tells whether
        this dispatch counted one more; without it such a call reads as landed."""
        call = await self._call_row(run_id, key)
        if (
            call is None
            or call["status"] != CallStatus.DISPATCHED
            or call["dispatched_token"] != fencing_token
            or (attempts_seen is not None and call["attempts"] != attempts_seen + 1)
        ):
            return None
        return Dispatched(idempotency_key=IdempotencyKey(key), attempt=int(call["attempts"]))

    async def completed(
        self, run_id: str, key: str, fencing_token: int, outcome: Outcome
    ) -> Completed | None:
        """succeeded, failed, unknown leave that status with our completed token;
        not_applied puts the call back to planned with the completion fields cleared
        (attempts and dispatch fields stay): the event of this attempt tells it apart."""
        status = CALL_STATUS_AFTER[outcome]
        call = await self._call_row(run_id, key)
        if call is None or call["status"] != status:
            return None
        expected_token = None if outcome is Outcome.NOT_APPLIED else fencing_token
        if call["completed_token"] != expected_token:
            return None
        if not await self._journaled(
            run_id,
            CALL_EVENT[outcome],
            fencing_token=fencing_token,
            detail={"idempotency_key": key, "attempt": call["attempts"]},
        ):
            return None
        return Completed(idempotency_key=IdempotencyKey(key), outcome=outcome, status=status)

    async def advanced(
        self,
        run_id: str,
        key: str,
        fencing_token: int,
        outcome: Outcome,
        next_key: str,
        next_attempts_seen: int,
    ) -> Advanced | None:
        """``complete_call_v2`` with a next call: one transaction, so the completion
        (read back as :meth:`completed`) is the witness; the next call's dispatch of this
        attempt (``attempts_seen + 1``) under our token must be in the journal with it."""
        done = await self.completed(run_id, key, fencing_token, outcome)
        if done is None:
            return None
        attempt = next_attempts_seen + 1
        if not await self._journaled(
            run_id,
            "call_dispatched",
            fencing_token=fencing_token,
            detail={"idempotency_key": next_key, "attempt": attempt},
        ):
            return None
        return Advanced(
            idempotency_key=IdempotencyKey(key),
            outcome=outcome,
            next_key=IdempotencyKey(next_key),
            attempt=attempt,
        )

    async def batched(
        self, run_id: str, fencing_token: int, completions: Sequence[tuple[str, Outcome]]
    ) -> Batched | None:
        """``complete_calls``: one transaction, so its first call's completion (read back as
        :meth:`completed`) is the witness for the whole batch."""
        first_key, first_outcome = completions[0]
        if await self.completed(run_id, first_key, fencing_token, first_outcome) is None:
            return None
        return Batched(
            idempotency_keys=tuple(IdempotencyKey(k) for k, _ in completions),
            outcomes=tuple(o for _, o in completions),
        )

    async def recorded(
        self,
        run_id: str,
        fencing_token: int,
        turn: int,
        finish: bool,
        dispatched: Sequence[str] = (),
    ) -> Recorded | None:
        """``record_turn``: the ``turn_recorded`` event of this turn under our
        token (a lease records a turn once; the checkpoint, the finish and the dispatch of
        the ``dispatched`` calls are in its transaction). Its state_version is the version
        the write left; each dispatched call is then at its first attempt (the calls of a
        turn recorded now were never sent before)."""
        rows = await self.executor.read(
            """SELECT e.state_version FROM runledger.run_events e
               WHERE e.run_id = %s AND e.kind = 'turn_recorded' AND e.fencing_token = %s
                 AND e.detail @> %s::jsonb
               ORDER BY e.event_id DESC LIMIT 1""",
            (run_id, fencing_token, Jsonb({"turn": turn})),
        )
        if not rows:
            return None
        for call_id in dispatched:
            key = f"{run_id}:{turn}:{call_id}"
            if not await self._journaled(
                run_id,
                "call_dispatched",
                fencing_token=fencing_token,
                detail={"idempotency_key": key, "attempt": 1},
            ):
                return None
        return Recorded(
            run_id=RunId(run_id),
            turn=turn,
            state_version=int(rows[0]["state_version"]),
            finished=finish,
            attempts=(1,) * len(dispatched),
        )

    async def finished(
        self, run_id: str, fencing_token: int, status: FinishStatus
    ) -> Finished | None:
        """By the event, not the row: a paused or failed run may already have been
        requeued (and claimed again) by the time we look."""
        if await self._journaled(run_id, FINISH_EVENT[status], fencing_token=fencing_token):
            return Finished(run_id=RunId(run_id), status=FINISHED_STATUS[status])
        return None

    async def released(
        self, run_id: str, fencing_token: int, reason: str | None = None
    ) -> Released | None:
        """By the event: a lease that is gone may have been cancelled or taken over."""
        if await self._journaled(run_id, "lease_released", fencing_token=fencing_token):
            return Released(run_id=RunId(run_id), reason=reason)
        return None

    # -- operator writes: the event after the mark is the witness ------------------------

    async def resolved(
        self, key: str, resolution: Resolution, actor: str, mark: int
    ) -> Resolved | None:
        call = await self._call_row(None, key)
        if call is None or not await self._journaled(
            call["run_id"],
            "call_resolved",
            actor=actor,
            after=mark,
            detail={"idempotency_key": key, "resolution": str(resolution)},
        ):
            return None
        return Resolved(
            idempotency_key=IdempotencyKey(key),
            resolution=resolution,
            status=RESOLVED_STATUS[resolution],
        )

    async def decided(self, key: str, approval: Approval, actor: str, mark: int) -> Decided | None:
        call = await self._call_row(None, key)
        if call is None or not await self._journaled(
            call["run_id"],
            DECIDED_EVENT[approval],
            actor=actor,
            after=mark,
            detail={"idempotency_key": key},
        ):
            return None
        return Decided(
            idempotency_key=IdempotencyKey(key), approval=approval, status=DECIDED_STATUS[approval]
        )

    async def requeued(self, run_id: str, actor: str, mark: int) -> Requeued | None:
        if await self._journaled(
            run_id, "run_requeued", actor=actor, after=mark, detail={"after": "retry_run"}
        ):
            return Requeued(run_id=RunId(run_id))
        return None

    async def prunable(self, before: dt.datetime) -> int:
        """How many runs ``prune_runs(before, ...)`` would delete now."""
        rows = await self.executor.read(
            "SELECT count(*) AS n FROM runledger.runs"
            " WHERE status = ANY (%s::text[]) AND finished_at < %s",
            (FINISHED_RUNS, before),
        )
        return int(rows[0]["n"])

    async def pruned(self, before: dt.datetime, counted: int) -> Pruned | None:
        """Nothing left to prune although ``counted`` runs were: the prune landed."""
        if counted and not await self.prunable(before):
            return Pruned(runs=counted)
        return None
