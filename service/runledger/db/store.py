"""Typed async wrappers over the contract functions; the only place that sees SQLSTATEs.

Every method calls one stored function with bound parameters, in autocommit (one
function call = one transaction). A refusal of class ``RL`` becomes the matching
:mod:`runledger.errors` exception, raised ``from`` the driver error.

Connection failures are retried with backoff (:mod:`runledger.db.execution`). A
statement that is safe to repeat goes through ``_read``; a write that is not goes
through ``_write`` with its read-back (:mod:`runledger.db.landed`), which tells from
the tables whether the write landed before the connection dropped and builds the
write's typed result (:mod:`runledger.db.results`). Only a write that did not land is
sent again.

Split by concern: ``execution`` (pool, retries, SQLSTATE mapping), ``reads`` (runs,
calls, journal, events), ``landed`` (read-backs), ``operator`` (the operator's writes),
``fastpath`` (the worker's fused writes), this module (connecting, and the worker's
writes).
"""

from __future__ import annotations

import datetime as dt
import uuid
from collections.abc import Sequence
from typing import Any, LiteralString, cast

import psycopg
from psycopg.rows import dict_row
from psycopg_pool import AsyncConnectionPool, PoolTimeout

from runledger import errors
from runledger.config import default, url_connect_timeout
from runledger.db import decode, wire
from runledger.db.execution import connect_error, connect_timeout_param, map_error, probe, word
from runledger.db.fastpath import FastPath, claimed_run
from runledger.db.landed import FINISHED_STATUS
from runledger.db.pooler import Reach
from runledger.db.results import (
    CALL_STATUS_AFTER,
    Checkpointed,
    Completed,
    Dispatched,
    Finished,
    Released,
)
from runledger.db.validate import check_int32, check_text, check_traceparent
from runledger.model import (
    CallSender,
    ClaimedRun,
    FinishStatus,
    IdempotencyKey,
    Outcome,
    RenewedLease,
    RunId,
    SubmitResult,
)

__all__ = ["Store", "map_error"]

MAX_REASON_CHARS = 200
# a call's result committed alone (the last call of a turn): runledger.db.wire
COMPLETE_CALL = wire.Prepared(
    "complete_call",
    "SELECT runledger.complete_call($1::text, $2::uuid, $3::bigint, $4::text, $5::text,"
    " $6::jsonb, $7::jsonb)",
    7,
)


