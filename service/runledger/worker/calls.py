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
from runledger.db.sqlstate import describe
from runledger.flows import (
    Flow,
    NotApplied,
    Tool,
    ToolContext,
    Unknowable,
    invoke,
    using_tool_context,
)
from runledger.model import Approval, Call, CallSender, CallStatus, Outcome, evolve
from runledger.worker import recovery, tracing
from runledger.worker.crash import CrashPoints
from runledger.worker.evidence import Trail
from runledger.worker.liveness import process_gone
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
from runledger.worker.writes import NOT_SENT, Writes

log = logging.getLogger(__name__)


class Settled(Enum):
    """How one call ended for this holder."""

    DONE = "done"  # succeeded or failed, journaled
    PAUSED = "paused"  # unknown: the run pauses for a person
    AWAITING_APPROVAL = "awaiting_approval"  # not sent: the run pauses for a person's approval
    TOOL_MISSING = "tool_missing"  # planned, and this code has no such tool


class Looked(Enum):
    """What the crash-loop guard learned of a ``lookup`` call in flight (:meth:`Calls.look_up`)."""

    SUCCEEDED = "succeeded"  # journaled: the receipt the lookup found, or its sender's result
    # certainly without effect: its sender released it unsent, or the lookup found nothing
    # once no sender could still be sending it (left dispatched, for the guard)
    NO_EFFECT = "no_effect"
    OPEN = "open"  # it may have taken effect: the lookup failed or the provider cannot tell


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


def sent_earlier(active: ActiveRun, call: Call) -> bool:
    """Whether the call is in flight from an earlier holder of the run, which may still be
    sending it (docs/leases.md: a session that ended is no evidence that its process did)."""
    return (
        call.status is CallStatus.DISPATCHED
        and call.dispatched_token is not None
        and call.dispatched_token < active.claim.fencing_token
    )


def _sender_gone(seen: CallSender) -> bool:
    """Whether the process that sent the call is found gone on this host
    (:func:`runledger.worker.liveness.process_gone`): the process that claimed the run
    under the sender's token (``call_sender``), or one its worker registered before the
    send."""
    return (
        seen.process is not None
        and seen.registered_at is not None
        and seen.dispatched_at is not None
        and seen.registered_at <= seen.dispatched_at  # the process that sent it
        and process_gone(seen.process)
    )


# how a send of this holder ended (the window it left, what it has in hand), not journaled
Ended = tuple[Known, tuple[Any, dict[str, Any] | None]]


def _ended(known: Known, in_hand: tuple[Any, dict[str, Any] | None]) -> dict[str, Any] | None:
    """How this holder's send ended, as ``release_call`` says it, from the window it left."""
    match known.window:
        case Window.RETURNED:
            return _returned(*in_hand)
        case Window.AMBIGUOUS:
            return {"ended": "raised", "error": known.error}
        case Window.NOT_APPLIED:
            return {"ended": "not_applied", "reason": known.reason}
    return None


def _returned(result: Any, receipt: dict[str, Any] | None) -> dict[str, Any]:
    return {"ended": "returned", "result": jsonable(result), "receipt": receipt}


