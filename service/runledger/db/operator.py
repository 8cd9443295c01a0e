"""The operator's writes of the store: resolve, approve, deny, cancel, retry, prune.

Split from :mod:`runledger.db.store` by entity; :class:`~runledger.db.store.Store` is
these plus the worker's writes. As every write there, each method calls one contract
function; a write that is not safe to repeat goes through ``_write`` with its read-back.
"""

from __future__ import annotations

import datetime as dt
from typing import Any, LiteralString

from runledger.db.execution import word
from runledger.db.landed import ReadBacks
from runledger.db.results import (
    DECIDED_STATUS,
    RESOLVED_STATUS,
    Decided,
    Pruned,
    Requeued,
    Resolved,
)
from runledger.db.validate import check_text
from runledger.model import Approval, IdempotencyKey, Resolution, RunId

MAX_DENY_REASON_CHARS = 1000  # runledger._cap('reason')
MAX_NOTE_CHARS = 4000  # runledger._cap('note')


class OperatorWrites(ReadBacks):
    # -- operator side -------------------------------------------------------------
    # No fencing token to recognise our own write by: the run's last event id is noted
    # before sending (one extra read), and the read-back looks for the event after it.

    async def resolve_call(
        self,
        idempotency_key: str,
        resolution: Resolution | str,
        receipt: dict[str, Any] | None,
        actor: str,
        note: str | None,
    ) -> None:
        check_text("idempotency key", idempotency_key)
        check_text("actor", actor)
        if note is not None:
            check_text("note", note)
        key = IdempotencyKey(idempotency_key)
        chosen = word("resolution", resolution, Resolution)
        receipt_json = self._json("receipt", receipt, obj=True, nullable=True)
        mark = await self._call_mark(key)
        await self._write(
            "SELECT runledger.resolve_call(%s, %s, %s::jsonb, %s, %s)",
            (key, chosen.value, receipt_json, actor, note),
            result=lambda _: Resolved(
                idempotency_key=key, resolution=chosen, status=RESOLVED_STATUS[chosen]
            ),
            landed=lambda: self.resolved(key, chosen, actor, mark),
        )

    async def approve_call(
        self, idempotency_key: str, *, actor: str, note: str | None = None
    ) -> None:
        """Approve a call awaiting approval (``approve_call``): the next holder dispatches it.
        :class:`~runledger.errors.RunNotFound` for an unknown key,
        :class:`~runledger.errors.InvalidTransition` for a call that does not await approval
        or whose run is running, :class:`~runledger.errors.InvalidInput` for bad arguments."""
        check_text("actor", actor)
        if note is not None:
            check_text("note", note, max_chars=MAX_NOTE_CHARS, min_chars=0)  # '' is a note too
        await self._decide(idempotency_key, Approval.APPROVED, actor, note)

    async def deny_call(self, idempotency_key: str, *, reason: str, actor: str) -> None:
        """Deny a call awaiting approval (``deny_call``): it fails, never sent, with error
        ``{"reason": "denied", "note": reason, "actor": actor}``. Errors as
        :meth:`approve_call`; the reason is required."""
        check_text("actor", actor)
        check_text("reason", reason, max_chars=MAX_DENY_REASON_CHARS)
        await self._decide(idempotency_key, Approval.DENIED, actor, reason)

    async def _decide(
        self, idempotency_key: str, approval: Approval, actor: str, text: str | None
    ) -> None:
        check_text("idempotency key", idempotency_key)
        key = IdempotencyKey(idempotency_key)
        sql: LiteralString = (
            "SELECT runledger.approve_call(%s, %s, %s)"
            if approval is Approval.APPROVED
            else "SELECT runledger.deny_call(%s, %s, %s)"
        )
        mark = await self._call_mark(key)
        await self._write(
            sql,
            (key, actor, text),
            result=lambda _: Decided(
                idempotency_key=key, approval=approval, status=DECIDED_STATUS[approval]
            ),
            landed=lambda: self.decided(key, approval, actor, mark),
        )

    async def _call_mark(self, key: str) -> int:
        rows = await self._read(
            "SELECT coalesce(max(e.event_id), 0) AS mark FROM runledger.run_events e"
            " WHERE e.run_id = (SELECT c.run_id FROM runledger.run_calls c"
            " WHERE c.idempotency_key = %s)",
            (key,),
        )
        return int(rows[0]["mark"])

    async def cancel_run(self, run_id: str, actor: str, reason: str | None) -> None:
        check_text("run id", run_id)
        check_text("actor", actor)
        if reason is not None:
            check_text("reason", reason)
        await self._read(  # safe to repeat: cancelling a cancelled run is a no-op
            "SELECT runledger.cancel_run(%s, %s, %s)",
            (run_id, actor, reason),
            fields={"run_id": run_id},
        )

    async def retry_run(self, run_id: str, actor: str) -> None:
        check_text("run id", run_id)
        check_text("actor", actor)
        mark = await self.event_mark(run_id)
        await self._write(
            "SELECT runledger.retry_run(%s, %s)",
            (run_id, actor),
            result=lambda _: Requeued(run_id=RunId(run_id)),
            landed=lambda: self.requeued(run_id, actor, mark),
            fields={"run_id": run_id},
        )

    async def prune_cutoff(self, older_than: dt.timedelta) -> dt.datetime:
        """The database clock minus ``older_than``: what "finished before" means for a
        prune, read once so that every batch of it deletes against the same instant."""
        rows = await self._read("SELECT runledger.now() - %s::interval AS before", (older_than,))
        before: dt.datetime = rows[0]["before"]
        return before

    async def prune_batch(self, before: dt.datetime, keep_events: bool, limit: int) -> int:
        """One batch of ``prune_runs_v2``: at most ``limit`` finished runs, oldest first.
        Safe to repeat (sent again after a lost connection): a batch whose
        acknowledgement was lost is deleted, and the next call deletes the next one."""
        rows = await self._read(
            "SELECT runledger.prune_runs_v2(%s, %s, %s) AS pruned", (before, keep_events, limit)
        )
        return int(rows[0]["pruned"])

    async def prune_runs(self, before: dt.datetime, keep_events: bool) -> int:
        """How many finished runs were deleted. Counted before sending, so that a prune
        whose acknowledgement was lost still reports the runs it deleted."""
        counted = await self.prunable(before)
        done = await self._write(
            "SELECT runledger.prune_runs(%s, %s) AS pruned",
            (before, keep_events),
            result=lambda rows: Pruned(runs=int(rows[0]["pruned"])),
            landed=lambda: self.pruned(before, counted),
        )
        return done.runs
