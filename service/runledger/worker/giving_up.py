"""A run this worker gives up on: claimed too often without progress (``crash_loop``) or
holding JSON this code cannot decode (``undecodable_run``). It fails with the reason,
unless a call of it may have taken effect: such calls become ``unknown`` and the run
pauses for a person (a possible effect is never written off)."""

from __future__ import annotations

import logging
from typing import Any

import psycopg

from runledger import errors
from runledger.db.worker_store import WorkerStore
from runledger.model import Approval, Call, CallStatus, FinishStatus, Outcome
from runledger.worker import poison
from runledger.worker.poison import UndecodableRun
from runledger.worker.runs import (
    MAX_PAUSE_REASON,
    ActiveRun,
    awaiting_approval_reason,
    in_flight_reason,
)
from runledger.worker.writes import Writes

log = logging.getLogger(__name__)


class GivingUp:
    def __init__(self, store: WorkerStore, writes: Writes, *, worker_id: str) -> None:
        self.store = store
        self.writes = writes
        self.worker_id = worker_id

    async def crash_loop(self, active: ActiveRun, stalled: int) -> None:
        """Claimed too often without progress. A call that may have been sent is marked
        unknown and the run pauses for a person; otherwise it fails as ``crash_loop``."""
        why = f"crash_loop: {stalled} claims without progress"
        try:
            calls = await self.store.list_calls(active.run_id)
        except (errors.RunLedgerError, psycopg.Error):
            raise
        except Exception as exc:
            # not even the calls can be read: whether one is in flight cannot be known,
            # so the run waits for a person rather than failing (which writes it off)
            log.warning(
                "crash_loop: the run's calls cannot be read; pausing it",
                extra={"run_id": active.run_id, "error": repr(exc)},
            )
            reason = (
                f"{why}, and its calls cannot be read ({type(exc).__name__}): inspect them "
                f"with `runledger status {active.run_id}`, then `runledger retry "
                f"{active.run_id}` or `runledger cancel {active.run_id}`"
            )
            await self.writes.end(active, FinishStatus.PAUSED, None, reason)
            return
        claims = {"claims_without_progress": stalled}
        await self.fail_or_pause(active, calls, "crash_loop", claims, why)

    async def undecodable(self, active: ActiveRun, exc: UndecodableRun) -> None:
        """A run whose input, state or journal this code cannot decode: failed alone (or
        paused, if a call of it may have taken effect), with where and why."""
        log.warning(
            "run holds JSON that cannot be decoded: not driving it",
            extra={
                "run_id": active.run_id,
                "worker_id": self.worker_id,
                "fencing_token": active.claim.fencing_token,
                "what": exc.what,
                "at": [f.at for f in exc.found[: poison.MAX_FOUND]],
            },
        )
        calls = await self.store.list_calls(active.run_id)  # each row decodes on its own
        why = f"undecodable_run: the run's {exc.what} holds JSON this worker cannot decode"
        await self.fail_or_pause(active, calls, "undecodable_run", exc.detail(), why)

    async def fail_or_pause(
        self,
        active: ActiveRun,
        calls: list[Call],
        reason: str,
        detail: dict[str, Any],
        why: str,
    ) -> None:
        """Give up on the run: ``failed`` with ``reason`` and ``detail``, unless a call
        may be in flight (``dispatched``, or ``unknown`` already): a possible effect is
        never written off, so such calls become ``unknown`` and the run pauses."""
        in_flight = [x for x in calls if x.status in (CallStatus.DISPATCHED, CallStatus.UNKNOWN)]
        if not in_flight:
            await self.writes.end(active, FinishStatus.FAILED, detail, reason)
            return
        for call in in_flight:
            if call.status is CallStatus.DISPATCHED:
                error = {"reason": reason, **detail}
                await self.writes.complete(active, call, Outcome.UNKNOWN, error, None)
        keys = [x.idempotency_key for x in in_flight]
        # resolving those requeues the run only once no call awaits approval: say so too
        waits = [x.idempotency_key for x in calls if x.approval is Approval.PENDING]
        more = ""
        if waits:
            more = f"; {awaiting_approval_reason(*waits)}"
            if len(more) > MAX_PAUSE_REASON // 2:
                more = (
                    f"; {len(waits)} call(s) await approval "
                    f"(`runledger status {active.run_id}` lists them)"
                )
        text = in_flight_reason(why, active.run_id, keys, reserve=len(more)) + more
        await self.writes.end(active, FinishStatus.PAUSED, None, text)
