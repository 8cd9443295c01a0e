"""A run this worker gives up on: claimed too often without progress (``crash_loop``) or
holding JSON this code cannot decode (``undecodable_run``). It fails with the reason,
unless a call of it may have taken effect: such calls become ``unknown`` and the run
pauses for a person (a possible effect is never written off).

Before it gives up on a crash loop, a call of a ``lookup`` tool found in flight is looked
up (its earlier sender waited for first, as any recovery does): found, it is journaled as
succeeded with the provider's receipt, and the run goes on -- that is progress; found
without effect, it goes back to ``planned`` and is not in flight any more. Only what a
lookup cannot settle becomes ``unknown``, with the evidence a person decides by: the
run's claims that made no progress (who held each, what it sent, how its lease ended, from
the run's events) and the lookups. The lookups are made at the first claim over the
limit only: if that claim ends without a word (its worker died, perhaps in the lookup),
the next one gives the run up without them."""

from __future__ import annotations

import datetime as dt
import logging
from collections.abc import Sequence
from typing import Any

import psycopg

from runledger import errors
from runledger.db.worker_store import WorkerStore
from runledger.flows import Flow
from runledger.model import Approval, Call, CallStatus, Event, FinishStatus, Outcome, Safety
from runledger.worker import poison
from runledger.worker.calls import Calls, Looked
from runledger.worker.evidence import MAX_STEPS, Trail
from runledger.worker.poison import UndecodableRun
from runledger.worker.runs import (
    MAX_PAUSE_REASON,
    ActiveRun,
    awaiting_approval_reason,
    in_flight_reason,
)
from runledger.worker.writes import Writes

log = logging.getLogger(__name__)

MAX_CLAIMS = MAX_STEPS // 2  # the last claims kept in a call's evidence
# what of an event's detail a stalled claim's evidence shows
SHOWN = (
    "idempotency_key",
    "attempt",
    "ended",
    "by",
    "reason",
    "current_owner",
    "operation",
    "timeline",
    "lossless",
)


def _seen(e: Event) -> dict[str, Any]:
    """One event under a stalled claim's lease, as a fact of the evidence."""
    at = e.at.astimezone(dt.UTC).isoformat(timespec="milliseconds")
    fact: dict[str, Any] = {"event": e.kind, "at": at}
    fact.update({k: e.detail[k] for k in SHOWN if e.detail.get(k) is not None})
    return fact


def _ended(by: Event, seen: list[dict[str, Any]]) -> str:
    """How a lease ended, told by the claim that came after it."""
    if by.kind == "takeover":
        holder = by.detail.get("holder")
        return "lease_expired" if holder == "expired" else str(holder or "taken_over")
    released = [f for f in seen if f["event"] == "lease_released"]
    reason = released[-1].get("reason") if released else None
    return f"released ({reason})" if reason else "released"


def stalled_claims(events: Sequence[Event]) -> list[tuple[Event, list[dict[str, Any]], str]]:
    """The claims of ``events`` (a run's, oldest first: :meth:`WorkerStore.last_claims`)
    that the next claim ended, each with the events under its lease and how it ended;
    the last claim, the caller's own, is left out."""
    found: list[tuple[Event, list[dict[str, Any]], str]] = []
    claim: Event | None = None
    seen: list[dict[str, Any]] = []
    for e in events:
        if e.kind in ("claimed", "takeover"):
            if claim is not None:
                found.append((claim, seen, _ended(e, seen)))
            claim, seen = e, []
        elif claim is not None:
            seen.append(_seen(e))
    return found


class GivingUp:
    def __init__(self, store: WorkerStore, writes: Writes, calls: Calls, *, worker_id: str) -> None:
        self.store = store
        self.writes = writes
        self.calls = calls
        self.worker_id = worker_id

    async def crash_loop(
        self, active: ActiveRun, flow: Flow, stalled: int, *, look_up: bool = True
    ) -> bool:
        """Claimed too often without progress. With ``look_up`` (the first claim over the
        limit), the calls of ``lookup`` tools found in flight are looked up first: when
        one is found (journaled succeeded), that is progress and the run goes on (True).
        Otherwise each call found without effect goes back to ``planned``; a call that
        may have been sent is marked unknown, with the evidence, and the run pauses for a
        person; without one it fails as ``crash_loop`` (False: the run is given up)."""
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
            return False
        claims = {"claims_without_progress": stalled}
        in_flight = [x for x in calls if x.status is CallStatus.DISPATCHED]
        trails: dict[str, Trail] = {}
        if in_flight:
            history = stalled_claims(await self.store.last_claims(active.run_id, stalled))
            for call in in_flight:
                trail = trails[call.idempotency_key] = Trail(
                    sent=call.dispatched_at, clock=self.store.clock
                )
                for claim, seen, ended in history[-MAX_CLAIMS:]:
                    trail.journaled(
                        "stalled claim",
                        claim.at,
                        seen,
                        worker=claim.actor,
                        fencing_token=claim.fencing_token,
                        ended=ended,
                    )
        found, no_effect = False, set()
        for call in in_flight if look_up else ():
            tool = flow.tools.get(call.tool)
            if tool is None or tool.safety is not Safety.LOOKUP or tool.lookup_fn is None:
                continue
            looked = await self.calls.look_up(active, tool, call, trails[call.idempotency_key])
            if looked is Looked.SUCCEEDED:
                found = True
            elif looked is Looked.NO_EFFECT:
                no_effect.add(call.idempotency_key)
        if found:
            log.info(
                "crash_loop: a lookup settled a call in flight; the run goes on",
                extra={"run_id": active.run_id, "worker_id": self.worker_id},
            )
            return True
        for call in in_flight:
            if call.idempotency_key in no_effect:
                error = {"reason": f"{why}; it took no effect", "not_applied": True}
                error = trails[call.idempotency_key].attach(error)
                await self.writes.complete(active, call, Outcome.NOT_APPLIED, error, None)
        left = [x for x in calls if x.idempotency_key not in no_effect]
        await self.fail_or_pause(active, left, "crash_loop", claims, why, trails)
        return False

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
        evidence: dict[str, Trail] | None = None,
    ) -> None:
        """Give up on the run: ``failed`` with ``reason`` and ``detail``, unless a call
        may be in flight (``dispatched``, or ``unknown`` already): a possible effect is
        never written off, so such calls become ``unknown`` (with their ``evidence``, by
        key) and the run pauses."""
        in_flight = [x for x in calls if x.status in (CallStatus.DISPATCHED, CallStatus.UNKNOWN)]
        if not in_flight:
            await self.writes.end(active, FinishStatus.FAILED, detail, reason)
            return
        for call in in_flight:
            if call.status is CallStatus.DISPATCHED:
                error = {"reason": reason, **detail}
                trail = (evidence or {}).get(call.idempotency_key)
                if trail is not None:
                    error = trail.attach(error)
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
