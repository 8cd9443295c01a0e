"""The journaled agent loop for one claimed run.

1. The policy's decision is recorded (``record_turn``) before any tool runs, and a
   recorded turn is replayed, never decided again.
2. ``dispatch_call`` commits before the tool is invoked; ``complete_call`` commits the
   result and the provider's receipt before the next step.
3. A call found ``dispatched`` (the previous holder died mid-call) is recovered by its
   tool's safety class: ``lookup`` asks the provider, ``idempotent`` repeats with the
   same key, ``read_only`` reruns, ``unsafe`` becomes ``unknown`` and the run pauses.
4. A tool exception other than ``NotApplied``, or a timeout, is ambiguous: it is
   handled exactly like a crash after sending.
"""

from __future__ import annotations

import asyncio
import inspect
import logging
import time
from collections.abc import Coroutine
from typing import Any, NoReturn, TypeVar

from runledger import errors
from runledger.db.store import Store
from runledger.flows import (
    Flow,
    HistoryCall,
    HistoryTurn,
    InvalidDecision,
    NotApplied,
    PolicyContext,
    Tool,
    ToolContext,
    invoke,
)
from runledger.model import Call, CallStatus, FinishStatus, Outcome, Safety
from runledger.worker.crash import CrashPoints
from runledger.worker.runs import (
    ActiveRun,
    Backoff,
    Draining,
    Limits,
    LocalLeaseExpired,
    MissingTool,
    Paused,
    PolicyFailed,
    error_of,
    jsonable,
    unpack,
)

__all__ = ["ActiveRun", "Draining", "Executor", "Limits", "LocalLeaseExpired", "Paused"]

log = logging.getLogger(__name__)

T = TypeVar("T")


