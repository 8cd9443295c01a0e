"""What a worker calls: submit, claim, renew, record a turn, dispatch, complete, finish,
release, and the reads of its journal; its registration, heartbeats and health reads are
:attr:`WorkerStore.registry` (:mod:`runledger.db.registry`).

Every method calls one contract function with bound parameters through the
:class:`~runledger.db.execution.Executor` (one function call, one transaction). A write
that is not safe to repeat goes through ``write`` with its read-back
(:class:`~runledger.db.landed.ReadBacks`), which tells from the tables whether it landed
before the connection dropped; a refusal becomes its :mod:`runledger.errors` exception
(:mod:`runledger.db.sqlstate`). The protocol's order is the one of the separate writes:
a decision is committed before any of its tools runs, a call's dispatch before it is
sent, its result before the next step; the fused writes (:meth:`WorkerStore.record_turn`
with ``dispatch``, :meth:`WorkerStore.complete_and_dispatch`,
:meth:`WorkerStore.complete_calls`, :meth:`WorkerStore.finish_and_claim`) keep it in
fewer transactions. With :meth:`WorkerStore.coalesce_writes` the completions and
decisions of concurrent runs share statements and commits (:mod:`runledger.db.coalesce`).
"""

from __future__ import annotations

import contextlib
import datetime as dt
import time
import uuid
from collections.abc import Sequence
from typing import Any, LiteralString, TypeVar

from psycopg.types.json import Jsonb

from runledger import errors
from runledger.clock import DatabaseClock
from runledger.db import reads, wire
from runledger.db.coalesce import COMPLETIONS, DECISIONS, Coalescer, Write
from runledger.db.execution import Executor, Landed
from runledger.db.landed import FINISHED_STATUS, ReadBacks
from runledger.db.registry import WorkerRegistry
from runledger.db.results import (
    CALL_STATUS_AFTER,
    Advanced,
    Batched,
    Checkpointed,
    Completed,
    Dispatched,
    Finished,
    Recorded,
    Released,
)
from runledger.db.rows import ClaimedJournal, Journal
from runledger.db.statements import (
    CLAIM_RUNS,
    COMPLETE_AND_DISPATCH,
    COMPLETE_CALL,
    COMPLETE_CALLS,
    FINISH_AND_CLAIM,
    RECORD_TURN,
    claimed,
)
from runledger.db.validate import check_int32, check_text, check_traceparent, word
from runledger.model import (
    Call,
    CallSender,
    ClaimedRun,
    Event,
    FinishStatus,
    IdempotencyKey,
    Outcome,
    RenewedLease,
    RunId,
    SubmitResult,
)

T = TypeVar("T")

MAX_REASON_CHARS = 200


RENEW_LEASES: LiteralString = (
    "SELECT * FROM runledger.renew_leases(%s, %s::text[], %s::uuid[], %s::interval)"
)


