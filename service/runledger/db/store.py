"""Typed async wrappers over the contract functions; the only place that sees SQLSTATEs.

Every method calls one stored function with bound parameters, in autocommit (one
function call = one transaction). A refusal of class ``RL`` becomes the matching
:mod:`runledger.errors` exception, raised ``from`` the driver error.

Connection failures are retried with backoff. A failure while the statement was in
flight leaves the outcome unknown (it may have committed), so every write that is
not naturally repeatable has a *read-back*: a query that tells whether our write
landed. Only when it did not land is the statement sent again.
"""

from __future__ import annotations

import asyncio
import datetime as dt
import json
import logging
import random
import uuid
from collections.abc import Awaitable, Callable, Sequence
from typing import Any, LiteralString, TypeVar

import psycopg
from psycopg.rows import dict_row
from psycopg.types.json import Jsonb
from psycopg_pool import AsyncConnectionPool

from runledger import errors
from runledger.db.rows import Journal, Row, call_from_row, run_from_row
from runledger.db.validate import check_json, check_text
from runledger.model import (
    RUN_ID_RE,
    Call,
    CallStatus,
    ClaimedRun,
    Event,
    FencingToken,
    FinishStatus,
    LeaseId,
    Outcome,
    RenewedLease,
    Resolution,
    Run,
    RunId,
    RunStatus,
    SubmitResult,
)

log = logging.getLogger(__name__)

T = TypeVar("T")

RETRYABLE_SQLSTATES = {"40001", "40P01", "57P01", "57P02", "57P03", "55P03"}
INPUT_SQLSTATES = {"22P05", "22021", "22P02", "22007", "22008", "22003", "54000"}
_MISSING = object()


def _is_connection_error(exc: psycopg.Error) -> bool:
    if isinstance(exc, psycopg.OperationalError) and (
        exc.sqlstate is None or exc.sqlstate.startswith("08") or exc.sqlstate.startswith("57P")
    ):
        return True
    return isinstance(exc, psycopg.InterfaceError)


def map_error(exc: psycopg.Error, **fields: Any) -> errors.RunLedgerError | None:
    """The runledger exception for a driver error, or ``None`` when it is not a refusal."""
    diag = exc.diag
    message = diag.message_primary or str(exc)
    mapped = errors.from_sqlstate(
        exc.sqlstate,
        message,
        detail=diag.message_detail or None,
        hint=diag.message_hint or None,
        **fields,
    )
    if mapped is not None:
        return mapped
    if exc.sqlstate in INPUT_SQLSTATES:
        return errors.InvalidInput(
            message, detail=diag.message_detail or None, hint=diag.message_hint or None, **fields
        )
    return None


