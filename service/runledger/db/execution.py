"""Running one statement: the pool, and retries that never repeat a write.

Every statement is one contract function call (or one read) in autocommit, so one
statement is one transaction. Two ways to send one:

- :meth:`Executor.read`: safe to repeat (reads, renewals, functions that are no-ops
  when repeated). Sent again after any connection failure.
- :meth:`Executor.write`: not safe to repeat. A connection failure while the statement
  was in flight leaves the outcome unknown (the COMMIT may have landed), so before
  sending it again the write's read-back, ``landed`` (:mod:`runledger.db.landed`), is
  asked: it returns the write's typed result when the row shows the write, or ``None``
  when it did not land.

Serialization failures and deadlocks (the transaction was rolled back) are sent again
without a read-back. A refusal is mapped by :func:`runledger.db.sqlstate.map_error`, the
one place that maps SQLSTATEs; any other error of the server (a full disk, a statement
timeout) is :class:`~runledger.errors.ServerError`, naming its SQLSTATE, and is not sent
again here: the caller decides (a worker keeps a result it holds and retries it).

:meth:`Executor.pinned`: the statements of one task (a run's writes, and the tasks it
starts) go through one connection of the pool instead of a checkout each; a connection
failure unpins it, and the pool takes over again. The connection given back last is
handed out first (:class:`_Warm`).

Connecting (:meth:`Executor.connect`) probes first (:mod:`runledger.db.connecting`) and
fails fast, in one line.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import random
import time
from collections.abc import AsyncIterator, Awaitable, Callable, Sequence
from contextvars import ContextVar
from typing import Any, LiteralString, TypeVar, cast

import psycopg
from psycopg.rows import dict_row
from psycopg.types.json import Jsonb
from psycopg_pool import AsyncConnectionPool, PoolTimeout

from runledger import errors
from runledger.config import default, url_connect_timeout
from runledger.db import decode, wire
from runledger.db.connecting import connect_error, connect_timeout_param, probe, tcp_settings
from runledger.db.pooler import Reach
from runledger.db.rows import Row
from runledger.db.sqlstate import (
    RETRYABLE_SQLSTATES,
    is_connection_error,
    map_error,
    raise_mapped,
    read_only,
    server_error,
)
from runledger.db.validate import check_json

log = logging.getLogger(__name__)

T = TypeVar("T")

Landed = Callable[[], Awaitable[T | None]]


def _rows_as_is(rows: list[Row]) -> list[Row]:
    return rows


WARM_SECONDS = 1.0  # how long the connection given back last waits out of the pool


class _Warm:
    """The connection given back last, kept out of ``pool`` for up to
    :data:`WARM_SECONDS` and handed out before the pool's (last in, first out). A worker
    that sends one statement at a time then keeps to one server backend. psycopg's pool
    hands its idle connections out in turn (first in, first out): a worker whose next run
    started before the last one gave its connection back (a claim sent with a final
    decision) switched backends at every run, and each statement of a backend that sat
    idle while another worked took about a tenth longer (cold caches; bench/README.md,
    session 16). Only an idle, open connection is kept; any other goes back to the pool,
    which sorts it out."""

    __slots__ = ("at", "closed", "conn", "pool")

    def __init__(self, pool: AsyncConnectionPool) -> None:
        self.pool = pool
        self.conn: psycopg.AsyncConnection[Any] | None = None
        self.at = 0.0
        self.closed = False

    async def checkout(self) -> psycopg.AsyncConnection[Any]:
        conn, self.conn = self.conn, None
        if conn is not None:
            if time.monotonic() - self.at <= WARM_SECONDS and _idle(conn):
                return conn
            await self.pool.putconn(conn)
        return await self.pool.getconn()

    async def checkin(self, conn: psycopg.AsyncConnection[Any]) -> None:
        if self.conn is None and not self.closed and _idle(conn):
            self.conn, self.at = conn, time.monotonic()
            return
        await self.pool.putconn(conn)

    async def close(self) -> None:
        self.closed = True
        conn, self.conn = self.conn, None
        if conn is not None:
            await self.pool.putconn(conn)


def _idle(conn: psycopg.AsyncConnection[Any]) -> bool:
    return (
        not conn.closed
        and not conn.broken
        and conn.info.transaction_status == psycopg.pq.TransactionStatus.IDLE
    )


class _Pin:
    """One connection of the pool lent to a task and the tasks it starts. A statement
    in flight keeps it lent; once released (and idle) it goes back (through ``warm``),
    and so it does, unpinned, after a connection failure (the pool discards a broken
    one)."""

    __slots__ = ("conn", "released", "users", "warm")

    def __init__(self, warm: _Warm, conn: psycopg.AsyncConnection[Any]) -> None:
        self.warm = warm
        self.conn: psycopg.AsyncConnection[Any] | None = conn
        self.users = 0
        self.released = False

    async def _give_back(self) -> None:
        conn, self.conn = self.conn, None
        if conn is not None:
            await self.warm.checkin(conn)

    async def done_with(self, lost: bool) -> None:
        self.users -= 1
        if lost:
            self.released = True
        if self.released and self.users == 0:
            await self._give_back()

    async def release(self) -> None:
        self.released = True
        if self.users == 0:
            await self._give_back()


_PINNED: ContextVar[_Pin | None] = ContextVar("runledger_pinned", default=None)


async def _send(
    conn: psycopg.AsyncConnection[Any], sql: LiteralString | wire.Prepared, params: Sequence[Any]
) -> list[Row]:
    """One statement on ``conn``: a hot-path one without a cursor (runledger.db.wire). A
    write refused because the server only reads is mapped here, where the connection
    says whether it is a standby's."""
    try:
        if isinstance(sql, wire.Prepared):
            return await wire.execute(conn, sql, params)
        async with conn.cursor(row_factory=dict_row) as cur:
            await cur.execute(sql, params)
            return await cur.fetchall() if cur.description else []
    except psycopg.errors.ReadOnlySqlTransaction as exc:
        raise read_only(exc, conn) from exc


