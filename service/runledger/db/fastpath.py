"""The worker's fast path (revision 0008): fewer transactions per tool call.

- :meth:`FastPath.claim_runs_v2`: each claimed run comes with its stalled-claim count
  and its journal, so the worker reads nothing after a claim (``claim_runs_v3``, revision
  0010: and the turn from which a failover makes its calls suspect; ``claim_runs_v4``,
  revision 0017: and the run's trace context);
- :meth:`FastPath.record_turn_v4`: a decision, the checkpoint of the turns before it and,
  for the final decision, the run's success, in one transaction; since revision 0009 also
  the dispatch of the decision's first calls (``record_turn_v3`` is it without them);
- :meth:`FastPath.complete_call_v2`: a call's result and the next call's dispatch, in one
  transaction;
- :meth:`FastPath.complete_calls`: the results of several calls of one run (a parallel
  group's that are ready together), in one transaction (revision 0018).

Each is a write that must not be applied twice; its read-back after an ambiguous commit
is in :mod:`runledger.db.landed`. The protocol's order is the one of the separate writes:
a decision is committed before any of its tools runs, a call's dispatch before it is sent,
its result before the next step.
"""

from __future__ import annotations

import datetime as dt
import uuid
from collections.abc import Sequence
from typing import Any, LiteralString, TypeVar

from psycopg.types.json import Jsonb

from runledger.db import wire
from runledger.db.coalesce import COMPLETIONS, DECISIONS, Coalescer, Write
from runledger.db.execution import Landed, word
from runledger.db.operator import OperatorWrites
from runledger.db.results import Advanced, Batched, Recorded
from runledger.db.rows import ClaimedJournal, Row
from runledger.db.validate import check_text
from runledger.model import ClaimedRun, FencingToken, IdempotencyKey, LeaseId, Outcome, RunId

FINAL_OUTCOMES = (Outcome.SUCCEEDED, Outcome.FAILED)

T = TypeVar("T")

# The statements a worker sends for every tool call (and its claim), prepared once per
# connection and sent without a cursor (runledger.db.wire).
RECORD_TURN_V4 = wire.Prepared(
    "record_turn_v4",
    "SELECT * FROM runledger.record_turn_v4($1::text, $2::uuid, $3::bigint, $4::int,"
    " $5::jsonb, $6::jsonb, $7::jsonb, $8::bigint, $9::jsonb, $10::boolean, $11::text[])",
    11,
)
COMPLETE_CALL_V2 = wire.Prepared(
    "complete_call_v2",
    "SELECT runledger.complete_call_v2($1::text, $2::uuid, $3::bigint, $4::text, $5::text,"
    " $6::jsonb, $7::jsonb, $8::text) AS attempt",
    8,
)
CLAIM_RUNS_V4 = wire.Prepared(
    "claim_runs_v4",
    "SELECT * FROM runledger.claim_runs_v4($1::text, $2::text[], $3::interval, $4::int)",
    4,
)
FINISH_AND_CLAIM = wire.Prepared(
    "finish_and_claim",
    "SELECT * FROM runledger.finish_and_claim($1::text, $2::uuid, $3::bigint, $4::int,"
    " $5::jsonb, $6::jsonb, $7::bigint, $8::jsonb, $9::text, $10::text[], $11::interval,"
    " $12::int)",
    12,
)
COMPLETE_CALLS = wire.Prepared(
    "complete_calls",
    "SELECT runledger.complete_calls($1::text, $2::uuid, $3::bigint, $4::text[], $5::text[],"
    " $6::jsonb[], $7::jsonb[]) AS attempt",
    7,
)


def claimed(rows: Sequence[Row]) -> list[tuple[ClaimedRun, ClaimedJournal]]:
    """The runs of a ``claim_runs_v4`` reply (or of ``finish_and_claim``'s rows that carry
    a run), each with what the claim brought of its journal, left packed."""
    return [
        (
            claimed_run(r),
            ClaimedJournal(
                stalled_claims=int(r["stalled_claims"]),
                turns=r["turns"],
                calls=r["calls"],
                failover_turn=r["failover_turn"],
            ),
        )
        for r in rows
        if r["run_id"] is not None
    ]