def _raised(exc: BaseException) -> dict[str, Any]:
    """A tool that raised: certainly not applied (``NotApplied``), or ambiguous."""
    if isinstance(exc, NotApplied):
        return {"ended": "not_applied", "reason": exc.reason}
    return {"ended": "raised", "error": error_of(exc)}


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
            sender_active=sent_earlier(active, call),
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
        # the key's send times and this holder's steps: evidence if the call ends unknown.
        # A key sent before this holder took it has its first send in the journal, read
        # only if the call is sent or looked up (_know_first_send)
        trail = Trail(
            sent=call.dispatched_at,
            first_known=dispatched is not None or not call.attempts,
            clock=self.writes.store.clock,
        )
        sends = Backoff(self.limits)
        asks = Backoff(self.limits)
        # how this holder's own send of the call ended, while that is not journaled yet:
        # if the run is lost meanwhile, the next holder is told (release_call) rather than
        # wait for this lease to expire
        ended: list[Ended | None] = [None]
        try:
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
                        await self.writes.complete(
                            active, call, Outcome.UNKNOWN, trail.attach(error), None
                        )
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
                        ended[0] = None
                        if outcome is Outcome.NOT_APPLIED:  # back to planned, same key
                            known = evolve(known, window=Window.PLANNED)
                            continue
                        return Settled.DONE, sent
                    case recovery.Probe():
                        # dispatched, not sent: recovered as a call found in flight
                        check_boundary(active)
                        await self._know_first_send(active, call, trail)
                        log.info(
                            "call may have been sent before a failover: recovering it",
                            extra={"run_id": active.run_id, "key": call.idempotency_key},
                        )
                        attempt = await self.writes.dispatch(
                            active, call, attempts_seen=known.attempts + known.tries
                        )
                        trail.dispatched()
                        known = evolve(
                            known, window=Window.IN_FLIGHT, suspect=False, attempts=attempt
                        )
                    case recovery.AwaitSender():
                        known, in_hand = await self._await_sender(active, call, known, trail)
                    case recovery.Lookup(backoff=wait):
                        assert tool is not None
                        if wait:
                            await asks.sleep()
                        else:
                            asks = Backoff(self.limits)
                        known, in_hand = await self._lookup(
                            active, tool, call, attempt, known, trail
                        )
                    case recovery.Dispatch(backoff=wait):
                        assert tool is not None
                        if wait:
                            await sends.sleep()
                        try:
                            attempt, known, in_hand = await self._send(
                                active, tool, call, known, trail, dispatched, ended
                            )
                        except errors.SenderActive:
                            # the database found the earlier sender still on its way (a
                            # lookup made before proves nothing): wait for it, then ask
                            known = evolve(known, sender_active=True, looked_up=LookedUp.NOT_ASKED)
                            continue
                        dispatched = None
                        ended[0] = (known, in_hand)  # read only if the run is lost
        except Exception:
            # the lease was refused, or the worker hit an error and hands the run back:
            # told before it does, so the next holder finds the release (with the result)
            told = None if ended[0] is None else _ended(*ended[0])
            if told is not None:
                # in the background too: a release that waits out a failover goes on if
                # the run is fenced meanwhile
                release = self.writes.release_send(active, call.idempotency_key, told)
                await asyncio.shield(self.writes.track(active, release, busy=False))
            raise
        except BaseException:  # cancelled (fenced locally): not held up by the release
            told = None if ended[0] is None else _ended(*ended[0])
            if told is not None:
                self.writes.track(
                    active, self.writes.release_send(active, call.idempotency_key, told), busy=False
                )
            raise

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
        trail: Trail,
        dispatched: int | None = None,
        ended: list[Ended | None] | None = None,
    ) -> tuple[int, Known, tuple[Any, dict[str, Any] | None]]:
        """``dispatch_call`` (committed before the tool runs), then invoke the tool. With
        ``dispatched`` the dispatch committed already (with the previous call's result).
        ``ended``: how the previous send ended, cleared once this one is dispatched (from
        then on it is this send that is in flight)."""
        c = active.claim
        if dispatched is None:
            check_boundary(active)
            await self._know_first_send(active, call, trail)
            self.crash.hit("before_dispatch", tool.name)
            # attempts only grow while we hold the lease: the count before this send
            attempt = await self.writes.dispatch(
                active, call, attempts_seen=known.attempts + known.tries, to_send=True
            )
        else:
            attempt = dispatched
        trail.dispatched()
        if ended is not None:
            ended[0] = None
        try:
            self.crash.hit("after_dispatch", tool.name)
            check_deadline(active)  # no call starts after the local deadline
        except BaseException:
            unsent = self.writes.release_send(active, call.idempotency_key, NOT_SENT)
            self.writes.track(active, unsent, busy=False)
            raise
        sent = evolve(
            known,
            tries=known.tries + 1,
            suspect=False,
            looked_up=LookedUp.NOT_ASKED,
            lookups_failed=0,
            lookup_error=None,
        )
        ctx = self._tool_ctx(active, call, attempt, trail)
        timeout = tool.timeout or self.limits.tool_timeout
        started = time.monotonic()
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
            trail.add(
                "send",
                started,
                ctx.observed,
                attempt=attempt,
                ended="not_applied",
                reason=na.reason,
            )
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
            trail.add(
                "send", started, ctx.observed, attempt=attempt, ended="raised", error=error_of(exc)
            )
            return (
                attempt,
                evolve(sent, window=Window.AMBIGUOUS, error=error_of(exc)),
                (None, None),
            )
        self.crash.hit("after_effect", tool.name)
        # no step: a call whose tool returned is journaled as succeeded, never unknown
        return attempt, evolve(sent, window=Window.RETURNED), unpack(value)

    async def _lookup(
        self,
        active: ActiveRun,
        tool: Tool[Any],
        call: Call,
        attempt: int,
        known: Known,
        trail: Trail,
    ) -> tuple[Known, tuple[Any, dict[str, Any] | None]]:
        """Ask the provider whether the key took effect; its answer is the receipt."""
        assert tool.lookup_fn is not None
        await self._know_first_send(active, call, trail)
        ctx = self._tool_ctx(active, call, attempt, trail)
        timeout = tool.timeout or self.limits.tool_timeout
        started = time.monotonic()
        try:
            with using_tool_context(ctx):
                found = await invoke(tool.lookup_fn, (ctx,), timeout=timeout)
        except Unknowable as exc:
            observed = [*ctx.observed, exc.facts] if exc.facts else ctx.observed
            trail.add("lookup", started, observed, attempt=attempt, saw="unknowable")
            return evolve(known, looked_up=LookedUp.UNKNOWABLE, unknowable=exc.reason), (
                None,
                None,
            )
        except Exception as exc:
            trail.add(
                "lookup", started, ctx.observed, attempt=attempt, saw="failed", error=error_of(exc)
            )
            failed = evolve(
                known,
                looked_up=LookedUp.FAILED,
                lookups_failed=known.lookups_failed + 1,
                lookup_error=error_of(exc),
            )
            return failed, (None, None)
        if found is None:
            trail.add("lookup", started, ctx.observed, attempt=attempt, saw="not_found")
            return evolve(known, looked_up=LookedUp.NOT_FOUND), (None, None)
        receipt = jsonable(found)
        if not isinstance(receipt, dict):
            receipt = {"value": receipt}
        return evolve(known, looked_up=LookedUp.FOUND), (receipt, receipt)

    async def _know_first_send(self, active: ActiveRun, call: Call, trail: Trail) -> None:
        """Before this holder's first send or lookup of a call an earlier holder sent: the
        key's first send, which the journal keeps (one read of the run's events; the
        age a provider's lookup judges its retention by)."""
        if trail.first_known:
            return
        trail.first_sent = await self.writes.store.first_dispatch(
            active.run_id, call.idempotency_key
        )
        trail.first_known = True

    def _tool_ctx(self, active: ActiveRun, call: Call, attempt: int, trail: Trail) -> ToolContext:
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
            first_sent_at=trail.first_sent,
            sent_at=trail.sent,
            # never ahead of the database's clock: a landing wait never ends early
            clock=self.writes.store.clock.earliest,
        )

    def _abandon(
        self, active: ActiveRun, tool: Tool[Any], call: Call, work: asyncio.Future[Any]
    ) -> None:
        """The run was fenced locally while its tool was running.

        An async tool is cancelled. A plain ``def`` tool cannot be stopped (it runs in a
        thread): when it returns, its result is offered to the database anyway, which
        accepts it only if this lease is still current, and otherwise refuses it -- the
        refusal is recorded as a ``stale_write_rejected`` event.

        Either way, once the tool has ended, the send's end is released to the run's next
        holder (``release_call``), which waits for it before it looks the call up or sends
        it again: until then this process may still be sending it.
        """
        if inspect.iscoroutinefunction(tool.fn):
            work.cancel()
            self.writes.track(active, self._cancelled(active, call, work), busy=False)
            return
        self.writes.track(active, self._late_result(active, call, work))

    async def _cancelled(self, active: ActiveRun, call: Call, work: asyncio.Future[Any]) -> None:
        """The cancelled async tool has unwound: it is sending nothing any more."""
        await asyncio.wait({work})
        if work.cancelled():
            ended: dict[str, Any] = {"ended": "cancelled"}
        elif (failure := work.exception()) is not None:
            ended = _raised(failure)
        else:  # it returned before the cancellation reached it
            ended = _returned(*unpack(work.result()))
        await self.writes.release_send(active, call.idempotency_key, ended)

    async def _late_result(self, active: ActiveRun, call: Call, work: asyncio.Future[Any]) -> None:
        key = call.idempotency_key
        try:
            value = await work
        except Exception as exc:  # ambiguous (or not applied): the next holder recovers it
            await self.writes.release_send(active, key, _raised(exc))
            return
        result, receipt = unpack(value)
        try:
            await self.writes.complete(active, call, Outcome.SUCCEEDED, result, receipt)
        except errors.LeaseLost as exc:
            await self.writes.report_stale(active, exc)
            await self.writes.release_send(active, key, _returned(result, receipt))
        except Exception as exc:  # not journaled here: handed over, the result with it
            log.warning(
                "late result not journaled: %s; released to the run's next holder",
                describe(exc),
                extra={"run_id": active.run_id, "key": key},
            )
            log.debug("the late result's failed write", exc_info=exc)
            await self.writes.release_send(active, key, _returned(result, receipt))

    async def _own_release(self, active: ActiveRun, call: Call) -> None:
        """This worker sent the call under an earlier lease and is still releasing it
        (the database failed the release: a full disk): wait for that release, which may
        carry the tool's result, before the call is judged. The database's answer alone
        would be "its lease expired without word from it"."""
        pending = self.writes.releasing(active.run_id, call.idempotency_key)
        if pending is None:
            return
        log.info(
            "waiting for this worker's release of the call from its earlier lease",
            extra={"run_id": active.run_id, "key": call.idempotency_key},
        )
        while not pending.done():
            check_boundary(active)
            await asyncio.wait({pending}, timeout=0.25)

    async def look_up(self, active: ActiveRun, tool: Tool[Any], call: Call, trail: Trail) -> Looked:
        """For the crash-loop guard (:mod:`runledger.worker.giving_up`): a call of a
        ``lookup`` tool found in flight, recovered as :meth:`settle` would recover it --
        its earlier sender waited for, the provider asked -- up to where it would be sent
        again: nothing is sent. What settles it is journaled (succeeded, with the receipt
        found or the result its sender released); anything else is left to the guard.
        ``trail`` gathers the steps."""
        known = Known(
            window=Window.IN_FLIGHT,
            safety=tool.safety,
            tool=call.tool,
            max_attempts=tool.max_attempts,
            attempts=call.attempts,
            sender_active=sent_earlier(active, call),
        )
        in_hand: tuple[Any, dict[str, Any] | None] = (None, None)
        asks = Backoff(self.limits)
        while True:
            match recovery.next_step(known):
                case recovery.AwaitSender():
                    known, in_hand = await self._await_sender(active, call, known, trail)
                case recovery.Lookup(backoff=wait):
                    if wait:
                        await asks.sleep()
                    known, in_hand = await self._lookup(
                        active, tool, call, call.attempts, known, trail
                    )
                case recovery.Complete(outcome=Outcome.SUCCEEDED):
                    result, receipt = in_hand
                    await self.writes.complete(active, call, Outcome.SUCCEEDED, result, receipt)
                    return Looked.SUCCEEDED
                case recovery.Dispatch() if (
                    known.window is Window.PLANNED or known.looked_up is LookedUp.NOT_FOUND
                ):
                    return Looked.NO_EFFECT
                case _:
                    return Looked.OPEN

    async def _await_sender(
        self, active: ActiveRun, call: Call, known: Known, trail: Trail
    ) -> tuple[Known, tuple[Any, dict[str, Any] | None]]:
        """Wait until the call's earlier sender can no longer be sending it: it released
        the call, its process is found gone on this host, or its lease expires by the
        database clock. A release with the tool's result is journaled as that result;
        otherwise the call is recovered as in flight, from a fresh lookup."""
        c = active.claim
        store = self.writes.store
        await self._own_release(active, call)
        delay, waited = 0.02, False
        started = time.monotonic()
        while True:
            check_boundary(active)
            seen = await store.call_sender(
                c.run_id, c.lease_id, c.fencing_token, call.idempotency_key
            )
            if seen is None:  # no longer in flight: not reached while this lease holds
                return evolve(known, sender_active=False), (None, None)
            if seen.until is None:
                released = seen.released or {}
                ended = released.get("ended")
                if ended is None:  # its lease ran out without a word: was it its process?
                    ended = "process_gone" if _sender_gone(seen) else "lease_expired"
                log.info(
                    "the call's earlier sender is done with it",
                    extra={
                        "run_id": c.run_id,
                        "key": call.idempotency_key,
                        "ended": ended,
                    },
                )
                trail.add(
                    "earlier sender",
                    started,
                    worker=seen.sender,
                    fencing_token=seen.sender_token,
                    attempt=seen.attempt,
                    sent_at=seen.dispatched_at,
                    ended=ended,
                    error=released.get("error"),
                )
                if seen.dispatched_at is not None:
                    trail.sent = seen.dispatched_at
                fresh = evolve(
                    known,
                    sender_active=False,
                    looked_up=LookedUp.NOT_ASKED,
                    sender_ended=ended,
                )
                if released.get("ended") == "not_sent":  # certainly not sent: send it
                    return evolve(fresh, window=Window.PLANNED), (None, None)
                if released.get("ended") == "returned" and "result" in released:
                    receipt = released.get("receipt")
                    return evolve(fresh, window=Window.RETURNED), (
                        released["result"],
                        receipt if isinstance(receipt, dict) else None,
                    )
                return fresh, (None, None)
            if _sender_gone(seen):
                gone = {"ended": "process_gone", "process": seen.process}
                await store.release_call(
                    c.run_id,
                    c.lease_id,
                    c.fencing_token,
                    call.idempotency_key,
                    self.writes.worker_id,
                    gone,
                )
                continue
            if not waited:
                waited = True
                log.info(
                    "waiting for the call's earlier sender",
                    extra={
                        "run_id": c.run_id,
                        "key": call.idempotency_key,
                        "sender": seen.sender,
                        "sender_token": seen.sender_token,
                        "until": seen.until.isoformat(),
                    },
                )
            left = (seen.until - seen.now).total_seconds()
            await asyncio.sleep(max(0.0, min(delay, left)))
            delay = min(delay * 2, 0.5)
