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

:meth:`Executor.pinned`: the statements of one task (a run's writes, and the tasks it
starts) go through one connection of the pool instead of a checkout each; a connection
failure unpins it, and the pool takes over again. The connection given back last is
handed out first (:class:`_Warm`).

Connecting (:func:`probe`, which :meth:`runledger.db.store.Store.connect` and
``runledger migrate`` call first) fails fast and says why in one line: within the connect
timeout, a :class:`~runledger.errors.DatabaseUnavailable` naming host, port and database
and what to do (``createdb``, the role and password, the server), a
:class:`~runledger.errors.ConfigurationError` for a URL that is not one, and a
:class:`~runledger.errors.SchemaMissing` for a database without the runledger schema or
with an older revision of it (``runledger migrate``).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import math
import os
import random
import re
import threading
import time
from collections.abc import AsyncIterator, Awaitable, Callable, Sequence
from contextvars import ContextVar
from enum import StrEnum
from typing import Any, LiteralString, TypeVar

import psycopg
from psycopg.conninfo import conninfo_to_dict
from psycopg.rows import dict_row
from psycopg.types.json import Jsonb
from psycopg_pool import AsyncConnectionPool

from runledger import errors
from runledger.db import wire
from runledger.db.pooler import Reach, reach
from runledger.db.rows import Row
from runledger.db.validate import check_json

log = logging.getLogger(__name__)

T = TypeVar("T")
E = TypeVar("E", bound=StrEnum)

RETRYABLE_SQLSTATES = {"40001", "40P01", "57P01", "57P02", "57P03", "55P03"}
INPUT_SQLSTATES = {"22P05", "22021", "22P02", "22007", "22008", "22003", "54000"}
READ_ONLY_SQLSTATE = "25006"  # read_only_sql_transaction: a hot standby, or a read-only session

AnyConnection = psycopg.Connection[Any] | psycopg.AsyncConnection[Any]

Landed = Callable[[], Awaitable[T | None]]


def is_connection_error(exc: psycopg.Error) -> bool:
    if isinstance(exc, psycopg.OperationalError) and (
        exc.sqlstate is None or exc.sqlstate.startswith("08") or exc.sqlstate.startswith("57P")
    ):
        return True
    return isinstance(exc, psycopg.InterfaceError)


def map_error(
    exc: psycopg.Error, *, conn: AnyConnection | None = None, **fields: Any
) -> errors.RunLedgerError | None:
    """The runledger exception for a driver error, or ``None`` when it is not a refusal.
    ``conn``, the connection that got it, tells a standby's refusal of a write from a
    read-only session's (:func:`read_only`)."""
    if exc.sqlstate == READ_ONLY_SQLSTATE:
        return read_only(exc, conn, **fields)
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


def hot_standby(conn: AnyConnection | None) -> bool | None:
    """Whether the server of ``conn`` is a hot standby, as it said itself: PostgreSQL 14
    and later report ``in_hot_standby`` when the session starts and again when a
    promotion ends recovery. None when it did not say (PostgreSQL 13, or no ``conn``):
    ask ``pg_is_in_recovery()`` then."""
    if conn is None:
        return None
    said = conn.info.parameter_status("in_hot_standby")
    return None if said is None else said == "on"


async def in_recovery(conn: psycopg.AsyncConnection[Any]) -> bool:
    """Whether the server of ``conn`` is a standby: as it said (:func:`hot_standby`), or
    asked (``pg_is_in_recovery()``) when it did not."""
    said = hot_standby(conn)
    if said is not None:
        return said
    cur = await conn.execute("SELECT pg_is_in_recovery()")
    row = await cur.fetchone()
    return bool(row is not None and row[0])


# the outermost function of a refusal's CONTEXT: its last line, innermost first
_CONTEXT_FUNCTION = re.compile(r'(?:PL/pgSQL function |SQL function ")(?:runledger\.)?(\w+)')


def read_only(exc: psycopg.Error, conn: AnyConnection | None, **fields: Any) -> errors.ReadOnly:
    """A write refused with SQLSTATE 25006, as one line: the contract function refused
    (or "the write"), the server's reason, and what to do: on a standby, point writes at
    the primary. Reads work there, so only a write ever gets this."""
    diag = exc.diag
    reason = diag.message_primary or _reason(exc)
    names = _CONTEXT_FUNCTION.findall(diag.context or "")
    what = f"runledger.{names[-1]}" if names else "the write"
    where = "the database"
    if conn is not None and conn.info.host:
        where = hosts_ports(conn.info.host, str(conn.info.port))
    standby = hot_standby(conn)
    if standby:
        why = f"{where} is a standby (in recovery): point writes at the primary"
    elif standby is False:
        why = (
            f"the session on {where} is read-only (default_transaction_read_only): "
            "writes need a read-write session"
        )
    else:
        why = f"{where} only reads (a standby, or a read-only session): point writes at the primary"
    return errors.ReadOnly(f"{what} refused: {reason}; {why}", standby=standby, **fields)