def claimed_run(r: Row) -> ClaimedRun:
    return ClaimedRun(
        run_id=RunId(r["run_id"]),
        flow=r["flow"],
        flow_version=r["flow_version"],
        input=r["input"],
        state=r["state"],
        state_version=r["state_version"],
        fencing_token=FencingToken(r["fencing_token"]),
        lease_id=LeaseId(r["lease_id"]),
        lease_expires_at=r["lease_expires_at"],
        takeover=r["takeover"],
        traceparent=r.get("traceparent"),  # claim_runs_v4
    )


class FastPath(OperatorWrites):
    # with coalesce_writes(): the completions and decisions of concurrent runs share
    # statements and commits (runledger.db.coalesce)
    _completions: Coalescer | None = None
    _decisions: Coalescer | None = None

    def coalesce_writes(self) -> None:
        """Send the completions and decisions of this store's concurrent runs together
        (:mod:`runledger.db.coalesce`): what a worker does."""
        self._completions = Coalescer(self, "completions", COMPLETIONS)
        self._decisions = Coalescer(self, "decisions", DECISIONS)

    @property
    def coalescers(self) -> tuple[Coalescer, ...]:
        return tuple(c for c in (self._completions, self._decisions) if c is not None)

    async def close(self) -> None:
        for c in self.coalescers:
            await c.close()
        await super().close()

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
        """:meth:`_write`, or through ``coalescer`` with ``row`` as its batch row."""
        if coalescer is None:
            return await self._write(sql, params, result=result, landed=landed, fields=fields)
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
        """The checked arguments of a completion (``complete_call``, ``complete_call_v2``):
        the key, the outcome, the result and receipt as JSON."""
        check_text("idempotency key", idempotency_key)
        chosen = word("outcome", outcome, Outcome)
        result_json = self._json("result", result, obj=False, nullable=True)
        receipt_json = self._json("receipt", receipt, obj=True, nullable=True)
        return IdempotencyKey(idempotency_key), chosen, result_json, receipt_json

    async def claim_runs_v2(
        self, worker_id: str, flows: Sequence[str], lease: dt.timedelta, max_runs: int
    ) -> list[tuple[ClaimedRun, ClaimedJournal]]:
        """Claim as ``claim_runs``; with each run its stalled-claim count and its journal,
        left packed (:class:`ClaimedJournal`): a journal this process cannot decode is
        that run's problem, found when the run is driven, never the claim's."""
        check_text("worker id", worker_id)
        for f in flows:
            check_text("flow", f)
        # A claim lost in an ambiguous commit expires and is taken over: repeating is safe.
        rows = await self._read(
            "SELECT * FROM runledger.claim_runs_v2(%s, %s::text[], %s::interval, %s)",
            (worker_id, list(flows), lease, max_runs),
        )
        return [
            (
                claimed_run(r),
                ClaimedJournal(
                    stalled_claims=int(r["stalled_claims"]), turns=r["turns"], calls=r["calls"]
                ),
            )
            for r in rows
        ]

    async def claim_runs_v3(
        self, worker_id: str, flows: Sequence[str], lease: dt.timedelta, max_runs: int
    ) -> list[tuple[ClaimedRun, ClaimedJournal]]:
        """``claim_runs_v2``, and with each run the turn from which a failover makes its
        never-dispatched calls suspect (``ClaimedJournal.failover_turn``, revision 0010)."""
        check_text("worker id", worker_id)
        for f in flows:
            check_text("flow", f)
        rows = await self._read(
            "SELECT * FROM runledger.claim_runs_v3(%s, %s::text[], %s::interval, %s)",
            (worker_id, list(flows), lease, max_runs),
        )
        return claimed(rows)

    async def claim_runs_v4(
        self, worker_id: str, flows: Sequence[str], lease: dt.timedelta, max_runs: int
    ) -> list[tuple[ClaimedRun, ClaimedJournal]]:
        """``claim_runs_v3``, and with each run the trace context it was submitted with
        (``ClaimedRun.traceparent``, revision 0017): the worker's spans continue it."""
        check_text("worker id", worker_id)
        for f in flows:
            check_text("flow", f)
        rows = await self._read(CLAIM_RUNS_V4, (worker_id, list(flows), lease, max_runs))
        return claimed(rows)

    async def record_turn_v3(
        self,
        run_id: str,
        lease_id: uuid.UUID,
        fencing_token: int,
        turn: int,
        calls: list[dict[str, Any]],
        *,
        record: dict[str, Any] | None = None,
        output: Any = None,
        expected_version: int,
        state: dict[str, Any] | None = None,
        finish: bool = False,
    ) -> int:
        """Record a decision as ``record_turn``; with ``state`` (an object) checkpoint it
        first (compare-and-set on ``expected_version``); with ``finish`` (a final decision:
        no calls) the run succeeds with ``output`` as its result. Returns the run's
        state version after it. (``record_turn_v4`` without calls to dispatch.)"""
        version, _ = await self.record_turn_v4(
            run_id,
            lease_id,
            fencing_token,
            turn,
            calls,
            record=record,
            output=output,
            expected_version=expected_version,
            state=state,
            finish=finish,
        )
        return version

    async def record_turn_v4(
        self,
        run_id: str,
        lease_id: uuid.UUID,
        fencing_token: int,
        turn: int,
        calls: list[dict[str, Any]],
        *,
        record: dict[str, Any] | None = None,
        output: Any = None,
        expected_version: int,
        state: dict[str, Any] | None = None,
        finish: bool = False,
        dispatch: Sequence[str] = (),
    ) -> tuple[int, tuple[int, ...]]:
        """As :meth:`record_turn_v3`, and dispatch the calls ``dispatch`` names (call ids
        of this decision) in the same transaction. Returns the run's state version after
        it and each dispatched call's attempt number, in ``dispatch``'s order."""
        payload = self._json("calls", calls, obj=False)
        record_json = self._json("record", record, obj=True, nullable=True)
        output_json = self._json("output", output, obj=False, nullable=True)
        state_json = self._json("state", state, obj=True, nullable=True)
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
            RECORD_TURN_V4,
            params,
            result=lambda rows: Recorded(
                run_id=RunId(run_id),
                turn=turn,
                state_version=int(rows[0]["state_version"]),
                finished=finish,
                attempts=tuple(int(a) for a in rows[0]["attempts"]),
            ),
            landed=lambda: self.recorded(run_id, fencing_token, turn, finish, call_ids),
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
        """The final decision of a run (:meth:`record_turn_v4` with no calls and
        ``finish``) and :meth:`claim_runs_v4` for ``worker_id``, in one transaction
        (``finish_and_claim``, revision 0026). Returns the finished run's state version and
        the runs claimed. Sent alone, never coalesced. After an ambiguous commit that the
        read-back finds landed, the claims are not known: none is returned, and those
        runs are taken over once their leases expire, as after a lost claim."""
        record_json = self._json("record", record, obj=True, nullable=True)
        output_json = self._json("output", output, obj=False, nullable=True)
        state_json = self._json("state", state, obj=True, nullable=True)
        check_text("worker id", worker_id)
        for f in flows:
            check_text("flow", f)

        async def landed() -> tuple[int, list[tuple[ClaimedRun, ClaimedJournal]]] | None:
            done = await self.recorded(run_id, fencing_token, turn, True)
            return None if done is None else (done.state_version, [])

        return await self._write(
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

    async def complete_call_v2(
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
            COMPLETE_CALL_V2,
            params,
            result=lambda rows: Advanced(
                idempotency_key=key,
                outcome=chosen,
                next_key=IdempotencyKey(next_key),
                attempt=int(rows[0]["attempt"]),
            ),
            landed=lambda: self.advanced(
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
        """Complete several calls of one run in one transaction (``complete_calls``): each
        a ``(key, outcome, result JSON, receipt JSON)`` of :meth:`completion`. A refusal
        of any of them writes none."""
        if not completions:
            raise ValueError("complete_calls needs at least one completion")
        keys = [c[0] for c in completions]
        outcomes = [c[1] for c in completions]
        done = await self._write(
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
            landed=lambda: self.batched(
                run_id, fencing_token, list(zip(keys, outcomes, strict=True))
            ),
            fields={"run_id": run_id, "fencing_token": fencing_token},
        )
        return done
