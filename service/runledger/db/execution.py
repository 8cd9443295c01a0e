"""Running one statement: the pool, SQLSTATE mapping, and retries that never repeat a write.

Every statement is one contract function call (or one read) in autocommit, so one
statement is one transaction. Two ways to send one:

- :meth:`Executor._read`: safe to repeat (reads, renewals, functions that are no-ops
  when repeated). Sent again after any connection failure.
- :meth:`Executor._write`: not safe to repeat. A connection failure while the statement
  was in flight leaves the outcome unknown (the COMMIT may have landed), so before
  sending it again the write's read-back, ``landed``, is asked: it returns the write's
  typed result when the row shows the write, or ``None`` when it did not land.

Serialization failures and deadlocks (the transaction was rolled back) are sent again
without a read-back.
"""

from __future__ import annotations

import asyncio
import logging
import random
from collections.abc import Awaitable, Callable, Sequence
from enum import StrEnum
from typing import Any, LiteralString, TypeVar

import psycopg
from psycopg.rows import dict_row
from psycopg.types.json import Jsonb
from psycopg_pool import AsyncConnectionPool

from runledger import errors
from runledger.db.rows import Row
from runledger.db.validate import check_json

log = logging.getLogger(__name__)

T = TypeVar("T")
E = TypeVar("E", bound=StrEnum)

RETRYABLE_SQLSTATES = {"40001", "40P01", "57P01", "57P02", "57P03", "55P03"}
INPUT_SQLSTATES = {"22P05", "22021", "22P02", "22007", "22008", "22003", "54000"}

Landed = Callable[[], Awaitable[T | None]]


def is_connection_error(exc: psycopg.Error) -> bool:
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


def word(what: str, value: str, enum: type[E]) -> E:
    """``value`` as a member of ``enum``, or ``InvalidInput`` naming the allowed words."""
    try:
        return enum(value)
    except ValueError:
        allowed = ", ".join(m.value for m in enum)
        raise errors.InvalidInput(
            f"unknown {what} {value!r}", hint=f"expected one of: {allowed}"
        ) from None


def _rows_as_is(rows: list[Row]) -> list[Row]:
    return rows


class Executor:
    """The pool and the retry loop every statement of the store goes through."""

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

    async def close(self) -> None:
        await self.pool.close()

    async def _rows(self, sql: LiteralString, params: Sequence[Any]) -> list[Row]:
        """Send one statement: the only place that talks to the driver."""
        async with self.pool.connection() as conn, conn.cursor(row_factory=dict_row) as cur:
            await cur.execute(sql, params)
            return await cur.fetchall() if cur.description else []

    async def _read(
        self, sql: LiteralString, params: Sequence[Any], *, fields: dict[str, Any] | None = None
    ) -> list[Row]:
        """A statement that is safe to repeat: sent again after any connection failure."""
        return await self._execute(sql, params, fields or {}, _rows_as_is, None)

    async def _write(
        self,
        sql: LiteralString,
        params: Sequence[Any],
        *,
        result: Callable[[list[Row]], T],
        landed: Landed[T],
        fields: dict[str, Any] | None = None,
    ) -> T:
        """A write that must not be applied twice.

        ``result`` builds the typed value from the function's reply; ``landed`` builds
        the same value from the tables after an ambiguous failure, or returns ``None``
        when the write did not land, and only then is the statement sent again.
        """
        return await self._execute(sql, params, fields or {}, result, landed)

    async def _execute(
        self,
        sql: LiteralString,
        params: Sequence[Any],
        fields: dict[str, Any],
        result: Callable[[list[Row]], T],
        landed: Landed[T] | None,
    ) -> T:
        delay = self.backoff
        for attempt in range(self.retries + 1):
            try:
                rows = await self._rows(sql, params)
            except psycopg.Error as exc:
                mapped = map_error(exc, **fields)
                if mapped is not None:
                    raise mapped from exc
                connection_lost = is_connection_error(exc)
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
                if connection_lost and landed is not None:
                    value = await landed()  # its reads retry connection failures themselves
                    if value is not None:
                        log.info("the write landed before the connection dropped", extra=fields)
                        return value
                continue
            return result(rows)
        raise AssertionError("unreachable")

    def _json(self, what: str, value: Any, *, obj: bool, nullable: bool = False) -> Jsonb | None:
        check_json(what, value, obj=obj, nullable=nullable, cap=self.max_payload_bytes)
        return None if value is None else Jsonb(value)