# -- connecting ----------------------------------------------------------------------------


def connect_timeout_param(seconds: float) -> int:
    """libpq's ``connect_timeout`` for ``seconds``: whole seconds, at least 2 (libpq's floor)."""
    return max(2, math.ceil(seconds))


def _where(url: str) -> tuple[str, str, str, str]:
    """(host, port, database, role) that ``url`` names, with libpq's environment defaults.

    Never the password. A string libpq cannot parse is a ``ConfigurationError``.
    """
    try:
        params = conninfo_to_dict(url)
    except psycopg.ProgrammingError as exc:
        reason = " ".join(str(exc).split())
        raise errors.ConfigurationError(
            f"the database URL is not a PostgreSQL URL ({reason}): "
            "expected postgresql://user@host:port/dbname"
        ) from None
    role = str(params.get("user") or os.environ.get("PGUSER") or _os_user())
    host = str(params.get("host") or params.get("hostaddr") or os.environ.get("PGHOST") or "")
    port = str(params.get("port") or os.environ.get("PGPORT") or "5432")
    dbname = str(params.get("dbname") or os.environ.get("PGDATABASE") or role)
    return host or "the local socket", port, dbname, role


def hosts_ports(host: str, port: str) -> str:
    """``host:port``; for a multi-host URL (``host=a,b port=1,2``) ``a:1,b:2``."""
    hosts, ports = host.split(","), port.split(",")
    if len(hosts) == 1:
        return f"{host}:{port}"
    if len(ports) == 1:
        ports = ports * len(hosts)
    return ",".join(f"{h}:{p}" for h, p in zip(hosts, ports, strict=False))


def _os_user() -> str:
    import getpass

    try:
        return getpass.getuser()
    except Exception:
        return "?"


_FAILED_AT = re.compile(r"^.*?failed: ", re.DOTALL)


def _reason(exc: BaseException) -> str:
    """libpq's reason, on one line: 'FATAL:  database "x" does not exist' -> 'database ...'."""
    lines = [line.strip() for line in str(exc).splitlines() if line.strip()]
    first = lines[0] if lines else type(exc).__name__
    first = _FAILED_AT.sub("", first.removeprefix("connection failed: "))
    return first.removeprefix("FATAL:").strip()


_AUTH = (
    "password authentication failed",
    "authentication failed",
    "no password supplied",
    "pg_hba.conf",
    "permission denied for database",
)


def connect_error(
    exc: BaseException, url: str, timeout: float | None
) -> errors.DatabaseUnavailable | errors.ConfigurationError:
    """The one-line runledger error for a failed connection attempt to ``url``."""
    if isinstance(exc, psycopg.ProgrammingError):
        try:
            _where(url)
        except errors.ConfigurationError as bad_url:
            return bad_url
        return errors.ConfigurationError(f"bad connection setting: {_reason(exc)}")
    host, port, dbname, role = _where(url)
    at = f"PostgreSQL at {hosts_ports(host, port)}"
    reason = _reason(exc)
    lowered = reason.lower()
    if "database" in lowered and "does not exist" in lowered:
        return errors.DatabaseUnavailable(
            f"database {dbname!r} does not exist on {at}: create it with `createdb {dbname}` "
            "(or CREATE DATABASE), then run `runledger migrate`"
        )
    if ("role" in lowered and "does not exist" in lowered) or any(a in lowered for a in _AUTH):
        return errors.DatabaseUnavailable(
            f"{at} refused role {role!r} for database {dbname!r} ({reason}): "
            "check the role and password in the database URL"
        )
    if isinstance(exc, TimeoutError | psycopg.errors.ConnectionTimeout) or "timeout" in lowered:
        within = f" within {timeout:g} s" if timeout is not None else ""
        return errors.DatabaseUnavailable(
            f"no answer from {at} (database {dbname!r}){within}: check the host and port in "
            "the database URL and that the server is running (or raise --connect-timeout)"
        )
    return errors.DatabaseUnavailable(
        f"cannot reach {at} (database {dbname!r}): {reason}; "
        "check that the server is running and the host and port in the database URL"
    )