class Store(FastPath):
    """One method per contract function, over a psycopg async pool (the operator's
    functions in :class:`~runledger.db.operator.OperatorWrites`, the worker's fast path
    in :class:`~runledger.db.fastpath.FastPath`)."""

    @classmethod
    async def connect(
        cls,
        url: str,
        *,
        min_size: int = 1,
        max_size: int = 4,
        application_name: str = "runledger",
        connect_timeout: float | None = None,
        check_schema: bool = True,
        pooler: str = default("pooler"),
        **kwargs: Any,
    ) -> Store:
        """Probe the database once, then open the pool; fail within ``connect_timeout``.

        ``connect_timeout`` (seconds): when ``None``, the URL's own ``connect_timeout``,
        else the ``connect_timeout`` setting's default. A database that cannot be reached
        is :class:`~runledger.errors.DatabaseUnavailable`, one without the runledger schema
        (or an older one) :class:`~runledger.errors.SchemaMissing`, a string that is not a
        URL :class:`~runledger.errors.ConfigurationError`: one line each, naming host, port
        and database (see :func:`runledger.db.execution.probe`).

        ``pooler`` (the ``pooler`` setting): what the URL reaches, ``session`` or
        ``transaction`` as said, or found out by the probe (``auto``;
        :mod:`runledger.db.pooler`). Through a transaction pooler nothing is prepared, by
        psycopg or by :mod:`runledger.db.wire`: ``reach`` says which it was.
        """
        timeout = connect_timeout
        if timeout is None:
            timeout = url_connect_timeout(url) or float(default("connect_timeout"))
        name = application_name[:63]
        found = await probe(
            url,
            timeout=timeout,
            application_name=name,
            check_schema=check_schema,
            detect_pooler=pooler == "auto",
        )
        reach, why = found or (pooler, "")  # as the pooler setting says
        options: dict[str, Any] = {
            "autocommit": True,
            "row_factory": dict_row,
            "application_name": name,
            "connect_timeout": connect_timeout_param(timeout),
        }
        if reach == "transaction":  # a statement prepared on one server session is not
            options["prepare_threshold"] = None  # there at the next transaction
        pool = AsyncConnectionPool(
            url,
            min_size=min_size,
            max_size=max_size,
            kwargs=options,
            open=False,
            name="runledger",
            configure=decode.configure,  # one undecodable value never fails a whole batch
        )
        try:
            await pool.open(wait=True, timeout=timeout)
        except PoolTimeout as exc:  # it answered the probe, then went away
            await pool.close()
            raise connect_error(TimeoutError(str(exc)), url, timeout) from None
        except BaseException:
            await pool.close()
            raise
        store = cls(pool, **kwargs)
        store.reach, store.reach_why = cast(Reach, reach), why
        return store

    # -- worker side ---------------------------------------------------------------

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
        (``submit_run_v2``); a resubmission keeps the first one."""
        check_text("run id", run_id)
        if not run_id:
            raise errors.InvalidInput("run id must not be empty (pass None to generate one)")
        check_text("flow", flow)
        check_text("flow version", flow_version)
        prio = check_int32("priority", priority)  # a bigint would pick no overload
        payload = self._json("input", input, obj=True)
        if traceparent is not None:
            check_traceparent(traceparent)
        rows = await self._read(
            "SELECT * FROM runledger.submit_run_v2"
            "(%s, %s, %s, %s::jsonb, %s::integer, %s::timestamptz, %s::text)",
            (run_id, flow, flow_version, payload, prio, available_at, traceparent),
            fields={"run_id": run_id},
        )
        return SubmitResult(run_id=RunId(rows[0]["run_id"]), created=bool(rows[0]["created"]))

    async def claim_runs(
        self, worker_id: str, flows: Sequence[str], lease: dt.timedelta, max_runs: int
    ) -> list[ClaimedRun]:
        check_text("worker id", worker_id)
        for f in flows:
            check_text("flow", f)
        # A claim lost in an ambiguous commit expires and is taken over: repeating is safe.
        rows = await self._read(
            "SELECT * FROM runledger.claim_runs(%s, %s::text[], %s::interval, %s)",
            (worker_id, list(flows), lease, max_runs),
        )
        return [claimed_run(r) for r in rows]

    async def renew_leases(
        self,
        worker_id: str,
        run_ids: Sequence[str],
        lease_ids: Sequence[uuid.UUID],
        lease: dt.timedelta,
    ) -> list[RenewedLease]:
        check_text("worker id", worker_id)
        rows = await self._read(
            "SELECT * FROM runledger.renew_leases(%s, %s::text[], %s::uuid[], %s::interval)",
            (worker_id, list(run_ids), list(lease_ids), lease),
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
        """The new state version."""
        payload = self._json("state", state, obj=True)
        done = await self._write(
            "SELECT runledger.checkpoint(%s, %s, %s, %s, %s::jsonb) AS checkpoint",
            (run_id, lease_id, fencing_token, expected_version, payload),
            result=lambda rows: Checkpointed(
                run_id=RunId(run_id), state_version=int(rows[0]["checkpoint"])
            ),
            landed=lambda: self.checkpointed(run_id, fencing_token, expected_version),
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
    ) -> None:
        """Record a decision (``record_turn_v2``): its calls (each may carry a
        ``provider_id``), the provider-native message ``record`` (a JSON object or None)
        and, for a final decision (no calls), its ``output``."""
        payload = self._json("calls", calls, obj=False)
        record_json = self._json("record", record, obj=True, nullable=True)
        output_json = self._json("output", output, obj=False, nullable=True)
        await self._read(  # safe to repeat: recording the same decision again is a no-op
            "SELECT runledger.record_turn_v2(%s, %s, %s, %s, %s::jsonb, %s::jsonb, %s::jsonb)",
            (run_id, lease_id, fencing_token, turn, payload, record_json, output_json),
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
        lease (see :meth:`ReadBacks.dispatched`)."""
        check_text("idempotency key", idempotency_key)
        key = IdempotencyKey(idempotency_key)
        done = await self._write(
            "SELECT runledger.dispatch_call(%s, %s, %s, %s) AS attempt",
            (run_id, lease_id, fencing_token, idempotency_key),
            result=lambda rows: Dispatched(idempotency_key=key, attempt=int(rows[0]["attempt"])),
            landed=lambda: self.dispatched(run_id, key, fencing_token, attempts_seen),
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
            landed=lambda: self.completed(run_id, key, fencing_token, chosen),
            fields={"run_id": run_id, "fencing_token": fencing_token},
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
        chosen = word("status", status, FinishStatus)
        result_json = self._json("result", result, obj=False, nullable=True)
        if reason is not None:
            check_text("reason", reason)
        await self._write(
            "SELECT runledger.finish_run(%s, %s, %s, %s, %s::jsonb, %s)",
            (run_id, lease_id, fencing_token, chosen.value, result_json, reason),
            result=lambda _: Finished(run_id=RunId(run_id), status=FINISHED_STATUS[chosen]),
            landed=lambda: self.finished(run_id, fencing_token, chosen),
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
            error_json = self._json("error", error, obj=True, nullable=True)
            sql = "SELECT runledger.release_lease(%s, %s, %s, %s, %s::jsonb)"
            params = (run_id, lease_id, fencing_token, reason, error_json)
        await self._write(
            sql,
            params,
            result=lambda _: Released(run_id=RunId(run_id), reason=reason),
            landed=lambda: self.released(run_id, fencing_token, reason),
            fields=fields,
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
        await self._read(  # a second copy of this event is harmless
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
        rows = await self._read(
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
        detail_json = self._json("detail", detail, obj=True)
        rows = await self._read(  # safe to repeat: a second release writes nothing
            "SELECT runledger.release_call(%s, %s, %s, %s, %s, %s::jsonb) AS released",
            (run_id, lease_id, fencing_token, idempotency_key, worker_id, detail_json),
            fields={"run_id": run_id, "fencing_token": fencing_token},
        )
        return bool(rows[0]["released"])

    async def register_worker(
        self, worker_id: str, hostname: str, pid: int, flows: Sequence[str]
    ) -> None:
        check_text("worker id", worker_id)
        await self._read(  # an upsert: safe to repeat
            "SELECT runledger.register_worker(%s, %s, %s, %s::text[])",
            (worker_id, hostname, pid, list(flows)),
        )

    async def register_worker_on(
        self,
        conn: psycopg.AsyncConnection[Any],
        worker_id: str,
        hostname: str,
        pid: int,
        flows: Sequence[str],
    ) -> None:
        """``register_worker`` on ``conn``, the worker's long-lived session (its listener
        connection), not on a pooled one: the database ties the registration to the
        calling session and refuses the id (RL008, ``WorkerConflict``) while another live
        session holds it. Not retried here: when ``conn`` fails, the caller opens a new
        session and registers on that one."""
        check_text("worker id", worker_id)
        check_text("hostname", hostname)
        for f in flows:
            check_text("flow", f)
        try:
            await conn.execute(
                "SELECT runledger.register_worker(%s, %s, %s, %s::text[])",
                (worker_id, hostname, pid, list(flows)),
            )
        except psycopg.Error as exc:
            mapped = map_error(exc, conn=conn)
            if mapped is not None:
                raise mapped from exc
            raise

    async def register_worker_v2_on(
        self,
        conn: psycopg.AsyncConnection[Any],
        worker_id: str,
        hostname: str,
        pid: int,
        flows: Sequence[str],
        *,
        session_lock: bool,
        process: str | None = None,
        incarnation: uuid.UUID | None = None,
        session: bool = True,
        silent_after: float | None = None,
        gone_process: str | None = None,
    ) -> tuple[int | None, int]:
        """``register_worker_v2`` on ``conn`` (as :meth:`register_worker_on`); with
        ``session_lock`` the session takes a session-level advisory lock under a fresh key.
        Returns the key (None without one) and the session's backend pid.

        ``session`` false (revision 0032): ``conn`` goes through a pooler, so the id is not
        tied to its session but held while the worker heartbeats: it is free once the
        worker has been silent for ``silent_after`` seconds. ``incarnation``: this
        process's own id (the same process may take its id back); ``gone_process``: the
        registered process, found gone on this host."""
        check_text("worker id", worker_id)
        check_text("hostname", hostname)
        for f in flows:
            check_text("flow", f)
        silent = None if silent_after is None else dt.timedelta(seconds=silent_after)
        try:
            cur = await conn.execute(
                "SELECT session_lock, session_pid FROM runledger.register_worker_v2"
                "(%s, %s, %s, %s::text[], %s, %s, %s::uuid, %s, %s::interval, %s)",
                (
                    worker_id,
                    hostname,
                    pid,
                    list(flows),
                    session_lock,
                    process,
                    incarnation,
                    session,
                    silent,
                    gone_process,
                ),
            )
            row = await cur.fetchone()
        except psycopg.Error as exc:
            mapped = map_error(exc, conn=conn)
            if mapped is not None:
                raise mapped from exc
            raise
        assert row is not None
        key, backend = row[0], row[1]
        return (None if key is None else int(key)), int(backend)

    async def heartbeat_listener_on(
        self, conn: psycopg.AsyncConnection[Any], worker_id: str
    ) -> tuple[int, bool]:
        """``heartbeat_listener`` on ``conn``: the backend pid that answered and whether a
        run of the worker's flows waits, held by a session that ended. Not retried."""
        cur = await conn.execute(
            "SELECT session_pid, takeover_due FROM runledger.heartbeat_listener(%s)", (worker_id,)
        )
        row = await cur.fetchone()
        assert row is not None
        return int(row[0]), bool(row[1])

    async def heartbeat_worker(
        self, worker_id: str, *, stopped: bool = False, incarnation: uuid.UUID | None = None
    ) -> None:
        """``heartbeat_worker``; with ``incarnation`` (revision 0032), refused with
        :class:`~runledger.errors.WorkerConflict` once another process holds the id."""
        if incarnation is None:
            await self._read("SELECT runledger.heartbeat_worker(%s, %s)", (worker_id, stopped))
            return
        await self._read(
            "SELECT runledger.heartbeat_worker(%s, %s, %s::uuid)", (worker_id, stopped, incarnation)
        )

    async def checkpoint_events(self, actor: str, min_age: dt.timedelta) -> dict[str, Any]:
        """``checkpoint_events`` (revision 0016): a checkpoint of the event chains unless
        the last one is younger than ``min_age`` (or another is being made, or no event
        came since); the newest checkpoint either way. Safe to repeat."""
        rows = await self._read(
            "SELECT * FROM runledger.checkpoint_events(%s, %s)", (actor, min_age)
        )
        return rows[0]
