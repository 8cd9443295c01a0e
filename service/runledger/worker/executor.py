"""The journaled agent loop for one claimed run: the turns.

1. The policy's decision (a ``Decision`` or a bare list of calls) is recorded
   (``WorkerStore.record_turn``, with the provider-native ``record`` and, for the final decision,
   its ``output``) before any tool runs, and a recorded turn is replayed, never decided
   again. The history the policy sees carries each turn's record and each call's result
   and provider id; the final decision's output is the run's result.
2. Each call of the turn is settled by :class:`~runledger.worker.calls.Calls`, one loop
   per call carrying out the crash-window table of :mod:`runledger.worker.recovery`:
   ``dispatch_call`` commits before the tool is invoked, ``complete_call`` commits the
   result and the provider's receipt before the next step. For calls that run one after
   another, the result of one and the dispatch of the next are one commit
   (``complete_and_dispatch``); the results of a parallel group that are ready together are
   one commit too (``complete_calls``, group commit in :mod:`runledger.worker.writes`).
3. A call that settles ``unknown`` pauses the run, and so does a call that awaits a
   person's approval (it is not sent; the other calls of its group run first); once every
   call of the turn is final the turn is due a checkpoint, then the policy decides the
   next turn. The checkpoint commits with that decision (``record_turn``), so does the
   dispatch of the decision's first call (or first parallel group), and the final
   decision also ends the run: one commit each. A checkpoint still due when the run ends
   otherwise (fails, pauses, is handed back) is written on its own first. The runs given
   up on (crash loop, undecodable JSON) are :mod:`runledger.worker.giving_up`'s.

The journal comes with the claim (``WorkerStore.claim_runs``) and is kept in memory for the rest
of the lease (:mod:`runledger.worker.journal`): nothing is read back after a write.
"""

from __future__ import annotations

import logging
import time
from typing import Any

import psycopg

from runledger import errors
from runledger.db.rows import Journal
from runledger.db.sqlstate import describe
from runledger.db.worker_store import WorkerStore
from runledger.flows import (
    Flow,
    HistoryCall,
    HistoryTurn,
    InvalidDecision,
    PolicyContext,
    Recordable,
    invoke,
)
from runledger.model import Approval, Call, FinishStatus, Turn
from runledger.worker import poison, tracing
from runledger.worker.calls import Calls, Settled, check_boundary, check_deadline
from runledger.worker.claiming import Claiming, NextClaim
from runledger.worker.crash import CrashPoints
from runledger.worker.giving_up import GivingUp
from runledger.worker.groups import call_groups, group_sizes, settle_group
from runledger.worker.journal import LocalJournal
from runledger.worker.metrics import Metrics
from runledger.worker.poison import UndecodableRun
from runledger.worker.runs import (
    ActiveRun,
    Backoff,
    Draining,
    Limits,
    LocalLeaseExpired,
    PolicyFailed,
    error_of,
    pause_reason,
)
from runledger.worker.writes import Writes

__all__ = ["ActiveRun", "Draining", "Limits", "LocalLeaseExpired", "RunExecutor", "call_groups"]

log = logging.getLogger(__name__)


