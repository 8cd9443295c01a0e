"""One loop per call: ask :func:`~runledger.worker.recovery.next_step`, carry the step
out, feed back what happened, until the call settles.

The loop is the only place that touches the tool, the provider's lookup and the
journal for a call; every decision is in :mod:`runledger.worker.recovery`. A call
settles to :class:`Settled` -- a paused run is a value, not an exception. Fencing
(``Draining``, ``LocalLeaseExpired``, ``LeaseLost``, cancellation) still unwinds.
"""

from __future__ import annotations

import asyncio
import inspect
import logging
import time
from enum import Enum
from typing import Any

from runledger import errors
from runledger.flows import Flow, NotApplied, Tool, ToolContext, invoke, using_tool_context
from runledger.model import Approval, Call, CallStatus, Outcome, evolve
from runledger.worker import recovery, tracing
from runledger.worker.crash import CrashPoints
from runledger.worker.recovery import Known, LookedUp, Window
from runledger.worker.runs import (
    ActiveRun,
    Backoff,
    Draining,
    Limits,
    LocalLeaseExpired,
    detached,
    error_of,
    jsonable,
    unpack,
)
from runledger.worker.writes import Writes

log = logging.getLogger(__name__)


class Settled(Enum):
    """How one call ended for this holder."""

    DONE = "done"  # succeeded or failed, journaled
    PAUSED = "paused"  # unknown: the run pauses for a person
    AWAITING_APPROVAL = "awaiting_approval"  # not sent: the run pauses for a person's approval
    TOOL_MISSING = "tool_missing"  # planned, and this code has no such tool


def suspect(active: ActiveRun, call: Call) -> bool:
    """Whether the call may have been sent on a timeline a failover lost although this
    timeline never dispatched it: planned, never dispatched, of a turn from the run's
    ``failover_turn`` on (docs/failover.md)."""
    return (
        active.failover_turn is not None
        and call.turn >= active.failover_turn
        and call.status is CallStatus.PLANNED
        and call.dispatched_by is None
    )


def check_deadline(active: ActiveRun) -> None:
    """The lease's local deadline, and the listener's: with a session lock, nothing is
    sent once the listener's last heartbeat is older than its budget, even before the
    watchdog has fenced the run (an event loop that was held up)."""
    now = time.monotonic()
    if now >= active.deadline or now >= active.vouch.until:
        raise LocalLeaseExpired(active.run_id)


def check_boundary(active: ActiveRun) -> None:
    check_deadline(active)
    if active.draining:
        raise Draining(active.run_id)


