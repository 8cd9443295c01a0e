"""The journaled agent loop for one claimed run: the turns.

1. The policy's decision (a ``Decision`` or a bare list of calls) is recorded
   (``record_turn_v2``, with the provider-native ``record`` and, for the final decision,
   its ``output``) before any tool runs, and a recorded turn is replayed, never decided
   again. The history the policy sees carries each turn's record and each call's result
   and provider id; the final decision's output is the run's result.
2. Each call of the turn is settled by :class:`~runledger.worker.calls.Calls`, one loop
   per call carrying out the crash-window table of :mod:`runledger.worker.recovery`:
   ``dispatch_call`` commits before the tool is invoked, ``complete_call`` commits the
   result and the provider's receipt before the next step. For calls that run one after
   another, the result of one and the dispatch of the next are one commit
   (``complete_call_v2``).
3. A call that settles ``unknown`` pauses the run, and so does a call that awaits a
   person's approval (it is not sent; the other calls of its group run first); once every
   call of the turn is final the turn is due a checkpoint, then the policy decides the
   next turn. The checkpoint commits with that decision (``record_turn_v3``), and the
   final decision also ends the run: one commit each. A checkpoint still due when the run
   ends otherwise (fails, pauses, is handed back) is written on its own first.

The journal comes with the claim (``claim_runs_v3``) and is kept in memory for the rest
of the lease (:mod:`runledger.worker.journal`): nothing is read back after a write.
"""

from __future__ import annotations

import logging
from typing import Any

import psycopg

from runledger import errors
from runledger.db.rows import Journal
from runledger.db.store import Store
from runledger.flows import (
    Flow,
    HistoryCall,
    HistoryTurn,
    InvalidDecision,
    PolicyContext,
    Recordable,
    invoke,
)
from runledger.model import Approval, Call, CallStatus, FinishStatus, Outcome, Turn
from runledger.worker import poison
from runledger.worker.calls import Calls, Settled, check_boundary, check_deadline
from runledger.worker.crash import CrashPoints
from runledger.worker.groups import call_groups, settle_group
from runledger.worker.journal import LocalJournal
from runledger.worker.poison import UndecodableRun
from runledger.worker.runs import (
    MAX_PAUSE_REASON,
    ActiveRun,
    Backoff,
    Draining,
    Limits,
    LocalLeaseExpired,
    PolicyFailed,
    awaiting_approval_reason,
    error_of,
    in_flight_reason,
    pause_reason,
)
from runledger.worker.writes import Writes

__all__ = ["ActiveRun", "Draining", "Executor", "Limits", "LocalLeaseExpired", "call_groups"]