async def probe(
    url: str,
    *,
    timeout: float,
    application_name: str = "runledger",
    check_schema: bool = True,
    writes: str | None = None,
    detect_pooler: bool = False,
) -> tuple[Reach, str] | None:
    """Connect once within ``timeout`` seconds and check the schema, or raise the one line.

    The schema check: ``runledger.runs`` exists, and the database is not at an older
    revision than this code's head (a newer one is fine: two releases share a database
    during a rolling deploy). ``writes`` names what is about to write (``"the
    migration"``): a standby is then :class:`~runledger.errors.ReadOnly` before it starts.
    With ``detect_pooler``, what the URL reaches and why (:func:`runledger.db.pooler.reach`);
    else None.

    A connection the server ends while the checks run (an operator's
    ``pg_terminate_backend``, a restart) is opened again within the same ``timeout``: a
    process starting then is not stopped by it.
    """
    host, port, dbname, _ = _where(url)
    loop = asyncio.get_running_loop()
    deadline = loop.time() + timeout
    while True:
        left = max(0.1, deadline - loop.time())
        try:
            async with asyncio.timeout(left):
                conn = await psycopg.AsyncConnection.connect(
                    url,
                    autocommit=True,
                    connect_timeout=connect_timeout_param(left),
                    application_name=application_name[:63],
                    prepare_threshold=None,  # a few statements, and perhaps through a pooler
                )
        except TimeoutError as exc:
            raise connect_error(exc, url, timeout) from None
        except psycopg.Error as exc:
            raise connect_error(exc, url, timeout) from None
        try:
            async with conn:
                if writes is not None and await in_recovery(conn):
                    where = hosts_ports(conn.info.host, str(conn.info.port))
                    raise errors.ReadOnly(
                        f"{writes} refused: {where} is a standby (in recovery): point writes "
                        "at the primary",
                        standby=True,
                    )
                if check_schema:
                    await _check_schema(conn, f"database {dbname!r} at {hosts_ports(host, port)}")
                if not detect_pooler:
                    return None
                try:
                    async with asyncio.timeout(max(0.1, deadline - loop.time())):
                        return await reach(
                            conn,
                            url,
                            connect_timeout=connect_timeout_param(left),
                            application_name=application_name[:63],
                        )
                except TimeoutError as exc:
                    raise connect_error(exc, url, timeout) from None
        except psycopg.OperationalError as exc:
            if not conn.broken or loop.time() >= deadline:  # not a lost connection: as is
                raise connect_error(exc, url, timeout) from None


def probe_blocking(
    url: str,
    *,
    timeout: float,
    application_name: str = "runledger",
    check_schema: bool = True,
    writes: str | None = None,
) -> None:
    """:func:`probe` from synchronous code, whether or not an event loop runs in this thread
    (it gets a loop of its own, in a thread of its own)."""
    failure: list[BaseException] = []

    def target() -> None:
        try:
            asyncio.run(
                probe(
                    url,
                    timeout=timeout,
                    application_name=application_name,
                    check_schema=check_schema,
                    writes=writes,
                )
            )
        except BaseException as exc:
            failure.append(exc)

    thread = threading.Thread(target=target, name="runledger-probe", daemon=True)
    thread.start()
    thread.join()
    if failure:
        raise failure[0]


async def _check_schema(conn: psycopg.AsyncConnection[Any], where: str) -> None:
    from runledger.db.migrate import behind, head

    cur = await conn.execute(
        "SELECT to_regclass('runledger.runs') IS NOT NULL, "
        "to_regclass('runledger.alembic_version') IS NOT NULL"
    )
    found = await cur.fetchone()
    has_runs, has_version = found if found is not None else (False, False)
    if not has_runs:
        raise errors.SchemaMissing(
            f"{where} has no runledger schema: run `runledger migrate` with this database URL"
        )
    if not has_version:
        return
    cur = await conn.execute("SELECT version_num FROM runledger.alembic_version LIMIT 1")
    row = await cur.fetchone()
    version = None if row is None else str(row[0])
    if behind(version):
        raise errors.SchemaMissing(
            f"{where} is at schema revision {version or 'none'}, this code needs {head()}: "
            "run `runledger migrate`"
        )


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
    """The pool and the retry loop every statement of the store goes through."""

    # what the pool's URL reaches (runledger.db.pooler), and why it looks so ('' when the
    # pooler setting said): set by Store.connect
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

    async def _rows(self, sql: LiteralString | wire.Prepared, params: Sequence[Any]) -> list[Row]:
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

    async def _read(
        self,
        sql: LiteralString | wire.Prepared,
        params: Sequence[Any],
        *,
        fields: dict[str, Any] | None = None,
    ) -> list[Row]:
        """A statement that is safe to repeat: sent again after any connection failure."""
        return await self._execute(sql, params, fields or {}, _rows_as_is, None)

    async def _write(
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
        return await self._execute(sql, params, fields or {}, result, landed)

    async def _execute(
        self,
        sql: LiteralString | wire.Prepared,
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
        text = check_json(what, value, obj=obj, nullable=nullable, cap=self.max_payload_bytes)
        if text is None:
            return None
        # the text the check made is what is sent: the value is not encoded a second time
        return Jsonb(value, dumps=lambda _: text)