class Executor:
    def __init__(
        self,
        store: Store,
        flows: dict[str, Flow],
        *,
        worker_id: str,
        limits: Limits,
        crash: CrashPoints | None = None,
    ) -> None:
        self.store = store
        self.flows = flows
        self.worker_id = worker_id
        self.limits = limits
        self.crash = crash or CrashPoints(None)
        self._late: set[asyncio.Task[None]] = set()

    # -- entry -----------------------------------------------------------------------

    async def execute(self, active: ActiveRun) -> None:
        """Drive one run until it finishes, pauses, is released, or its lease is lost."""
        claim = active.claim
        fields = {
            "run_id": claim.run_id,
            "worker_id": self.worker_id,
            "fencing_token": claim.fencing_token,
        }
        try:
            await self._drive(active)
        except errors.LeaseLost as exc:
            log.warning("write refused: lease lost, dropping run", extra=fields)
            await self._report_stale(active, exc)
        except (Draining, LocalLeaseExpired) as exc:
            if isinstance(exc, Draining):
                await self._release(active)
            else:
                log.warning("local lease deadline passed, stopping run", extra=fields)
        except Exception as exc:  # a bug or the database gone: the lease expires, run is retaken
            log.exception("run failed in the worker", extra={**fields, "error": repr(exc)})

    async def _report_stale(self, active: ActiveRun, exc: errors.LeaseLost) -> None:
        """Record the refusal in its own transaction; shielded from the run's cancellation."""
        try:
            await asyncio.shield(
                self.store.report_stale_write(
                    active.run_id,
                    self.worker_id,
                    active.claim.lease_id,
                    active.claim.fencing_token,
                    active.operation,
                    str(exc),
                )
            )
        except Exception:
            log.exception("could not record the refused write", extra={"run_id": active.run_id})

    async def _release(self, active: ActiveRun) -> None:
        try:
            await self.store.release_lease(
                active.run_id, active.claim.lease_id, active.claim.fencing_token
            )
        except errors.LeaseLost as exc:
            await self._report_stale(active, exc)

    # -- the loop --------------------------------------------------------------------

    def _check_deadline(self, active: ActiveRun) -> None:
        if time.monotonic() >= active.deadline:
            raise LocalLeaseExpired(active.run_id)

    def _check_boundary(self, active: ActiveRun) -> None:
        self._check_deadline(active)
        if active.draining:
            raise Draining(active.run_id)

    async def _finish(
        self, active: ActiveRun, status: FinishStatus, result: Any, reason: str | None
    ) -> None:
        c = active.claim
        await self._write(
            active,
            "finish_run",
            self.store.finish_run(c.run_id, c.lease_id, c.fencing_token, status, result, reason),
        )
        log.info(
            "run finished",
            extra={
                "run_id": c.run_id,
                "worker_id": self.worker_id,
                "fencing_token": c.fencing_token,
                "status": str(status),
                "reason": reason,
            },
        )

    async def _drive(self, active: ActiveRun) -> None:
        c = active.claim
        flow = self.flows[f"{c.flow}@{c.flow_version}"]
        max_turns = flow.max_turns or self.limits.max_turns
        max_calls = flow.max_calls or self.limits.max_calls
        journal = await self.store.load_journal(c.run_id)
        if journal.stalled_claims > self.limits.max_stalled_claims:
            await self._give_up(active, journal.calls, journal.stalled_claims)
            return
        state_version = c.state_version
        completed = int((c.state or {}).get("completed_turns", 0))
        while True:
            turns, calls = journal.turns, journal.calls
            if turns:
                last, decided = turns[-1]
                if not decided:
                    summary = {"turns": len(turns), "calls": len(calls)}
                    await self._finish(active, FinishStatus.SUCCEEDED, summary, None)
                    return
                pending = [x for x in calls if x.turn == last and not x.status.terminal]
                if pending:
                    try:
                        for call in pending:
                            await self._settle(active, flow, call)
                    except Paused as p:
                        reason = f"call {p.key} is unknown: reconcile it"
                        await self._finish(active, FinishStatus.PAUSED, None, reason)
                        return
                    except MissingTool as exc:
                        missing = {"tool": str(exc)}
                        await self._finish(active, FinishStatus.FAILED, missing, "tool_missing")
                        return
                    # every call of the turn is final now: read the journal again
                    journal = await self.store.load_journal(c.run_id)
                    continue
                if completed < last + 1:  # also after an operator resolved the last call
                    state_version = await self._write(
                        active,
                        "checkpoint",
                        self.store.checkpoint(
                            c.run_id,
                            c.lease_id,
                            c.fencing_token,
                            state_version,
                            {"completed_turns": last + 1},
                        ),
                    )
                    completed = last + 1
            next_turn = len(turns)
            self._check_boundary(active)
            try:
                payload = await self._decide(active, flow, next_turn, turns, calls)
            except InvalidDecision as exc:
                await self._finish(active, FinishStatus.FAILED, error_of(exc), "invalid_decision")
                return
            except PolicyFailed as exc:
                error = error_of(exc.__cause__ or exc)
                await self._finish(active, FinishStatus.FAILED, error, "policy_error")
                return
            # max_turns counts turns with calls: the policy may always end the run
            if payload and next_turn >= max_turns:
                budget = {"max_turns": max_turns}
                await self._finish(active, FinishStatus.FAILED, budget, "budget_exceeded")
                return
            if len(calls) + len(payload) > max_calls:
                budget = {"max_calls": max_calls}
                await self._finish(active, FinishStatus.FAILED, budget, "budget_exceeded")
                return
            self._check_deadline(active)
            try:
                await self._write(
                    active,
                    "record_turn",
                    self.store.record_turn(
                        c.run_id, c.lease_id, c.fencing_token, next_turn, payload
                    ),
                )
            except errors.InvalidInput as exc:  # e.g. args the database cannot store
                await self._finish(active, FinishStatus.FAILED, error_of(exc), "invalid_decision")
                return
            journal = await self.store.load_journal(c.run_id)

    async def _give_up(self, active: ActiveRun, calls: list[Call], stalled: int) -> None:
        """Claimed too often without progress. A call that may have been sent is marked
        unknown and the run pauses for a person; otherwise it fails as ``crash_loop``."""
        in_flight = [x for x in calls if x.status in (CallStatus.DISPATCHED, CallStatus.UNKNOWN)]
        if not in_flight:
            claims = {"claims_without_progress": stalled}
            await self._finish(active, FinishStatus.FAILED, claims, "crash_loop")
            return
        for call in in_flight:
            if call.status is CallStatus.DISPATCHED:
                error = {"reason": "crash_loop", "claims_without_progress": stalled}
                await self._complete(active, call, Outcome.UNKNOWN, error, None)
        reason = f"crash_loop: {stalled} claims without progress with call(s) in flight"
        await self._finish(active, FinishStatus.PAUSED, None, reason)

    async def _decide(
        self,
        active: ActiveRun,
        flow: Flow,
        turn: int,
        turns: list[tuple[int, list[dict[str, Any]]]],
        calls: list[Call],
    ) -> list[dict[str, Any]]:
        assert flow.policy_fn is not None
        by_turn: dict[int, list[Call]] = {}
        for x in calls:
            by_turn.setdefault(x.turn, []).append(x)
        history = [
            HistoryTurn(
                turn=t,
                calls=tuple(
                    HistoryCall(
                        call_id=x.call_id,
                        tool=x.tool,
                        args=x.args,
                        status=str(x.status),
                        result=x.result,
                        error=x.error,
                    )
                    for x in by_turn.get(t, [])
                ),
            )
            for t, _ in turns
        ]
        ctx = PolicyContext(
            run_id=active.run_id, flow=flow.ref, input=active.claim.input, turn=turn
        )
        backoff = Backoff(self.limits)
        for attempt in range(1, self.limits.policy_attempts + 1):
            try:
                decided = await invoke(
                    flow.policy_fn, (ctx, history), timeout=self.limits.policy_timeout
                )
                break
            except InvalidDecision:
                raise
            except Exception as exc:
                if attempt == self.limits.policy_attempts:
                    raise PolicyFailed(str(exc)) from exc
                log.warning(
                    "policy failed, retrying",
                    extra={"run_id": active.run_id, "attempt": attempt, "error": repr(exc)},
                )
                await backoff.sleep()
            self._check_boundary(active)
        return flow.normalize(decided)

    # -- one call ----------------------------------------------------------------------

    async def _settle(self, active: ActiveRun, flow: Flow, call: Call) -> None:
        """Bring one non-final call to succeeded/failed, or raise Paused."""
        tool = flow.tools.get(call.tool)
        if call.status is CallStatus.UNKNOWN:
            raise Paused(call.idempotency_key)
        if tool is None:
            # The decision names a tool this code no longer has: nothing safe to do. A
            # call that may have been sent stays reconcilable.
            if call.status is CallStatus.DISPATCHED:
                await self._pause(active, call, {"reason": f"tool {call.tool} is not in this flow"})
            raise MissingTool(call.tool)
        if call.status is CallStatus.DISPATCHED:
            await self._recover(active, tool, call)
        else:
            await self._attempts(active, tool, call)

    async def _recover(self, active: ActiveRun, tool: Tool[Any], call: Call) -> None:
        """A call in flight when its previous holder stopped: decide by safety class."""
        log.info(
            "recovering in-flight call",
            extra={
                "run_id": active.run_id,
                "key": call.idempotency_key,
                "safety": str(tool.safety),
                "fencing_token": active.claim.fencing_token,
            },
        )
        if tool.safety is Safety.UNSAFE:
            why = {"reason": "in flight when its worker stopped; unsafe to repeat"}
            await self._pause(active, call, {**why, "attempts": call.attempts})
        if tool.safety is Safety.LOOKUP and await self._looked_up(
            active, tool, call, call.attempts
        ):
            return
        await self._attempts(active, tool, call)

    async def _looked_up(
        self, active: ActiveRun, tool: Tool[Any], call: Call, attempt: int
    ) -> bool:
        """Ask the provider whether the key took effect; complete the call if it did."""
        assert tool.lookup_fn is not None
        ctx = self._tool_ctx(active, call, attempt)
        backoff = Backoff(self.limits)
        for n in range(1, tool.max_attempts + 1):
            try:
                found = await invoke(
                    tool.lookup_fn, (ctx,), timeout=tool.timeout or self.limits.tool_timeout
                )
                break
            except Exception as exc:
                if n == tool.max_attempts:
                    await self._pause(active, call, {"reason": "lookup failed", **error_of(exc)})
                await backoff.sleep()
        if found is None:
            return False
        receipt = jsonable(found)
        if not isinstance(receipt, dict):
            receipt = {"value": receipt}
        await self._complete(active, call, Outcome.SUCCEEDED, receipt, receipt)
        return True

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

    async def _attempts(self, active: ActiveRun, tool: Tool[Any], call: Call) -> None:
        """Dispatch and invoke, repeating with the same key where the safety class allows."""
        c = active.claim
        backoff = Backoff(self.limits)
        tries = 0
        while True:
            tries += 1
            self._check_boundary(active)
            self.crash.hit("before_dispatch", tool.name)
            attempt = await self._write(
                active,
                "dispatch_call",
                self.store.dispatch_call(
                    c.run_id, c.lease_id, c.fencing_token, call.idempotency_key
                ),
            )
            self.crash.hit("after_dispatch", tool.name)
            self._check_deadline(active)  # no call starts after the local deadline
            ctx = self._tool_ctx(active, call, attempt)
            work = asyncio.ensure_future(
                invoke(tool.fn, (ctx,), call.args, timeout=tool.timeout or self.limits.tool_timeout)
            )
            try:
                value = await asyncio.shield(work)
            except asyncio.CancelledError:
                self._abandon(active, tool, call, work)
                raise
            except NotApplied as na:
                if na.retry and tries < tool.max_attempts:
                    # back to planned at once: nobody may take a certain "no" for "maybe"
                    await self._complete(
                        active,
                        call,
                        Outcome.NOT_APPLIED,
                        {"reason": na.reason, "not_applied": True},
                        None,
                    )
                    await backoff.sleep()
                    continue
                await self._complete(
                    active, call, Outcome.FAILED, {"reason": na.reason, "not_applied": True}, None
                )
                return
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
                if tool.safety is Safety.UNSAFE:
                    why = {"reason": "ambiguous failure of an unsafe tool"}
                    await self._pause(active, call, {**why, **error_of(exc)})
                if tool.safety is Safety.LOOKUP and await self._looked_up(
                    active, tool, call, attempt
                ):
                    return
                if tries >= tool.max_attempts:
                    if tool.safety is Safety.IDEMPOTENT:
                        exhausted = {"reason": "retries exhausted", **error_of(exc)}
                        await self._pause(active, call, exhausted)
                    # read_only, or lookup said it did not happen: certainly no effect
                    await self._complete(active, call, Outcome.FAILED, error_of(exc), None)
                    return
                await backoff.sleep()
                continue
            self.crash.hit("after_effect", tool.name)
            result, receipt = unpack(value)
            await self._complete(active, call, Outcome.SUCCEEDED, result, receipt)
            self.crash.hit("after_complete", tool.name)
            return

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
        self._track(active, self._late_result(active, call, work))

    def _track(self, active: ActiveRun, aw: Any) -> None:
        """Keep a background task of this run (a tool thread's result, a write in flight)."""
        task = asyncio.ensure_future(aw)
        task.set_name(f"late:{active.run_id}")
        self._late.add(task)
        task.add_done_callback(self._late.discard)

    def busy(self, run_id: str) -> bool:
        """Whether a tool thread or a write of this run is still in flight."""
        return any(t.get_name() == f"late:{run_id}" and not t.done() for t in self._late)

    async def settle(self, timeout: float) -> None:
        """Give background results and writes up to ``timeout`` s to reach the database."""
        if self._late:
            await asyncio.wait(set(self._late), timeout=timeout)

    async def _late_result(self, active: ActiveRun, call: Call, work: asyncio.Future[Any]) -> None:
        try:
            value = await work
        except BaseException:
            return  # ambiguous or cancelled: the next holder recovers the call
        result, receipt = unpack(value)
        try:
            await self._complete(active, call, Outcome.SUCCEEDED, result, receipt)
        except errors.LeaseLost as exc:
            await self._report_stale(active, exc)
        except Exception:
            log.exception("late result not recorded", extra={"run_id": active.run_id})

    async def _pause(self, active: ActiveRun, call: Call, error: dict[str, Any]) -> NoReturn:
        """Record the call as ``unknown`` (not failed: it may have happened) and pause."""
        await self._complete(active, call, Outcome.UNKNOWN, error, None)
        raise Paused(call.idempotency_key)

    async def _complete(
        self,
        active: ActiveRun,
        call: Call,
        outcome: Outcome,
        result: Any,
        receipt: dict[str, Any] | None,
    ) -> None:
        c = active.claim
        await self._write(
            active,
            "complete_call",
            self.store.complete_call(
                c.run_id,
                c.lease_id,
                c.fencing_token,
                call.idempotency_key,
                outcome,
                result,
                receipt,
            ),
        )

    async def _write(self, active: ActiveRun, operation: str, coro: Coroutine[Any, Any, T]) -> T:
        """Send one write of this run's lease. Once sent it is not cut off midway: the
        database decides. If the run is fenced locally meanwhile and the database then
        refuses the write, the refusal is still recorded."""
        active.operation = operation
        task = asyncio.ensure_future(coro)
        try:
            return await asyncio.shield(task)
        except asyncio.CancelledError:
            task.add_done_callback(lambda t: self._after_fenced_write(active, t))
            self._track(active, task)
            raise

    def _after_fenced_write(self, active: ActiveRun, task: asyncio.Future[Any]) -> None:
        if task.cancelled():
            return
        exc = task.exception()
        if isinstance(exc, errors.LeaseLost):
            self._track(active, self._report_stale(active, exc))