class Store:
    """One method per contract function, over a psycopg async pool."""

    def __init__(
        self,
        pool: AsyncConnectionPool,
        *,
        retries: int = 6,
        backoff: float = 0.1,
        max_backoff: float = 3.0,
        max_payload_bytes: int | None = None,
    ) -> None:
        self.pool = pool
        self.retries = retries
        self.backoff = backoff
        self.max_backoff = max_backoff
        self.max_payload_bytes = max_payload_bytes

    @classmethod
    async def connect(
        cls,
        url: str,
        *,
        min_size: int = 1,
        max_size: int = 4,
        application_name: str = "runledger",
        **kwargs: Any,
    ) -> Store:
        pool = AsyncConnectionPool(
            url,
            min_size=min_size,
            max_size=max_size,
            kwargs={
                "autocommit": True,
                "row_factory": dict_row,
                "application_name": application_name[:63],
            },
            open=False,
            name="runledger",
        )
        await pool.open(wait=True, timeout=30)
        return cls(pool, **kwargs)

    async def close(self) -> None:
        await self.pool.close()

    # -- execution ---------------------------------------------------------------

    async def _rows(self, sql: LiteralString, params: Sequence[Any]) -> list[Row]:
        async with self.pool.connection() as conn, conn.cursor(row_factory=dict_row) as cur:
            await cur.execute(sql, params)
            return await cur.fetchall() if cur.description else []

    async def _call(
        self,
        sql: LiteralString,
        params: Sequence[Any],
        *,
        fields: dict[str, Any] | None = None,
        readback: Callable[[], Awaitable[Any]] | None = None,
        repeatable: bool = False,
    ) -> list[Row]:
        """Run one statement; map refusals; retry connection failures safely.

        ``repeatable``: sending the statement twice is harmless (reads, renewals,
        idempotent functions). Otherwise ``readback`` decides, after an ambiguous
        failure, whether the write landed: it returns ``_MISSING`` when it did not,
        or the rows to return when it did.
        """
        fields = fields or {}
        delay = self.backoff
        for attempt in range(self.retries + 1):
            try:
                return await self._rows(sql, params)
            except psycopg.Error as exc:
                mapped = map_error(exc, **fields)
                if mapped is not None:
                    raise mapped from exc
                connection_lost = _is_connection_error(exc)
                if not connection_lost and exc.sqlstate not in RETRYABLE_SQLSTATES:
                    raise
                if attempt == self.retries:
                    raise errors.DatabaseUnavailable(
                        f"database call failed after {attempt + 1} attempts: {exc}", **fields
                    ) from exc
                log.warning(
                    "database call failed, retrying",
                    extra={"attempt": attempt + 1, "sqlstate": exc.sqlstate, **fields},
                )
                await asyncio.sleep(delay * (0.5 + random.random()))
                delay = min(delay * 2, self.max_backoff)
                if connection_lost and not repeatable and readback is not None:
                    landed = await self._readback(readback)
                    if landed is not _MISSING:
                        return landed  # type: ignore[no-any-return]
        raise AssertionError("unreachable")

    async def _readback(self, readback: Callable[[], Awaitable[Any]]) -> Any:
        delay = self.backoff
        for attempt in range(self.retries + 1):
            try:
                return await readback()
            except psycopg.Error as exc:
                if not _is_connection_error(exc) or attempt == self.retries:
                    raise
                await asyncio.sleep(delay)
                delay = min(delay * 2, self.max_backoff)
        raise AssertionError("unreachable")

    def _json(self, what: str, value: Any, *, obj: bool, nullable: bool = False) -> Jsonb | None:
        check_json(what, value, obj=obj, nullable=nullable, cap=self.max_payload_bytes)
        return None if value is None else Jsonb(value)

    # -- worker side ---------------------------------------------------------------

    async def submit_run(
        self,
        run_id: str,
        flow: str,
        flow_version: str,
        input: dict[str, Any],
        priority: int = 0,
        available_at: dt.datetime | None = None,
    ) -> SubmitResult:
        check_text("run id", run_id)
        check_text("flow", flow)
        check_text("flow version", flow_version)
        payload = self._json("input", input, obj=True)
        rows = await self._call(
            "SELECT * FROM runledger.submit_run(%s, %s, %s, %s::jsonb, %s, %s::timestamptz)",
            (run_id, flow, flow_version, payload, priority, available_at),
            fields={"run_id": run_id},
            repeatable=True,  # resubmitting the same run is a no-op by contract
        )
        return SubmitResult(run_id=RunId(rows[0]["run_id"]), created=bool(rows[0]["created"]))

    async def claim_runs(
        self, worker_id: str, flows: Sequence[str], lease: dt.timedelta, max_runs: int
    ) -> list[ClaimedRun]:
        check_text("worker id", worker_id)
        for f in flows:
            check_text("flow", f)
        # A claim lost in an ambiguous commit expires and is taken over: repeating is safe.
        rows = await self._call(
            "SELECT * FROM runledger.claim_runs(%s, %s::text[], %s::interval, %s)",
            (worker_id, list(flows), lease, max_runs),
            repeatable=True,
        )
        return [
            ClaimedRun(
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
            )
            for r in rows
        ]

    async def renew_leases(
        self,
        worker_id: str,
        run_ids: Sequence[str],
        lease_ids: Sequence[uuid.UUID],
        lease: dt.timedelta,
    ) -> list[RenewedLease]:
        check_text("worker id", worker_id)
        rows = await self._call(
            "SELECT * FROM runledger.renew_leases(%s, %s::text[], %s::uuid[], %s::interval)",
            (worker_id, list(run_ids), list(lease_ids), lease),
            repeatable=True,
        )
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
        payload = self._json("state", state, obj=True)

        stored = json.loads(json.dumps(state))  # as it comes back (tuples become lists)

        async def landed() -> Any:
            run = await self.get_run(run_id)
            if run.state_version == expected_version + 1 and run.state == stored:
                return [{"checkpoint": expected_version + 1}]
            return _MISSING

        rows = await self._call(
            "SELECT runledger.checkpoint(%s, %s, %s, %s, %s::jsonb) AS checkpoint",
            (run_id, lease_id, fencing_token, expected_version, payload),
            fields={"run_id": run_id, "fencing_token": fencing_token},
            readback=landed,
        )
        return int(rows[0]["checkpoint"])

    async def record_turn(
        self,
        run_id: str,
        lease_id: uuid.UUID,
        fencing_token: int,
        turn: int,
        calls: list[dict[str, Any]],
    ) -> None:
        payload = self._json("calls", calls, obj=False)
        await self._call(
            "SELECT runledger.record_turn(%s, %s, %s, %s, %s::jsonb)",
            (run_id, lease_id, fencing_token, turn, payload),
            fields={"run_id": run_id, "fencing_token": fencing_token},
            repeatable=True,  # recording the same decision again is a no-op by contract
        )

    async def dispatch_call(
        self, run_id: str, lease_id: uuid.UUID, fencing_token: int, idempotency_key: str
    ) -> int:
        check_text("idempotency key", idempotency_key)

        async def landed() -> Any:
            # Dispatched under this token is what the protocol needs before the tool runs.
            # (A repeat under the same lease cannot tell which attempt number landed.)
            call = await self.get_call(idempotency_key)
            if call.status is CallStatus.DISPATCHED and call.dispatched_token == fencing_token:
                return [{"attempt": call.attempts}]
            return _MISSING

        rows = await self._call(
            "SELECT runledger.dispatch_call(%s, %s, %s, %s) AS attempt",
            (run_id, lease_id, fencing_token, idempotency_key),
            fields={"run_id": run_id, "fencing_token": fencing_token},
            readback=landed,
        )
        return int(rows[0]["attempt"])

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
        check_text("idempotency key", idempotency_key)
        word = _word("outcome", outcome, Outcome)
        result_json = self._json("result", result, obj=False, nullable=True)
        receipt_json = self._json("receipt", receipt, obj=True, nullable=True)

        async def landed() -> Any:
            call = await self.get_call(idempotency_key)
            if call.status == word and call.completed_token == fencing_token:
                return []
            return _MISSING

        await self._call(
            "SELECT runledger.complete_call(%s, %s, %s, %s, %s, %s::jsonb, %s::jsonb)",
            (run_id, lease_id, fencing_token, idempotency_key, word, result_json, receipt_json),
            fields={"run_id": run_id, "fencing_token": fencing_token},
            readback=landed,
        )

    async def finish_run(
        self,
        run_id: str,
        lease_id: uuid.UUID,
        fencing_token: int,
        status: FinishStatus | str,
        result: Any,
        reason: str | None,
    ) -> None:
        word = _word("status", status, FinishStatus)
        result_json = self._json("result", result, obj=False, nullable=True)
        if reason is not None:
            check_text("reason", reason)

        async def landed() -> Any:
            run = await self.get_run(run_id)
            if run.status == word and run.fencing_token == fencing_token and run.lease_id is None:
                return []
            return _MISSING

        await self._call(
            "SELECT runledger.finish_run(%s, %s, %s, %s, %s::jsonb, %s)",
            (run_id, lease_id, fencing_token, word, result_json, reason),
            fields={"run_id": run_id, "fencing_token": fencing_token},
            readback=landed,
        )

    async def release_lease(self, run_id: str, lease_id: uuid.UUID, fencing_token: int) -> None:
        async def landed() -> Any:
            run = await self.get_run(run_id)
            if run.lease_id != lease_id:
                return []
            return _MISSING

        await self._call(
            "SELECT runledger.release_lease(%s, %s, %s)",
            (run_id, lease_id, fencing_token),
            fields={"run_id": run_id, "fencing_token": fencing_token},
            readback=landed,
        )

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
        await self._call(
            "SELECT runledger.report_stale_write(%s, %s, %s, %s, %s, %s)",
            (run_id, worker_id, lease_id, fencing_token, operation, message.replace("\x00", "")),
            fields={"run_id": run_id},
            repeatable=True,  # a second copy of this event is harmless
        )

    async def register_worker(
        self, worker_id: str, hostname: str, pid: int, flows: Sequence[str]
    ) -> None:
        check_text("worker id", worker_id)
        await self._call(
            "SELECT runledger.register_worker(%s, %s, %s, %s::text[])",
            (worker_id, hostname, pid, list(flows)),
            repeatable=True,
        )

    async def heartbeat_worker(self, worker_id: str, *, stopped: bool = False) -> None:
        await self._call(
            "SELECT runledger.heartbeat_worker(%s, %s)", (worker_id, stopped), repeatable=True
        )

    # -- operator side -------------------------------------------------------------

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
        word = _word("resolution", resolution, Resolution)
        receipt_json = self._json("receipt", receipt, obj=True, nullable=True)

        async def landed() -> Any:
            call = await self.get_call(idempotency_key)
            if call.status is not CallStatus.UNKNOWN:
                return []
            return _MISSING

        await self._call(
            "SELECT runledger.resolve_call(%s, %s, %s::jsonb, %s, %s)",
            (idempotency_key, word, receipt_json, actor, note),
            readback=landed,
        )

    async def cancel_run(self, run_id: str, actor: str, reason: str | None) -> None:
        check_text("run id", run_id)
        check_text("actor", actor)
        if reason is not None:
            check_text("reason", reason)
        await self._call(
            "SELECT runledger.cancel_run(%s, %s, %s)",
            (run_id, actor, reason),
            fields={"run_id": run_id},
            repeatable=True,  # cancelling a cancelled run is a no-op
        )

    async def retry_run(self, run_id: str, actor: str) -> None:
        check_text("run id", run_id)
        check_text("actor", actor)

        async def landed() -> Any:
            run = await self.get_run(run_id)
            if run.status not in (RunStatus.FAILED, RunStatus.PAUSED):
                return []
            return _MISSING

        await self._call(
            "SELECT runledger.retry_run(%s, %s)",
            (run_id, actor),
            fields={"run_id": run_id},
            readback=landed,
        )

    async def prune_runs(self, before: dt.datetime, keep_events: bool) -> int:
        rows = await self._call(
            "SELECT runledger.prune_runs(%s, %s) AS pruned", (before, keep_events), repeatable=True
        )
        return int(rows[0]["pruned"])

    # -- reads -----------------------------------------------------------------------

    async def get_run(self, run_id: str) -> Run:
        check_text("run id", run_id)
        if not RUN_ID_RE.fullmatch(run_id):
            raise errors.InvalidInput(f"invalid run id {run_id[:200]!r}", run_id=None)
        rows = await self._call(
            "SELECT * FROM runledger.runs WHERE run_id = %s",
            (run_id,),
            fields={"run_id": run_id},
            repeatable=True,
        )
        if not rows:
            raise errors.RunNotFound(f"run {run_id} not found", run_id=run_id)
        return run_from_row(rows[0])

    async def get_call(self, idempotency_key: str) -> Call:
        check_text("idempotency key", idempotency_key)
        rows = await self._call(
            "SELECT * FROM runledger.run_calls WHERE idempotency_key = %s",
            (idempotency_key,),
            repeatable=True,
        )
        if not rows:
            raise errors.RunNotFound(f"call {idempotency_key} not found")
        return call_from_row(rows[0])

    async def list_calls(self, run_id: str) -> list[Call]:
        check_text("run id", run_id)
        rows = await self._call(
            "SELECT * FROM runledger.run_calls WHERE run_id = %s ORDER BY turn, position",
            (run_id,),
            repeatable=True,
        )
        return [call_from_row(r) for r in rows]

    async def load_journal(self, run_id: str) -> Journal:
        """The run's recorded turns and calls, and its stalled-claim count, in one round trip."""
        check_text("run id", run_id)
        rows = await self._call(
            """SELECT r.stalled_claims,
                      (SELECT coalesce(json_agg(json_build_object('turn', t.turn, 'calls', t.calls)
                                                ORDER BY t.turn), '[]'::json)
                       FROM runledger.run_turns t WHERE t.run_id = r.run_id) AS turns,
                      (SELECT coalesce(json_agg(c ORDER BY c.turn, c.position), '[]'::json)
                       FROM runledger.run_calls c WHERE c.run_id = r.run_id) AS calls
               FROM runledger.runs r WHERE r.run_id = %s""",
            (run_id,),
            fields={"run_id": run_id},
            repeatable=True,
        )
        if not rows:
            raise errors.RunNotFound(f"run {run_id} not found", run_id=run_id)
        row = rows[0]
        return Journal(
            stalled_claims=row["stalled_claims"],
            turns=[(int(t["turn"]), list(t["calls"])) for t in row["turns"]],
            calls=[call_from_row(c) for c in row["calls"]],
        )

    async def list_turns(self, run_id: str) -> list[tuple[int, list[dict[str, Any]]]]:
        check_text("run id", run_id)
        rows = await self._call(
            "SELECT turn, calls FROM runledger.run_turns WHERE run_id = %s ORDER BY turn",
            (run_id,),
            repeatable=True,
        )
        return [(int(r["turn"]), list(r["calls"])) for r in rows]

    async def list_events(self, run_id: str) -> list[Event]:
        check_text("run id", run_id)
        rows = await self._call(
            "SELECT * FROM runledger.run_events WHERE run_id = %s ORDER BY event_id",
            (run_id,),
            repeatable=True,
        )
        return [
            Event(
                event_id=r["event_id"],
                run_id=r["run_id"],
                at=r["at"],
                kind=r["kind"],
                actor=r["actor"],
                fencing_token=r["fencing_token"],
                state_version=r["state_version"],
                detail=r["detail"],
            )
            for r in rows
        ]

    async def known_flows(self) -> set[str]:
        """Every ``name@version`` a worker ever registered."""
        rows = await self._call(
            "SELECT DISTINCT unnest(flows) AS flow FROM runledger.workers", (), repeatable=True
        )
        return {r["flow"] for r in rows}


def _word(what: str, value: str, enum: type[Any]) -> str:
    try:
        return str(enum(value).value)
    except ValueError:
        allowed = ", ".join(m.value for m in enum)
        raise errors.InvalidInput(
            f"unknown {what} {value!r}", hint=f"expected one of: {allowed}"
        ) from None