log = logging.getLogger(__name__)


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
        self.writes = Writes(store, worker_id=worker_id)
        self.calls = Calls(self.writes, limits=limits, crash=self.crash)

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
            await self.writes.report_stale(active, exc)
        except Draining:
            try:
                await self.writes.checkpoint_due(active)
            except errors.LeaseLost as exc:
                await self.writes.report_stale(active, exc)
                return
            await self.writes.release(active)
        except LocalLeaseExpired:
            log.warning("local lease deadline passed, stopping run", extra=fields)
        except Exception as exc:  # a bug or the database gone: say so, hand the run back
            log.exception("run failed in the worker", extra={**fields, "error": repr(exc)})
            await self._release_after_error(active, exc)

    async def _release_after_error(self, active: ActiveRun, exc: Exception) -> None:
        """Release the lease with the error in its event, so the run is retaken now rather
        than when the lease expires. A call in flight stays ``dispatched``: the next
        holder recovers it by its safety class. If the database is gone, the lease
        expires as before."""
        if self.writes.busy(active.run_id):
            return  # a write of this run is still in flight: let the lease expire
        try:
            try:
                await self.writes.checkpoint_due(active)
            except Exception as checkpoint_exc:  # the release still says why
                log.warning(
                    "could not write the checkpoint due before the release",
                    extra={"run_id": active.run_id, "error": repr(checkpoint_exc)},
                )
            await self.writes.release(active, reason="worker_error", error=error_of(exc))
        except Exception as release_exc:
            log.warning(
                "could not release the lease after the error; it will expire",
                extra={"run_id": active.run_id, "error": repr(release_exc)},
            )

    def busy(self, run_id: str) -> bool:
        """Whether a tool thread or a write of this run is still in flight."""
        return self.writes.busy(run_id)

    async def settle(self, timeout: float) -> None:
        """Give background results and writes up to ``timeout`` s to reach the database."""
        await self.writes.settle(timeout)

    # -- the turns ---------------------------------------------------------------------

    async def _finish(
        self, active: ActiveRun, status: FinishStatus, result: Any, reason: str | None
    ) -> None:
        await self.writes.checkpoint_due(active)
        await self.writes.finish(active, status, result, reason)

    async def _drive(self, active: ActiveRun) -> None:
        c = active.claim
        # Before anything of the run is loaded or decoded: a run that keeps crashing the
        # worker while loading must still end as crash_loop. claim_runs_v2 carries the
        # count (and the journal only for a run that made progress since its last claim).
        assert active.loaded is not None, "every claim comes from claim_runs_v3"
        stalled = active.loaded.stalled_claims
        active.failover_turn = active.loaded.failover_turn
        if stalled > self.limits.max_stalled_claims:
            await self._give_up(active, stalled)
            return
        try:
            for what, value in (("input", c.input), ("state", c.state)):
                found = poison.in_value(value, what)
                if found:
                    raise UndecodableRun(what, found)
            await self._turns(active)
        except UndecodableRun as exc:
            await self._undecodable(active, exc)

    async def _journal(self, active: ActiveRun) -> Journal:
        """The run's turns and calls, from the claim or else read; :class:`UndecodableRun`
        if any value of them is undecodable JSON."""
        run_id = active.run_id
        self.crash.hit("load_journal", run_id)
        loaded, active.loaded = active.loaded, None
        try:
            if loaded is not None and loaded.included:
                journal = loaded.journal()
            else:
                journal = await self.store.load_journal(run_id)
        except (errors.RunLedgerError, psycopg.Error):
            raise
        except Exception as exc:
            # the aggregated journal holds a value Python could not decode and could not
            # be unpacked: find it call by call (each call row decodes on its own)
            found = poison.in_calls(await self.store.list_calls(run_id))
            if found:
                raise UndecodableRun("journal", found) from exc
            raise  # something else: the catch-all releases; repeated, it is a crash_loop
        found = poison.in_turns(journal.turns) + poison.in_calls(journal.calls)
        if found:
            raise UndecodableRun("journal", found)
        return journal

    async def _turns(self, active: ActiveRun) -> None:
        c = active.claim
        flow = self.flows[f"{c.flow}@{c.flow_version}"]
        max_turns = flow.max_turns or self.limits.max_turns
        max_calls = flow.max_calls or self.limits.max_calls
        journal = LocalJournal(c.run_id, await self._journal(active))
        active.journal = journal
        active.state_version = c.state_version
        completed = int((c.state or {}).get("completed_turns", 0))
        while True:
            turns, calls = journal.turns, journal.calls
            if turns:
                last = turns[-1].turn
                if not turns[-1].calls:  # the final decision: its output is the result
                    result = turns[-1].output
                    if result is None:
                        result = {"turns": len(turns), "calls": len(calls)}
                    await self._finish(active, FinishStatus.SUCCEEDED, result, None)
                    return
                pending = [x for x in calls if x.turn == last and not x.status.terminal]
                if pending:
                    if not await self._settle_turn(active, flow, pending):
                        return  # paused or failed
                    continue  # every call of the turn is final now (the journal knows)
                if completed < last + 1:  # also after an operator resolved the last call
                    # due now, written with the next decision (or alone, if none comes)
                    active.checkpoint_due = {"completed_turns": last + 1}
                    completed = last + 1
            next_turn = len(turns)
            check_boundary(active)
            try:
                decision = await self._decide(active, flow, next_turn, turns, calls)
            except InvalidDecision as exc:
                await self._finish(active, FinishStatus.FAILED, error_of(exc), "invalid_decision")
                return
            except PolicyFailed as exc:
                error = error_of(exc.__cause__ or exc)
                await self._finish(active, FinishStatus.FAILED, error, "policy_error")
                return
            # the model answered, nothing of it is journaled yet
            self.crash.hit("after_decide", str(next_turn))
            payload = decision.calls
            # max_turns counts turns with calls: the policy may always end the run
            if payload and next_turn >= max_turns:
                budget = {"max_turns": max_turns}
                await self._finish(active, FinishStatus.FAILED, budget, "budget_exceeded")
                return
            if len(calls) + len(payload) > max_calls:
                budget = {"max_calls": max_calls}
                await self._finish(active, FinishStatus.FAILED, budget, "budget_exceeded")
                return
            check_deadline(active)
            # The final decision ends the run in the same commit -- unless a crash point
            # asks for the moment between the two (a decision recorded, the run not
            # finished: how a worker of the previous release leaves it)
            finish = not payload and not self.crash.wants("after_record_turn", str(next_turn))
            try:
                active.state_version = await self.writes.write(
                    active,
                    "record_turn",
                    self.store.record_turn_v3(
                        c.run_id,
                        c.lease_id,
                        c.fencing_token,
                        next_turn,
                        payload,
                        record=decision.record,
                        output=decision.output,
                        expected_version=active.state_version,
                        state=active.checkpoint_due,
                        finish=finish,
                    ),
                )
            except errors.InvalidInput as exc:  # e.g. args the database cannot store
                await self._finish(active, FinishStatus.FAILED, error_of(exc), "invalid_decision")
                return
            active.checkpoint_due = None
            self.crash.hit("after_record_turn", str(next_turn))
            journal.recorded(next_turn, payload, decision.record, decision.output)
            if finish:
                self.writes.finished(active, FinishStatus.SUCCEEDED, None)
                return

    async def _settle_turn(self, active: ActiveRun, flow: Flow, pending: list[Call]) -> bool:
        """Settle the open calls of the turn, group after group; False when the run was
        paused or failed for this. A single call followed by a single call dispatches
        that one with its own result (one commit)."""
        c = active.claim
        groups = call_groups(flow, pending)
        carried: int | None = None  # the next call's attempt, dispatched with a result
        for i, group in enumerate(groups):
            if len(group) == 1:
                after = groups[i + 1] if i + 1 < len(groups) else []
                nxt = after[0] if len(after) == 1 else None
                done, carried = await self.calls.settle(
                    active, flow, group[0], next_call=nxt, dispatched=carried
                )
                settled = [(group[0], done)]
            else:
                settled = await settle_group(self.calls, active, flow, group)
                carried = None
            paused = [x.idempotency_key for x, s in settled if s is Settled.PAUSED]
            waits = [x.idempotency_key for x, s in settled if s is Settled.AWAITING_APPROVAL]
            missing = [x for x, s in settled if s is Settled.TOOL_MISSING]
            if missing:
                tool = {"tool": missing[0].tool}
                await self._finish(active, FinishStatus.FAILED, tool, "tool_missing")
                return False
            if paused or waits:  # after every sibling of the group finished
                # name every call of the turn that awaits a person, later groups' too:
                # the run is requeued only once all are decided
                waits = [x.idempotency_key for x in pending if x.approval is Approval.PENDING]
                why = pause_reason(c.run_id, paused, waits)
                await self._finish(active, FinishStatus.PAUSED, None, why)
                return False
        return True

    async def _give_up(self, active: ActiveRun, stalled: int) -> None:
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
            await self._finish(active, FinishStatus.PAUSED, None, reason)
            return
        claims = {"claims_without_progress": stalled}
        await self._fail_or_pause(active, calls, "crash_loop", claims, why)

    async def _undecodable(self, active: ActiveRun, exc: UndecodableRun) -> None:
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
        await self._fail_or_pause(active, calls, "undecodable_run", exc.detail(), why)

    async def _fail_or_pause(
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
            await self._finish(active, FinishStatus.FAILED, detail, reason)
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
        await self._finish(active, FinishStatus.PAUSED, None, text)

    async def _decide(
        self,
        active: ActiveRun,
        flow: Flow,
        turn: int,
        turns: list[Turn],
        calls: list[Call],
    ) -> Recordable:
        assert flow.policy_fn is not None
        by_turn: dict[int, list[Call]] = {}
        for x in calls:
            by_turn.setdefault(x.turn, []).append(x)
        history = [
            HistoryTurn(
                turn=t.turn,
                calls=tuple(
                    HistoryCall(
                        call_id=x.call_id,
                        tool=x.tool,
                        args=x.args,
                        status=str(x.status),
                        result=x.result,
                        error=x.error,
                        provider_id=x.provider_id,
                        approval=None if x.approval is None else str(x.approval),
                    )
                    for x in by_turn.get(t.turn, [])
                ),
                record=t.record,
            )
            for t in turns
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
            check_boundary(active)
        return flow.normalize(decided)