class Executor:
    """The pool and the retry loop every statement of the stores goes through: the one
    place that sends SQL on a pooled connection (:meth:`read`, :meth:`write`) or on a
    session of the caller's (:meth:`send_on`), and maps what the server refuses
    (:mod:`runledger.db.sqlstate`)."""

    # what the pool's URL reaches (runledger.db.pooler), and why it looks so ('' when the
    # pooler setting said): set by connect
    reach: Reach = "direct"
    reach_why: str = ""

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
        self._warm = _Warm(pool)
        self.retries = retries
        self.backoff = backoff
        self.max_backoff = max_backoff
        self.max_payload_bytes = max_payload_bytes

    async def close(self) -> None:
        await self._warm.close()
        await self.pool.close()

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
    ) -> Executor:
        """Probe the database once, then open the pool; fail within ``connect_timeout``.

        ``connect_timeout`` (seconds): when ``None``, the URL's own ``connect_timeout``,
        else the ``connect_timeout`` setting's default. A database that cannot be reached
        is :class:`~runledger.errors.DatabaseUnavailable`, one without the runledger schema
        (or an older one) :class:`~runledger.errors.SchemaMissing`, a string that is not a
        URL :class:`~runledger.errors.ConfigurationError`: one line each, naming host, port
        and database (see :func:`runledger.db.connecting.probe`).

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
        reached, why = found or (pooler, "")  # as the pooler setting says
        options: dict[str, Any] = {
            "autocommit": True,
            "row_factory": dict_row,
            "application_name": name,
            "connect_timeout": connect_timeout_param(timeout),
            **tcp_settings(url),  # a vanished server fails the socket in seconds
        }
        if reached == "transaction":  # a statement prepared on one server session is not
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
        executor = cls(pool, **kwargs)
        executor.reach, executor.reach_why = cast(Reach, reached), why
        return executor

    async def rows(self, sql: LiteralString | wire.Prepared, params: Sequence[Any]) -> list[Row]:
        """Send one statement: the only place that talks to the driver."""
        pin = _PINNED.get()
        if pin is not None and pin.warm is self._warm and not pin.released:
            conn = pin.conn
            assert conn is not None
            pin.users += 1
            lost = False
            try:
                return await _send(conn, sql, params)
            except psycopg.Error as exc:
                lost = is_connection_error(exc) or conn.closed or conn.broken
                raise
            except errors.ReadOnly:  # the server refused; the connection is as good as before
                raise
            except BaseException:  # cancelled mid-statement: the connection's state is
                lost = True  # not known; the pool sorts it out when it comes back
                raise
            finally:
                await pin.done_with(lost)
        conn = await self._warm.checkout()
        try:
            return await _send(conn, sql, params)
        finally:
            await self._warm.checkin(conn)

    @contextlib.asynccontextmanager
    async def pinned(self) -> AsyncIterator[None]:
        """Send this task's statements (and those of the tasks it starts) through one
        connection, checked out once. Every statement stays its own autocommit
        transaction; what differs is only that each one skips the pool's checkout. A
        statement still in flight at the exit (a fenced run's write in the background)
        keeps the connection until it ends."""
        try:
            conn = await self._warm.checkout()
        except Exception:  # the pool is exhausted or closing: the statements check out
            yield
            return
        pin = _Pin(self._warm, conn)
        token = _PINNED.set(pin)
        try:
            yield
        finally:
            _PINNED.reset(token)
            await pin.release()

    async def send_on(
        self, conn: psycopg.AsyncConnection[Any], sql: LiteralString, params: Sequence[Any]
    ) -> tuple[Any, ...] | None:
        """One statement on ``conn``, a session of the caller's (a worker's listener
        connection), not a pooled one: its first row as a tuple (None for none), a refusal
        as its runledger exception. Not retried: when ``conn`` fails, the caller opens a
        new session."""
        try:
            cur = await conn.execute(sql, params)
            return await cur.fetchone() if cur.description else None
        except psycopg.Error as exc:
            raise_mapped(exc, conn=conn)
            raise

    async def once_aside(
        self,
        url: str,
        sql: LiteralString,
        params: Sequence[Any],
        *,
        timeout: float,
    ) -> list[Row]:
        """One statement that is safe to repeat, on a session of its own opened to ``url``
        for it and closed after, all within ``timeout`` seconds: for when the pool is
        failing (a pooler restarting) and a statement cannot wait for the pool to
        reconnect. Not retried; a refusal is its runledger exception."""
        async with asyncio.timeout(timeout):
            options: dict[str, Any] = {
                "connect_timeout": connect_timeout_param(timeout),
                "application_name": "runledger-aside",
                **tcp_settings(url),  # a vanished server fails the socket in seconds
            }
            conn = await psycopg.AsyncConnection.connect(
                url,
                autocommit=True,
                prepare_threshold=None,  # one statement; a transaction pooler's session
                **options,
            )
            try:
                return await _send(conn, sql, params)
            except psycopg.Error as exc:
                raise_mapped(exc, conn=conn)
                raise
            finally:
                await conn.close()

    async def read(
        self,
        sql: LiteralString | wire.Prepared,
        params: Sequence[Any],
        *,
        fields: dict[str, Any] | None = None,
    ) -> list[Row]:
        """A statement that is safe to repeat: sent again after any connection failure."""
        return await self.execute(sql, params, fields or {}, _rows_as_is, None)

    async def write(
        self,
        sql: LiteralString | wire.Prepared,
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
        return await self.execute(sql, params, fields or {}, result, landed)

    async def execute(
        self,
        sql: LiteralString | wire.Prepared,
        params: Sequence[Any],
        fields: dict[str, Any],
        result: Callable[[list[Row]], T],
        landed: Landed[T] | None,
    ) -> T:
        """Send the statement, retrying as :meth:`read` (``landed`` None) or :meth:`write`
        do; ``result`` builds the value from its rows."""
        delay = self.backoff
        for attempt in range(self.retries + 1):
            try:
                rows = await self.rows(sql, params)
            except psycopg.Error as exc:
                mapped = map_error(exc, **fields)
                if mapped is not None:
                    raise mapped from exc
                connection_lost = is_connection_error(exc)
                if not connection_lost and exc.sqlstate not in RETRYABLE_SQLSTATES:
                    failed = server_error(exc, **fields)  # a full disk, a timeout, ...
                    if failed is None:  # the driver's own error (no SQLSTATE)
                        raise
                    raise failed from exc
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

    def json(self, what: str, value: Any, *, obj: bool, nullable: bool = False) -> Jsonb | None:
        text = check_json(what, value, obj=obj, nullable=nullable, cap=self.max_payload_bytes)
        if text is None:
            return None
        # the text the check made is what is sent: the value is not encoded a second time
        return Jsonb(value, dumps=lambda _: text)