class WorkerStore:
    """The worker's side of the contract, over one :class:`Executor`."""

    def __init__(self, executor: Executor) -> None:
        self.executor = executor
        self.landed = ReadBacks(executor)
        # with coalesce_writes(): the completions and decisions of concurrent runs share
        # statements and commits (runledger.db.coalesce)
        self._completions: Coalescer | None = None
        self._decisions: Coalescer | None = None
        # the database's clock, measured on the renewals and the heartbeats: what the
        # worker compares the journal's times with (runledger.clock)
        self.clock = DatabaseClock()
        self.registry = WorkerRegistry(executor, self.clock)

    @classmethod
    async def connect(cls, url: str, **options: Any) -> WorkerStore:
        """A store on a pool of its own: :meth:`Executor.connect`'s options."""
        return cls(await Executor.connect(url, **options))

    async def close(self) -> None:
        for c in self.coalescers:
            await c.close()
        await self.executor.close()

    def pinned(self) -> contextlib.AbstractAsyncContextManager[None]:
        """This task's statements through one connection (:meth:`Executor.pinned`)."""
        return self.executor.pinned()

    def coalesce_writes(self) -> None:
        """Send the completions and decisions of this store's concurrent runs together
        (:mod:`runledger.db.coalesce`): what a worker does."""
        self._completions = Coalescer(self.executor, "completions", COMPLETIONS)
        self._decisions = Coalescer(self.executor, "decisions", DECISIONS)

    @property
    def coalescers(self) -> tuple[Coalescer, ...]:
        return tuple(c for c in (self._completions, self._decisions) if c is not None)

    # -- writes ----------------------------------------------------------------------

    async def _write_via(
        self,
        coalescer: Coalescer | None,
        run_id: str,
        row: tuple[Any, ...],
        sql: LiteralString | wire.Prepared,
        params: Sequence[Any],
        *,
        result: Any,
        landed: Landed[T],
        fields: dict[str, Any],
    ) -> T:
        """:meth:`Executor.write`, or through ``coalescer`` with ``row`` as its batch row."""
        if coalescer is None:
            return await self.executor.write(
                sql, params, result=result, landed=landed, fields=fields
            )
        return await coalescer.send(
            Write(
                run_id=run_id,
                row=row,
                sql=sql,
                params=params,
                result=result,
                landed=landed,
                fields=fields,
            )
        )

    def _completion(
        self, idempotency_key: str, outcome: Outcome | str, result: Any, receipt: Any
    ) -> tuple[IdempotencyKey, Outcome, Any, Any]:
        """The checked arguments of a completion (``complete_call``, ``complete_and_dispatch``):
        the key, the outcome, the result and receipt as JSON."""
        check_text("idempotency key", idempotency_key)
        chosen = word("outcome", outcome, Outcome)
        result_json = self.executor.json("result", result, obj=False, nullable=True)
        receipt_json = self.executor.json("receipt", receipt, obj=True, nullable=True)
        return IdempotencyKey(idempotency_key), chosen, result_json, receipt_json

    async def submit_run(
        self,
        run_id: str,
        flow: str,
        flow_version: str,
        input: dict[str, Any],
        priority: int = 0,
        available_at: dt.datetime | None = None,
        *,
        traceparent: str | None = None,
    ) -> SubmitResult:
        """Safe to repeat: submitting the same run again is a no-op by contract. (After
        a lost acknowledgement, ``created`` is the re-send's answer: false.) With
        ``traceparent`` (a W3C trace context) the run's spans continue that trace
        ; a resubmission keeps the first one."""
        check_text("run id", run_id)
        if not run_id:
            raise errors.InvalidInput("run id must not be empty (pass None to generate one)")
        check_text("flow", flow)
        check_text("flow version", flow_version)
        prio = check_int32("priority", priority)  # a bigint would pick no overload
        payload = self.executor.json("input", input, obj=True)
        if traceparent is not None:
            check_traceparent(traceparent)
        rows = await self.executor.read(
            "SELECT * FROM runledger.submit_run_v2"
            "(%s, %s, %s, %s::jsonb, %s::integer, %s::timestamptz, %s::text)",
            (run_id, flow, flow_version, payload, prio, available_at, traceparent),
            fields={"run_id": run_id},
        )
        return SubmitResult(run_id=RunId(rows[0]["run_id"]), created=bool(rows[0]["created"]))

    async def claim_runs(
        self, worker_id: str, flows: Sequence[str], lease: dt.timedelta, max_runs: int
    ) -> list[tuple[ClaimedRun, ClaimedJournal]]:
        """Claim up to ``max_runs`` runs of ``flows`` for ``lease``: each with what the
        claim brought of its journal, left packed (:class:`ClaimedJournal`: its
        stalled-claim count, turns, calls, and the turn from which a failover makes its
        never-dispatched calls suspect), and with the trace context it was submitted with
        (``ClaimedRun.traceparent``). A journal this process cannot decode is that run's
        problem, found when the run is driven, never the claim's. Safe to repeat: a claim
        lost in an ambiguous commit expires and is taken over."""
        check_text("worker id", worker_id)
        for f in flows:
            check_text("flow", f)
        sent = time.monotonic()
        rows = await self.executor.read(CLAIM_RUNS, (worker_id, list(flows), lease, max_runs))
        if rows:  # each claimed lease ends the lease after the database's now
            self.clock.measure(rows[0]["lease_expires_at"] - lease, sent, time.monotonic())
        return claimed(rows)

    async def renew_leases(
        self,
        worker_id: str,
        run_ids: Sequence[str],
        lease_ids: Sequence[uuid.UUID],
        lease: dt.timedelta,
        *,
        aside: str | None = None,
        timeout: float = 5.0,
    ) -> list[RenewedLease]:
        """Renew the leases in one statement, through the pool; with ``aside`` (a URL), on
        a session of its own opened to it instead (within ``timeout`` seconds) and closed
        after: what the lease keeper does when the pool fails, so that a pooler that
        restarts, or the pool's own wait before it reconnects, costs no lease."""
        check_text("worker id", worker_id)
        params = (worker_id, list(run_ids), list(lease_ids), lease)
        sent = time.monotonic()
        if aside is None:
            rows = await self.executor.read(RENEW_LEASES, params)
        else:
            rows = await self.executor.once_aside(aside, RENEW_LEASES, params, timeout=timeout)
        if rows:  # each renewed lease ends the lease after the database's now
            self.clock.measure(rows[0]["lease_expires_at"] - lease, sent, time.monotonic())
        return [
            RenewedLease(run_id=RunId(r["run_id"]), lease_expires_at=r["lease_expires_at"])
            for r in rows
        ]

    async def checkpoint(
        self,
        run_id: str,
        lease_id: uuid.UUID,
        fencing_token: int,
        expected_version: int,
        state: dict[str, Any],
    ) -> int:
        """The new state version."""
        payload = self.executor.json("state", state, obj=True)
        done = await self.executor.write(
            "SELECT runledger.checkpoint(%s, %s, %s, %s, %s::jsonb) AS checkpoint",
            (run_id, lease_id, fencing_token, expected_version, payload),
            result=lambda rows: Checkpointed(
                run_id=RunId(run_id), state_version=int(rows[0]["checkpoint"])
            ),
            landed=lambda: self.landed.checkpointed(run_id, fencing_token, expected_version),
            fields={"run_id": run_id, "fencing_token": fencing_token},
        )
        return done.state_version

    async def record_turn(
        self,
        run_id: str,
        lease_id: uuid.UUID,
        fencing_token: int,
        turn: int,
        calls: list[dict[str, Any]],
        *,
        record: dict[str, Any] | None = None,
        output: Any = None,
        expected_version: int | None = None,
        state: dict[str, Any] | None = None,
        finish: bool = False,
        dispatch: Sequence[str] = (),
    ) -> tuple[int, tuple[int, ...]]:
        """Record a decision: its calls (each may carry a ``provider_id``), the
        provider-native message ``record`` (a JSON object or None) and, for a final
        decision (no calls), its ``output``. Safe to repeat: the same decision again is a
        no-op. In the same transaction: with ``state`` (an object), checkpoint it first
        (compare-and-set on ``expected_version``); with ``finish`` (a final decision) the
        run succeeds with ``output`` as its result; the calls ``dispatch`` names (call ids
        of this decision) are dispatched. Returns the run's state version after it and
        each dispatched call's attempt number, in ``dispatch``'s order."""
        payload = self.executor.json("calls", calls, obj=False)
        record_json = self.executor.json("record", record, obj=True, nullable=True)
        output_json = self.executor.json("output", output, obj=False, nullable=True)
        state_json = self.executor.json("state", state, obj=True, nullable=True)
        call_ids = list(dispatch)
        params = (
            run_id,
            lease_id,
            fencing_token,
            turn,
            payload,
            record_json,
            output_json,
            expected_version,
            state_json,
            finish,
            call_ids,
        )
        done = await self._write_via(
            self._decisions,
            run_id,
            (*params[:-1], Jsonb(call_ids)),
            RECORD_TURN,
            params,
            result=lambda rows: Recorded(
                run_id=RunId(run_id),
                turn=turn,
                state_version=int(rows[0]["state_version"]),
                finished=finish,
                attempts=tuple(int(a) for a in rows[0]["attempts"]),
            ),
            landed=lambda: self.landed.recorded(run_id, fencing_token, turn, finish, call_ids),
            fields={"run_id": run_id, "fencing_token": fencing_token},
        )
        return done.state_version, done.attempts

    async def finish_and_claim(
        self,
        run_id: str,
        lease_id: uuid.UUID,
        fencing_token: int,
        turn: int,
        *,
        record: dict[str, Any] | None = None,
        output: Any = None,
        expected_version: int,
        state: dict[str, Any] | None = None,
        worker_id: str,
        flows: Sequence[str],
        lease: dt.timedelta,
        max_runs: int,
    ) -> tuple[int, list[tuple[ClaimedRun, ClaimedJournal]]]:
        """The final decision of a run (:meth:`record_turn` with no calls and
        ``finish``) and :meth:`claim_runs` for ``worker_id``, in one transaction. Returns
        the finished run's state version and the runs claimed. Sent alone, never
        coalesced. After an ambiguous commit that the read-back finds landed, the claims
        are not known: none is returned, and those runs are taken over once their leases
        expire, as after a lost claim."""
        record_json = self.executor.json("record", record, obj=True, nullable=True)
        output_json = self.executor.json("output", output, obj=False, nullable=True)
        state_json = self.executor.json("state", state, obj=True, nullable=True)
        check_text("worker id", worker_id)
        for f in flows:
            check_text("flow", f)

        async def landed() -> tuple[int, list[tuple[ClaimedRun, ClaimedJournal]]] | None:
            done = await self.landed.recorded(run_id, fencing_token, turn, True)
            return None if done is None else (done.state_version, [])

        return await self.executor.write(
            FINISH_AND_CLAIM,
            (
                run_id,
                lease_id,
                fencing_token,
                turn,
                record_json,
                output_json,
                expected_version,
                state_json,
                worker_id,
                list(flows),
                lease,
                max_runs,
            ),
            result=lambda rows: (int(rows[0]["finished_version"]), claimed(rows)),
            landed=landed,
            fields={"run_id": run_id, "fencing_token": fencing_token},
        )

    async def dispatch_call(
        self,
        run_id: str,
        lease_id: uuid.UUID,
        fencing_token: int,
        idempotency_key: str,
        *,
        attempts_seen: int | None = None,
    ) -> int:
        """The attempt number. ``attempts_seen``, the call's attempts before this
        dispatch, makes the read-back exact for a call already dispatched under this
        lease (see :meth:`runledger.db.landed.ReadBacks.dispatched`)."""
        check_text("idempotency key", idempotency_key)
        key = IdempotencyKey(idempotency_key)
        done = await self.executor.write(
            "SELECT runledger.dispatch_call(%s, %s, %s, %s) AS attempt",
            (run_id, lease_id, fencing_token, idempotency_key),
            result=lambda rows: Dispatched(idempotency_key=key, attempt=int(rows[0]["attempt"])),
            landed=lambda: self.landed.dispatched(run_id, key, fencing_token, attempts_seen),
            fields={"run_id": run_id, "fencing_token": fencing_token},
        )
        return done.attempt

    async def complete_call(
        self,
        run_id: str,
        lease_id: uuid.UUID,
        fencing_token: int,
        idempotency_key: str,
        outcome: Outcome | str,
        result: Any,
        receipt: dict[str, Any] | None,
    ) -> None:
        await self.complete_checked(
            run_id,
            lease_id,
            fencing_token,
            self._completion(idempotency_key, outcome, result, receipt),
        )

    async def complete_checked(
        self,
        run_id: str,
        lease_id: uuid.UUID,
        fencing_token: int,
        checked: tuple[IdempotencyKey, Outcome, Any, Any],
    ) -> None:
        """:meth:`complete_call` with arguments already checked and encoded by
        :meth:`completion` (a group commit's result that turned out to be alone)."""
        key, chosen, result_json, receipt_json = checked
        params = (run_id, lease_id, fencing_token, key, chosen.value, result_json, receipt_json)
        await self._write_via(
            self._completions,
            run_id,
            (*params, None),  # no next call: complete_call in the batch
            COMPLETE_CALL,
            params,
            result=lambda _: Completed(
                idempotency_key=key, outcome=chosen, status=CALL_STATUS_AFTER[chosen]
            ),
            landed=lambda: self.landed.completed(run_id, key, fencing_token, chosen),
            fields={"run_id": run_id, "fencing_token": fencing_token},
        )

    async def complete_and_dispatch(
        self,
        run_id: str,
        lease_id: uuid.UUID,
        fencing_token: int,
        idempotency_key: str,
        outcome: Outcome | str,
        result: Any,
        receipt: dict[str, Any] | None,
        *,
        next_key: str,
        next_attempts_seen: int,
    ) -> int:
        """Complete a call (``succeeded`` or ``failed``) and dispatch ``next_key`` in the
        same transaction. ``next_attempts_seen``, the next call's attempts before this
        dispatch, makes the read-back exact. Returns the next call's attempt number."""
        check_text("idempotency key", next_key)
        key, chosen, result_json, receipt_json = self._completion(
            idempotency_key, outcome, result, receipt
        )
        params = (
            run_id,
            lease_id,
            fencing_token,
            key,
            chosen.value,
            result_json,
            receipt_json,
            next_key,
        )
        done = await self._write_via(
            self._completions,
            run_id,
            params,
            COMPLETE_AND_DISPATCH,
            params,
            result=lambda rows: Advanced(
                idempotency_key=key,
                outcome=chosen,
                next_key=IdempotencyKey(next_key),
                attempt=int(rows[0]["attempt"]),
            ),
            landed=lambda: self.landed.advanced(
                run_id, key, fencing_token, chosen, next_key, next_attempts_seen
            ),
            fields={"run_id": run_id, "fencing_token": fencing_token},
        )
        return done.attempt

    def completion(
        self, idempotency_key: str, outcome: Outcome | str, result: Any, receipt: Any
    ) -> tuple[IdempotencyKey, Outcome, Any, Any]:
        """The checked arguments of one completion of :meth:`complete_calls`
        (:class:`~runledger.errors.InvalidInput` for that call alone)."""
        return self._completion(idempotency_key, outcome, result, receipt)

    async def complete_calls(
        self,
        run_id: str,
        lease_id: uuid.UUID,
        fencing_token: int,
        completions: Sequence[tuple[IdempotencyKey, Outcome, Any, Any]],
    ) -> Batched:
        """Complete several calls of one run in one transaction : each
        a ``(key, outcome, result JSON, receipt JSON)`` of :meth:`completion`. A refusal
        of any of them writes none."""
        if not completions:
            raise ValueError("complete_calls needs at least one completion")
        keys = [c[0] for c in completions]
        outcomes = [c[1] for c in completions]
        done = await self.executor.write(
            COMPLETE_CALLS,
            (
                run_id,
                lease_id,
                fencing_token,
                keys,
                [o.value for o in outcomes],
                [c[2] for c in completions],
                [c[3] for c in completions],
            ),
            result=lambda _: Batched(idempotency_keys=tuple(keys), outcomes=tuple(outcomes)),
            landed=lambda: self.landed.batched(
                run_id, fencing_token, list(zip(keys, outcomes, strict=True))
            ),
            fields={"run_id": run_id, "fencing_token": fencing_token},
        )
        return done

    async def finish_run(
        self,
        run_id: str,
        lease_id: uuid.UUID,
        fencing_token: int,
        status: FinishStatus | str,
        result: Any,
        reason: str | None,
    ) -> None:
        chosen = word("status", status, FinishStatus)
        result_json = self.executor.json("result", result, obj=False, nullable=True)
        if reason is not None:
            check_text("reason", reason)
        await self.executor.write(
            "SELECT runledger.finish_run(%s, %s, %s, %s, %s::jsonb, %s)",
            (run_id, lease_id, fencing_token, chosen.value, result_json, reason),
            result=lambda _: Finished(run_id=RunId(run_id), status=FINISHED_STATUS[chosen]),
            landed=lambda: self.landed.finished(run_id, fencing_token, chosen),
            fields={"run_id": run_id, "fencing_token": fencing_token},
        )

    async def release_lease(
        self,
        run_id: str,
        lease_id: uuid.UUID,
        fencing_token: int,
        *,
        reason: str | None = None,
        error: dict[str, Any] | None = None,
    ) -> None:
        """Hand the run back (queued). With ``reason`` (and optionally ``error``, a JSON
        object) the ``lease_released`` event records why."""
        fields: dict[str, Any] = {"run_id": run_id, "fencing_token": fencing_token}
        if reason is None:
            if error is not None:
                raise errors.InvalidInput("a release with an error needs a reason", **fields)
            sql: LiteralString = "SELECT runledger.release_lease(%s, %s, %s)"
            params: tuple[Any, ...] = (run_id, lease_id, fencing_token)
        else:
            check_text("reason", reason, max_chars=MAX_REASON_CHARS)
            error_json = self.executor.json("error", error, obj=True, nullable=True)
            sql = "SELECT runledger.release_lease(%s, %s, %s, %s, %s::jsonb)"
            params = (run_id, lease_id, fencing_token, reason, error_json)
        await self.executor.write(
            sql,
            params,
            result=lambda _: Released(run_id=RunId(run_id), reason=reason),
            landed=lambda: self.landed.released(run_id, fencing_token, reason),
            fields=fields,
        )

    async def release_stale_lease(
        self, run_id: str, lease_id: uuid.UUID, fencing_token: int, worker_id: str
    ) -> bool:
        """Hand back a run this worker fenced whose lease a failover made stale (granted
        on an earlier timeline); false when the lease is not such a one, or is no longer
        the run's (``release_stale_lease``)."""
        check_text("worker id", worker_id)
        rows = await self.executor.read(  # safe to repeat: a second one finds no lease
            "SELECT runledger.release_stale_lease(%s, %s, %s, %s) AS released",
            (run_id, lease_id, fencing_token, worker_id),
            fields={"run_id": run_id, "fencing_token": fencing_token},
        )
        return bool(rows[0]["released"])

    async def report_stale_write(
        self,
        run_id: str,
        worker_id: str,
        lease_id: uuid.UUID,
        fencing_token: int,
        operation: str,
        message: str,
    ) -> None:
        check_text("worker id", worker_id)
        check_text("operation", operation)
        await self.executor.read(  # a second copy of this event is harmless
            "SELECT runledger.report_stale_write(%s, %s, %s, %s, %s, %s)",
            (run_id, worker_id, lease_id, fencing_token, operation, message.replace("\x00", "")),
            fields={"run_id": run_id},
        )

    async def call_sender(
        self, run_id: str, lease_id: uuid.UUID, fencing_token: int, idempotency_key: str
    ) -> CallSender | None:
        """Who sent the call in flight and until when it may still be sending it (None:
        the call is not in flight)."""
        check_text("idempotency key", idempotency_key)
        rows = await self.executor.read(
            "SELECT * FROM runledger.call_sender(%s, %s, %s, %s)",
            (run_id, lease_id, fencing_token, idempotency_key),
            fields={"run_id": run_id, "fencing_token": fencing_token},
        )
        if not rows:
            return None
        r = rows[0]
        return CallSender(
            sender=r["sender"],
            sender_token=int(r["sender_token"]),
            attempt=int(r["attempt"]),
            dispatched_at=r["dispatched_at"],
            until=r["until"],
            released=r["released"],
            process=r["process"],
            registered_at=r["registered_at"],
            now=r["now"],
        )

    async def first_dispatch(self, run_id: str, idempotency_key: str) -> dt.datetime | None:
        """When the call's key was first sent, as the journal says (the database's clock):
        its first ``call_dispatched`` event, or the ``failover_detected`` event that
        marked it dispatched, whichever came first; None if it was never dispatched. The
        age a provider's lookup judges its retention window by (docs/providers.md). A
        read of the run's events, made only for a call dispatched before this holder
        took it."""
        check_text("idempotency key", idempotency_key)
        rows = await self.executor.read(
            "SELECT min(e.at) AS first FROM runledger.run_events e"
            " WHERE e.run_id = %s AND ((e.kind = 'call_dispatched'"
            " AND e.detail ->> 'idempotency_key' = %s) OR (e.kind = 'failover_detected'"
            " AND e.detail -> 'marked_dispatched' ? %s))",
            (run_id, idempotency_key, idempotency_key),
            fields={"run_id": run_id},
        )
        first: dt.datetime | None = rows[0]["first"] if rows else None
        return first

    async def last_claims(self, run_id: str, claims: int) -> list[Event]:
        """The run's last ``claims`` claims and what happened under each lease (the
        events that tell it: dispatches, releases, failed renewals, stale writes), oldest
        first: the crash-loop guard's evidence. A read of the run's events, made only
        when the worker gives a run up."""
        return await reads.last_claims(self.executor, run_id, claims)

    async def release_call(
        self,
        run_id: str,
        lease_id: uuid.UUID,
        fencing_token: int,
        idempotency_key: str,
        worker_id: str,
        detail: dict[str, Any],
    ) -> bool:
        """Say that the send of the call's current attempt under this lease ended (its
        sender), or that its sender's process is gone (the run's current holder); false
        when the call is no longer in flight or its release is already written."""
        check_text("idempotency key", idempotency_key)
        check_text("worker id", worker_id)
        detail_json = self.executor.json("detail", detail, obj=True)
        rows = await self.executor.read(  # safe to repeat: a second release writes nothing
            "SELECT runledger.release_call(%s, %s, %s, %s, %s, %s::jsonb) AS released",
            (run_id, lease_id, fencing_token, idempotency_key, worker_id, detail_json),
            fields={"run_id": run_id, "fencing_token": fencing_token},
        )
        return bool(rows[0]["released"])

    # -- reads -----------------------------------------------------------------------

    async def load_journal(self, run_id: str) -> Journal:
        """The run's recorded turns and calls and its stalled-claim count, in one round trip."""
        return await reads.load_journal(self.executor, run_id)

    async def list_calls(self, run_id: str) -> list[Call]:
        return await reads.list_calls(self.executor, run_id)