class RunExecutor:
    """Drives the claimed runs of one worker: each run's turns, calls and end."""

    def __init__(
        self,
        store: WorkerStore,
        flows: dict[str, Flow],
        *,
        worker_id: str,
        limits: Limits,
        crash: CrashPoints | None = None,
        metrics: Metrics | None = None,
        claims: Claiming | None = None,
    ) -> None:
        self.store = store
        # the worker's claims: a final decision may carry its next claim (finish_and_claim)
        self.claims = claims
        self.flows = flows
        self.worker_id = worker_id
        self.limits = limits
        self.crash = crash or CrashPoints(None)
        self.writes = Writes(store, worker_id=worker_id, metrics=metrics)
        self.calls = Calls(self.writes, limits=limits, crash=self.crash)
        self.giving_up = GivingUp(store, self.writes, self.calls, worker_id=worker_id)

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
            async with self.store.pinned(), tracing.run(active, self.worker_id):  # writes, spans
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
        except errors.ServerError as exc:  # the database failed a write (a full disk)
            log.warning(
                "run handed back: %s", describe(exc), extra={**fields, "sqlstate": exc.code}
            )
            log.debug("the failed write's traceback", exc_info=exc, extra=fields)
            await self._release_after_error(active, exc)
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

    async def _drive(self, active: ActiveRun) -> None:
        c = active.claim
        # Before anything of the run is loaded or decoded: a run that keeps crashing the
        # worker while loading must still end as crash_loop. The claim carries the
        # count (and the journal only for a run that made progress since its last claim).
        assert active.loaded is not None, "every claim comes with its journal"
        stalled = active.loaded.stalled_claims
        active.failover_turn = active.loaded.failover_turn
        if stalled > self.limits.max_stalled_claims:
            flow = self.flows[f"{c.flow}@{c.flow_version}"]
            # lookups only at the first claim over the limit: a lookup that kills the
            # worker must not keep the run from being given up at the next one
            first = stalled == self.limits.max_stalled_claims + 1
            if not await self.giving_up.crash_loop(active, flow, stalled, look_up=first):
                return
            active.loaded = None  # a lookup settled a call: the journal is read anew
        try:
            for what, value in (("input", c.input), ("state", c.state)):
                found = poison.in_value(value, what)
                if found:
                    raise UndecodableRun(what, found)
            await self._turns(active)
        except UndecodableRun as exc:
            await self.giving_up.undecodable(active, exc)

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
        # calls dispatched with their decision (record_turn): key -> (the call as it was
        # recorded, planned; its attempt number)
        fused: dict[str, tuple[Call, int]] = {}
        while True:
            turns, calls = journal.turns, journal.calls
            if turns:
                last = turns[-1].turn
                if not turns[-1].calls:  # the final decision: its output is the result
                    result = turns[-1].output
                    if result is None:
                        result = {"turns": len(turns), "calls": len(calls)}
                    await self.writes.end(active, FinishStatus.SUCCEEDED, result, None)
                    return
                pending = [x for x in calls if x.turn == last and not x.status.terminal]
                if pending:
                    tracing.turn(active, last, resumed=True)
                    carried, fused = fused, {}
                    if not await self._settle_turn(active, flow, pending, carried):
                        return  # paused or failed
                    continue  # every call of the turn is final now (the journal knows)
                if completed < last + 1:  # also after an operator resolved the last call
                    # due now, written with the next decision (or alone, if none comes)
                    active.checkpoint_due = {"completed_turns": last + 1}
                    completed = last + 1
            next_turn = len(turns)
            check_boundary(active)
            tracing.turn(active, next_turn)
            try:
                decision = await self._decide(active, flow, next_turn, turns, calls)
            except InvalidDecision as exc:
                failed = error_of(exc)
                await self.writes.end(active, FinishStatus.FAILED, failed, "invalid_decision")
                return
            except PolicyFailed as exc:
                error = error_of(exc.__cause__ or exc)
                await self.writes.end(active, FinishStatus.FAILED, error, "policy_error")
                return
            # the model answered, nothing of it is journaled yet
            self.crash.hit("after_decide", str(next_turn))
            payload = decision.calls
            # max_turns counts turns with calls: the policy may always end the run
            if payload and next_turn >= max_turns:
                budget = {"max_turns": max_turns}
                await self.writes.end(active, FinishStatus.FAILED, budget, "budget_exceeded")
                return
            if len(calls) + len(payload) > max_calls:
                budget = {"max_calls": max_calls}
                await self.writes.end(active, FinishStatus.FAILED, budget, "budget_exceeded")
                return
            check_deadline(active)
            # The final decision ends the run in the same commit -- unless a crash point
            # asks for the moment between the two (a decision recorded, the run not
            # finished: how a worker of the previous release leaves it)
            finish = not payload and not self.crash.wants("after_record_turn", str(next_turn))
            # and the calls sent first are dispatched in it too (one commit)
            first = self._sent_with_decision(active, flow, next_turn, payload)
            # the final decision of the worker's one run also claims its next runs
            request = self.claims.next_claim(active) if finish and self.claims else None
            active.ending = finish
            try:
                if request is not None:
                    written = self._finish_and_claim(active, next_turn, decision, request)
                else:
                    written = self.store.record_turn(
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
                        dispatch=first,
                    )
                active.state_version, attempts = await self.writes.write(
                    active,
                    "record_turn",
                    written,
                    dispatches=[f"{c.run_id}:{next_turn}:{call_id}" for call_id in first],
                )
            except errors.InvalidInput as exc:  # e.g. args the database cannot store
                failed = error_of(exc)
                await self.writes.end(active, FinishStatus.FAILED, failed, "invalid_decision")
                return
            active.checkpoint_due = None
            self.crash.hit("after_record_turn", str(next_turn))
            journal.recorded(next_turn, payload, decision.record, decision.output)
            tracing.decided(active, len(payload))
            for call_id, attempt in zip(first, attempts, strict=True):
                key = f"{c.run_id}:{next_turn}:{call_id}"
                planned = journal.call(key)
                assert planned is not None
                fused[key] = (planned, attempt)
                journal.dispatched(key, attempt, c.fencing_token)
                self.writes.dispatched(active, planned, attempt)
            if finish:
                self.writes.finished(active, FinishStatus.SUCCEEDED, None)
                return

    def _sent_with_decision(
        self, active: ActiveRun, flow: Flow, turn: int, payload: list[dict[str, Any]]
    ) -> list[str]:
        """The call ids of the decision's first group (one call, or the calls that run in
        parallel with it) when each is a plain send: a tool of this flow, needing no
        approval, and the lease allows a send now; else none. A crash point that names
        the moment between the decision and a dispatch keeps the two commits apart. So
        does a failover: a turn from the run's ``failover_turn`` on may repeat keys a lost
        timeline sent, and its calls go through recovery (docs/failover.md)."""
        if not payload or active.draining or time.monotonic() >= active.deadline:
            return []
        if active.failover_turn is not None and turn >= active.failover_turn:
            return []
        if self.crash.wants("after_record_turn", str(turn)):
            return []
        group = payload[: group_sizes(flow, [x["tool"] for x in payload])[0]]
        for x in group:
            if x["tool"] not in flow.tools or x.get("approval") is True:
                return []
            if self.crash.wants("before_dispatch", x["tool"]):
                return []
        return [x["call_id"] for x in group]

    async def _finish_and_claim(
        self, active: ActiveRun, turn: int, decision: Any, request: NextClaim
    ) -> tuple[int, tuple[int, ...]]:
        """The final decision with the worker's next claim (``finish_and_claim``): the
        runs claimed are started before this returns, so a run fenced meanwhile (its
        task cancelled, this write going on in the background) still hands them over."""
        assert self.claims is not None
        c = active.claim
        try:
            version, runs = await self.store.finish_and_claim(
                c.run_id,
                c.lease_id,
                c.fencing_token,
                turn,
                record=decision.record,
                output=decision.output,
                expected_version=active.state_version,
                state=active.checkpoint_due,
                worker_id=request.worker_id,
                flows=request.flows,
                lease=request.lease,
                max_runs=request.max_runs,
            )
            await self.claims.claimed(request, runs, active)
        finally:
            self.claims.claim_done()
        return version, ()

    async def _settle_turn(
        self,
        active: ActiveRun,
        flow: Flow,
        pending: list[Call],
        fused: dict[str, tuple[Call, int]],
    ) -> bool:
        """Settle the open calls of the turn, group after group; False when the run was
        paused or failed for this. A single call followed by a single call dispatches
        that one with its own result (one commit). ``fused``: the calls dispatched with
        the decision (as recorded, and their attempt numbers): they are sent at once."""
        c = active.claim
        pending = [
            fused[x.idempotency_key][0] if x.idempotency_key in fused else x for x in pending
        ]
        groups = call_groups(flow, pending)
        carried: int | None = None  # the next call's attempt, dispatched with a result
        for i, group in enumerate(groups):
            if len(group) == 1:
                after = groups[i + 1] if i + 1 < len(groups) else []
                nxt = after[0] if len(after) == 1 else None
                if i == 0 and group[0].idempotency_key in fused:
                    carried = fused[group[0].idempotency_key][1]
                done, carried = await self.calls.settle(
                    active, flow, group[0], next_call=nxt, dispatched=carried
                )
                settled = [(group[0], done)]
            else:
                sent = {k: a for k, (_, a) in fused.items()} if i == 0 else {}
                settled = await settle_group(self.calls, active, flow, group, dispatched=sent)
                carried = None
            paused = [x.idempotency_key for x, s in settled if s is Settled.PAUSED]
            waits = [x.idempotency_key for x, s in settled if s is Settled.AWAITING_APPROVAL]
            missing = [x for x, s in settled if s is Settled.TOOL_MISSING]
            if missing:
                tool = {"tool": missing[0].tool}
                await self.writes.end(active, FinishStatus.FAILED, tool, "tool_missing")
                return False
            if paused or waits:  # after every sibling of the group finished
                # name every call of the turn that awaits a person, later groups' too:
                # the run is requeued only once all are decided
                waits = [x.idempotency_key for x in pending if x.approval is Approval.PENDING]
                why = pause_reason(c.run_id, paused, waits)
                await self.writes.end(active, FinishStatus.PAUSED, None, why)
                return False
        return True

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
