"""What an operator calls: the reads of runs, calls and events, and the operator's writes
(resolve, approve, deny, cancel, retry, prune), for the client, the console and the CLI.

Every method is one statement (or a few reads) through the
:class:`~runledger.db.execution.Executor`. An operator write carries no fencing token to
recognise it by: the run's last event id is noted before sending (one extra read), and
its read-back (:class:`~runledger.db.landed.ReadBacks`) looks for the event after it. The
CLI's and the console's synchronous reads of whole pages are :mod:`runledger.db.inspect`,
:mod:`runledger.db.event_log` and :mod:`runledger.db.chain`.
"""

from __future__ import annotations

import datetime as dt
from typing import Any, LiteralString

from runledger.db import reads
from runledger.db.execution import Executor
from runledger.db.landed import ReadBacks
from runledger.db.results import (
    DECIDED_STATUS,
    PRUNED_RECORD_COUNTS,
    RESOLVED_STATUS,
    Decided,
    Pruned,
    PrunedRecords,
    Requeued,
    Resolved,
)
from runledger.db.rows import Journal
from runledger.db.validate import check_text, word
from runledger.model import (
    Approval,
    Call,
    Event,
    IdempotencyKey,
    Resolution,
    Run,
    RunId,
)

MAX_DENY_REASON_CHARS = 1000  # runledger._cap('reason')
MAX_NOTE_CHARS = 4000  # runledger._cap('note')


class OperatorStore:
    """The operator's side of the contract, over one :class:`Executor`."""

    def __init__(self, executor: Executor) -> None:
        self.executor = executor
        self.landed = ReadBacks(executor)

    @classmethod
    async def connect(cls, url: str, **options: Any) -> OperatorStore:
        """A store on a pool of its own: :meth:`Executor.connect`'s options."""
        return cls(await Executor.connect(url, **options))

    async def close(self) -> None:
        await self.executor.close()

    # -- reads -------------------------------------------------------------------------

    async def get_run(self, run_id: str) -> Run:
        return await reads.get_run(self.executor, run_id)

    async def get_call(self, idempotency_key: str) -> Call:
        return await reads.get_call(self.executor, idempotency_key)

    async def list_calls(self, run_id: str) -> list[Call]:
        return await reads.list_calls(self.executor, run_id)

    async def list_turns(self, run_id: str) -> list[tuple[int, list[dict[str, Any]]]]:
        return await reads.list_turns(self.executor, run_id)

    async def list_events(self, run_id: str) -> list[Event]:
        return await reads.list_events(self.executor, run_id)

    async def load_journal(self, run_id: str) -> Journal:
        return await reads.load_journal(self.executor, run_id)

    async def known_flows(self) -> set[str]:
        """Every ``name@version`` a worker ever registered."""
        return await reads.known_flows(self.executor)

    async def prunable(self, before: dt.datetime) -> int:
        """How many runs a prune of those finished before ``before`` would delete now."""
        return await self.landed.prunable(before)

    # -- writes ------------------------------------------------------------------------

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
        receipt_json = self.executor.json("receipt", receipt, obj=True, nullable=True)
        mark = await self._call_mark(key)
        await self.executor.write(
            "SELECT runledger.resolve_call(%s, %s, %s::jsonb, %s, %s)",
            (key, chosen.value, receipt_json, actor, note),
            result=lambda _: Resolved(
                idempotency_key=key, resolution=chosen, status=RESOLVED_STATUS[chosen]
            ),
            landed=lambda: self.landed.resolved(key, chosen, actor, mark),
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
        await self.executor.write(
            sql,
            (key, actor, text),
            result=lambda _: Decided(
                idempotency_key=key, approval=approval, status=DECIDED_STATUS[approval]
            ),
            landed=lambda: self.landed.decided(key, approval, actor, mark),
        )

    async def _call_mark(self, key: str) -> int:
        rows = await self.executor.read(
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
        await self.executor.read(  # safe to repeat: cancelling a cancelled run is a no-op
            "SELECT runledger.cancel_run(%s, %s, %s)",
            (run_id, actor, reason),
            fields={"run_id": run_id},
        )

    async def retry_run(self, run_id: str, actor: str) -> None:
        check_text("run id", run_id)
        check_text("actor", actor)
        mark = await self.landed.event_mark(run_id)
        await self.executor.write(
            "SELECT runledger.retry_run(%s, %s)",
            (run_id, actor),
            result=lambda _: Requeued(run_id=RunId(run_id)),
            landed=lambda: self.landed.requeued(run_id, actor, mark),
            fields={"run_id": run_id},
        )

    async def prune_cutoff(self, older_than: dt.timedelta) -> dt.datetime:
        """The database clock minus ``older_than``: what "finished before" means for a
        prune, read once so that every batch of it deletes against the same instant."""
        rows = await self.executor.read(
            "SELECT runledger.now() - %s::interval AS before", (older_than,)
        )
        before: dt.datetime = rows[0]["before"]
        return before

    async def prune_batch(self, before: dt.datetime, keep_events: bool, limit: int) -> int:
        """One batch of a prune: at most ``limit`` finished runs, oldest first.
        Safe to repeat (sent again after a lost connection): a batch whose
        acknowledgement was lost is deleted, and the next call deletes the next one."""
        rows = await self.executor.read(
            "SELECT runledger.prune_runs_v2(%s, %s, %s) AS pruned", (before, keep_events, limit)
        )
        return int(rows[0]["pruned"])

    async def prune_records(
        self, before: dt.datetime, keep_events: bool, limit: int
    ) -> PrunedRecords:
        """One batch of the retention of what runs leave behind (``prune_records``): the
        checkpoints made before ``before`` (at most ``limit`` heads) with their heads, the
        chains of runs already gone unless ``keep_events``, and at most ``limit`` each of
        the records of pruned checkpoints and chains, workers gone since, old commit
        guarantees. Call again while ``more``. Safe to repeat, as :meth:`prune_batch`."""
        rows = await self.executor.read(
            "SELECT * FROM runledger.prune_records(%s, %s, %s)", (before, keep_events, limit)
        )
        row = rows[0]
        counts = {f: int(row[f]) for f in PRUNED_RECORD_COUNTS}
        return PrunedRecords(**counts, more=bool(row["more"]))

    async def prune_runs(self, before: dt.datetime, keep_events: bool) -> int:
        """How many finished runs were deleted. Counted before sending, so that a prune
        whose acknowledgement was lost still reports the runs it deleted."""
        counted = await self.landed.prunable(before)
        done = await self.executor.write(
            "SELECT runledger.prune_runs(%s, %s) AS pruned",
            (before, keep_events),
            result=lambda rows: Pruned(runs=int(rows[0]["pruned"])),
            landed=lambda: self.landed.pruned(before, counted),
        )
        return done.runs