class Calls:
    def __init__(self, writes: Writes, *, limits: Limits, crash: CrashPoints) -> None:
        self.writes = writes
        self.limits = limits
        self.crash = crash

    @tracing.call_span
    async def settle(
        self,
        active: ActiveRun,
        flow: Flow,
        call: Call,
        *,
        next_call: Call | None = None,
        dispatched: int | None = None,
    ) -> tuple[Settled, int | None]:
        """Bring one call to succeeded or failed, or to unknown (paused); a call awaiting
        approval is left as it is.

        ``next_call``: the planned call that runs right after this one. When this call
        completes succeeded or failed and the lease allows another send, the completion
        dispatches it in the same transaction, and its attempt number is returned with
        the settlement. ``dispatched``: this call's own attempt number, when the previous
        call's completion dispatched it; it is then sent at once."""
        tool = flow.tools.get(call.tool)
        doubted = suspect(active, call)
        known = Known(
            window=recovery.window_of(call.status, call.approval),
            safety=tool.safety if tool is not None else None,
            tool=call.tool,
            max_attempts=tool.max_attempts if tool is not None else 1,
            attempts=call.attempts,
            suspect=doubted,
            failover=doubted or call.dispatched_by == "failover",
        )
        if known.window is Window.IN_FLIGHT:
            log.info(
                "recovering in-flight call",
                extra={
                    "run_id": active.run_id,
                    "key": call.idempotency_key,
                    "safety": str(known.safety),
                    "fencing_token": active.claim.fencing_token,
                },
            )
        attempt = call.attempts  # the attempt number the tool and its lookup see
        in_hand: tuple[Any, dict[str, Any] | None] = (None, None)  # result, receipt
        sends = Backoff(self.limits)
        asks = Backoff(self.limits)
        while True:
            step = recovery.next_step(known)
            if dispatched is not None and step != recovery.Dispatch(backoff=False):
                raise AssertionError(f"{call.idempotency_key} was dispatched, next is {step}")
            match step:
                case recovery.Reuse():
                    return Settled.DONE, None
                case recovery.Pause():
                    return Settled.PAUSED, None
                case recovery.AwaitApproval():
                    return Settled.AWAITING_APPROVAL, None
                case recovery.ToolMissing():
                    return Settled.TOOL_MISSING, None
                case recovery.MarkUnknown(error=error):
                    await self.writes.complete(active, call, Outcome.UNKNOWN, error, None)
                    return Settled.PAUSED, None
                case recovery.Complete(outcome=outcome, error=error):
                    final = outcome in (Outcome.SUCCEEDED, Outcome.FAILED)
                    nxt = self._next_to_send(active, flow, next_call) if final else None
                    if nxt is not None:
                        # the next call's dispatch commits with this result: from here on
                        # it is before that dispatch, as in the separate writes
                        self.crash.hit("before_dispatch", nxt.tool)
                    if outcome is Outcome.SUCCEEDED:
                        result, receipt = in_hand
                        sent = await self.writes.complete(
                            active, call, outcome, result, receipt, next_call=nxt
                        )
                        if known.window is Window.RETURNED:
                            assert tool is not None
                            self.crash.hit("after_complete", tool.name)
                        return Settled.DONE, sent
                    sent = await self.writes.complete(
                        active, call, outcome, error, None, next_call=nxt
                    )
                    if outcome is Outcome.NOT_APPLIED:  # back to planned, same key
                        known = evolve(known, window=Window.PLANNED)
                        continue
                    return Settled.DONE, sent
                case recovery.Probe():
                    # dispatched, not sent: recovered as a call found in flight
                    check_boundary(active)
                    log.info(
                        "call may have been sent before a failover: recovering it",
                        extra={"run_id": active.run_id, "key": call.idempotency_key},
                    )
                    attempt = await self.writes.dispatch(
                        active, call, attempts_seen=known.attempts + known.tries
                    )
                    known = evolve(known, window=Window.IN_FLIGHT, suspect=False, attempts=attempt)
                case recovery.Lookup(backoff=wait):
                    assert tool is not None
                    if wait:
                        await asks.sleep()
                    else:
                        asks = Backoff(self.limits)
                    known, in_hand = await self._lookup(active, tool, call, attempt, known)
                case recovery.Dispatch(backoff=wait):
                    assert tool is not None
                    if wait:
                        await sends.sleep()
                    attempt, known, in_hand = await self._send(
                        active, tool, call, known, dispatched
                    )
                    dispatched = None

    def _next_to_send(self, active: ActiveRun, flow: Flow, call: Call | None) -> Call | None:
        """``call``, if its first step is a plain send (planned, needing no approval, a
        tool of this flow) and the lease allows another send now; else None."""
        if call is None or call.status is not CallStatus.PLANNED:
            return None
        if call.approval is Approval.PENDING or call.tool not in flow.tools:
            return None
        if suspect(active, call):
            return None  # its first step may not be a send
        if active.draining or time.monotonic() >= active.deadline:
            return None  # this call completes alone; the boundary stops the next step
        return call

    async def _send(
        self,
        active: ActiveRun,
        tool: Tool[Any],
        call: Call,
        known: Known,
        dispatched: int | None = None,
    ) -> tuple[int, Known, tuple[Any, dict[str, Any] | None]]:
        """``dispatch_call`` (committed before the tool runs), then invoke the tool. With
        ``dispatched`` the dispatch committed already (with the previous call's result)."""
        c = active.claim
        if dispatched is None:
            check_boundary(active)
            self.crash.hit("before_dispatch", tool.name)
            # attempts only grow while we hold the lease: the count before this send
            attempt = await self.writes.dispatch(
                active, call, attempts_seen=known.attempts + known.tries
            )
        else:
            attempt = dispatched
        self.crash.hit("after_dispatch", tool.name)
        check_deadline(active)  # no call starts after the local deadline
        sent = evolve(
            known,
            tries=known.tries + 1,
            suspect=False,
            looked_up=LookedUp.NOT_ASKED,
            lookups_failed=0,
            lookup_error=None,
        )
        ctx = self._tool_ctx(active, call, attempt)
        timeout = tool.timeout or self.limits.tool_timeout
        # the task copies the context when it is created: runledger.tool_context() in the
        # tool (and in its thread, for a plain def) is this call's, whatever happens here
        with using_tool_context(ctx):
            work, answer = detached(invoke(tool.fn, (ctx,), call.args, timeout=timeout))
        try:
            value = await answer
        except asyncio.CancelledError:
            self._abandon(active, tool, call, work)
            raise
        except NotApplied as na:
            return (
                attempt,
                evolve(sent, window=Window.NOT_APPLIED, reason=na.reason, retry=na.retry),
                (None, None),
            )
        except Exception as exc:  # includes TimeoutError: ambiguous, like a crash
            log.warning(
                "tool call ambiguous",
                extra={
                    "run_id": c.run_id,
                    "key": call.idempotency_key,
                    "attempt": attempt,
                    "error": repr(exc),
                },
            )
            return (
                attempt,
                evolve(sent, window=Window.AMBIGUOUS, error=error_of(exc)),
                (None, None),
            )
        self.crash.hit("after_effect", tool.name)
        return attempt, evolve(sent, window=Window.RETURNED), unpack(value)

    async def _lookup(
        self, active: ActiveRun, tool: Tool[Any], call: Call, attempt: int, known: Known
    ) -> tuple[Known, tuple[Any, dict[str, Any] | None]]:
        """Ask the provider whether the key took effect; its answer is the receipt."""
        assert tool.lookup_fn is not None
        ctx = self._tool_ctx(active, call, attempt)
        timeout = tool.timeout or self.limits.tool_timeout
        try:
            with using_tool_context(ctx):
                found = await invoke(tool.lookup_fn, (ctx,), timeout=timeout)
        except Exception as exc:
            failed = evolve(
                known,
                looked_up=LookedUp.FAILED,
                lookups_failed=known.lookups_failed + 1,
                lookup_error=error_of(exc),
            )
            return failed, (None, None)
        if found is None:
            return evolve(known, looked_up=LookedUp.NOT_FOUND), (None, None)
        receipt = jsonable(found)
        if not isinstance(receipt, dict):
            receipt = {"value": receipt}
        return evolve(known, looked_up=LookedUp.FOUND), (receipt, receipt)

    def _tool_ctx(self, active: ActiveRun, call: Call, attempt: int) -> ToolContext:
        c = active.claim
        return ToolContext(
            run_id=c.run_id,
            flow=f"{c.flow}@{c.flow_version}",
            turn=call.turn,
            call_id=call.call_id,
            tool=call.tool,
            idempotency_key=call.idempotency_key,
            fencing_token=c.fencing_token,
            attempt=attempt,
            lease_deadline=lambda: active.deadline,
        )

    def _abandon(
        self, active: ActiveRun, tool: Tool[Any], call: Call, work: asyncio.Future[Any]
    ) -> None:
        """The run was fenced locally while its tool was running.

        An async tool is cancelled. A plain ``def`` tool cannot be stopped (it runs in a
        thread): when it returns, its result is offered to the database anyway, which
        accepts it only if this lease is still current, and otherwise refuses it -- the
        refusal is recorded as a ``stale_write_rejected`` event.
        """
        if inspect.iscoroutinefunction(tool.fn):
            work.cancel()
            return
        self.writes.track(active, self._late_result(active, call, work))

    async def _late_result(self, active: ActiveRun, call: Call, work: asyncio.Future[Any]) -> None:
        try:
            value = await work
        except BaseException:
            return  # ambiguous or cancelled: the next holder recovers the call
        result, receipt = unpack(value)
        try:
            await self.writes.complete(active, call, Outcome.SUCCEEDED, result, receipt)
        except errors.LeaseLost as exc:
            await self.writes.report_stale(active, exc)
        except Exception:
            log.exception("late result not recorded", extra={"run_id": active.run_id})
