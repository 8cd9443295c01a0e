"""The hot path's statements, sent through libpq without psycopg's cursor.

A psycopg cursor costs the worker's process about 130-180 us of CPU per statement on two
slow cores (query conversion, the prepared-statement manager, result bookkeeping, the
row factory, the generators its waits are made of), against 25 us for the same prepared
statement sent with ``PGconn.send_query_prepared`` and read back with one reader on the
event loop (measured side by side, ``bench/README.md``, "wire_cost.py"). The
worker sends one or two statements per tool call, so that difference is a large share of
its CPU per call.

:class:`Prepared` is one such statement: its SQL with ``$n`` placeholders and explicit
casts, prepared once per connection under a name of its own (psycopg's own prepared
statements are named ``_pg3_<n>``, so the two never meet). Parameters are dumped and
rows loaded by a psycopg ``Transformer`` of the connection, so every value is adapted
exactly as through a cursor (the connection's own loaders, ``decode.configure``
included), all in text format. An error comes back as the exception psycopg raises
for it (``psycopg.errors.error_from_result``), with its SQLSTATE and diagnostics: the
store maps it to a runledger exception as before. The connection's lock is held for
the whole exchange, as psycopg's ``execute`` holds it.

A connection whose ``prepare_threshold`` is None (psycopg's own "never prepare", which
:meth:`~runledger.db.execution.Executor.connect` sets behind a transaction pooler: a statement
prepared on one server session is not there at the next transaction, and another
client's may be) sends each statement unnamed instead (``PGconn.send_query_params``:
parsed and planned at each call, in one round trip as well). PgBouncer before 1.21 has no
prepared statements in transaction mode at all.
"""

from __future__ import annotations

import asyncio
import weakref
from collections.abc import Sequence
from typing import Any

import psycopg
from psycopg import errors as e
from psycopg import pq
from psycopg.adapt import PyFormat, Transformer

__all__ = ["Prepared", "execute"]

_TUPLES_OK = pq.ExecStatus.TUPLES_OK
_COMMAND_OK = pq.ExecStatus.COMMAND_OK
_STALE_NAME = "26000"  # invalid_sql_statement_name: the session lost its prepared statements


class Prepared:
    """One statement of the hot path: ``sql`` with ``$1..$n`` placeholders, each with a
    cast, sent as a prepared statement named ``name``."""

    __slots__ = ("formats", "name", "nparams", "sql", "sql_bytes")

    def __init__(self, name: str, sql: str, nparams: int) -> None:
        self.name = f"rl_{name}".encode()
        self.sql = sql
        self.sql_bytes = sql.encode()
        self.nparams = nparams
        self.formats = [PyFormat.TEXT] * nparams

    def __str__(self) -> str:
        return self.sql


class _Session:
    """What this module keeps of one connection: its statements prepared so far, and the
    transformer that adapts values for it."""

    __slots__ = ("prepared", "tx", "unnamed")

    def __init__(self, conn: psycopg.AsyncConnection[Any]) -> None:
        self.prepared: set[bytes] = set()
        self.tx = Transformer(conn)
        # psycopg's "never prepare" (a transaction pooler's connection): nor do we
        self.unnamed = conn.prepare_threshold is None


_SESSIONS: weakref.WeakKeyDictionary[psycopg.AsyncConnection[Any], _Session] = (
    weakref.WeakKeyDictionary()
)


async def execute(
    conn: psycopg.AsyncConnection[Any], stmt: Prepared, params: Sequence[Any]
) -> list[dict[str, Any]]:
    """Run ``stmt`` with ``params`` on ``conn`` (autocommit): its rows as dicts."""
    if len(params) != stmt.nparams:
        raise TypeError(f"{stmt.name.decode()} takes {stmt.nparams} parameters, got {len(params)}")
    session = _SESSIONS.get(conn)
    if session is None:
        session = _SESSIONS[conn] = _Session(conn)
    async with conn.lock:
        if session.unnamed:  # behind a transaction pooler: never prepared
            values = session.tx.dump_sequence(params, stmt.formats)
            conn.pgconn.send_query_params(stmt.sql_bytes, values)
            result = await _wait(conn.pgconn)
            if result.status != _TUPLES_OK:
                raise _error(conn, result)
        else:
            if stmt.name not in session.prepared:
                await _prepare(conn, stmt)
                session.prepared.add(stmt.name)
            values = session.tx.dump_sequence(params, stmt.formats)
            try:
                result = await _run(conn, stmt.name, values)
            except e.Error as exc:
                if exc.sqlstate != _STALE_NAME:
                    raise
                # the session's prepared statements are gone (DISCARD ALL): prepare it again
                session.prepared.clear()
                await _prepare(conn, stmt)
                session.prepared.add(stmt.name)
                result = await _run(conn, stmt.name, values)
        tx = session.tx
        tx.set_pgresult(result)
        names = [(result.fname(i) or b"").decode() for i in range(result.nfields)]
        rows = tx.load_rows(0, result.ntuples, tuple)
        return [dict(zip(names, row, strict=True)) for row in rows]


async def _prepare(conn: psycopg.AsyncConnection[Any], stmt: Prepared) -> None:
    conn.pgconn.send_prepare(stmt.name, stmt.sql.encode())
    result = await _wait(conn.pgconn)
    if result.status != _COMMAND_OK:
        raise _error(conn, result)


async def _run(
    conn: psycopg.AsyncConnection[Any], name: bytes, values: Sequence[Any]
) -> pq.abc.PGresult:
    conn.pgconn.send_query_prepared(name, values)
    result = await _wait(conn.pgconn)
    if result.status != _TUPLES_OK:
        raise _error(conn, result)
    return result


def _error(conn: psycopg.AsyncConnection[Any], result: pq.abc.PGresult) -> e.Error:
    if result.status == pq.ExecStatus.FATAL_ERROR:
        return e.error_from_result(result, encoding=conn.info.encoding)
    return e.InternalError(f"unexpected result status {pq.ExecStatus(result.status).name}")


async def _wait(pgconn: pq.abc.PGconn) -> pq.abc.PGresult:
    """Flush what was sent, wait for the reply, drain it: the last result (a single
    statement has one). A broken connection raises ``psycopg.OperationalError`` from
    libpq's calls, as through a cursor.

    On a plain connection the socket is read only once it is readable: ``is_busy`` parses
    what was read already, so a reply that came in one packet with its end (the usual
    case) costs one read, not also a read before it and one after its result that find
    nothing. With TLS or GSSAPI encryption, libpq may hold decrypted bytes the socket no
    longer shows as readable (the rest of a record larger than its buffer): there each
    wait but the first, right after the send, reads first, as libpq's own waits do."""
    loop = asyncio.get_running_loop()
    fd = pgconn.socket
    while pgconn.flush():  # 1: the socket's buffer is full, wait until it drains
        await _ready(loop, fd, write=True)
    buffered = _buffered(pgconn)
    first = True
    last = None
    while True:
        while pgconn.is_busy():
            if buffered and not first:
                pgconn.consume_input()
                if not pgconn.is_busy():
                    break
            first = False
            await _ready(loop, fd, write=False)
            pgconn.consume_input()
        res = pgconn.get_result()
        if res is None:
            break
        last = res
    if last is None:
        raise e.OperationalError("the server sent no result")
    return last


def _buffered(pgconn: pq.abc.PGconn) -> bool:
    """Whether the connection's transport decrypts into a buffer of its own."""
    if pgconn.ssl_in_use:
        return True
    try:
        return bool(pgconn.used_gssapi)
    except e.NotSupportedError:  # a libpq before 16 cannot say: assume it may
        return True


async def _ready(loop: asyncio.AbstractEventLoop, fd: int, *, write: bool) -> None:
    done = loop.create_future()

    def wake() -> None:
        if not done.done():
            done.set_result(None)

    if write:
        loop.add_writer(fd, wake)
    else:
        loop.add_reader(fd, wake)
    try:
        await done
    finally:
        if write:
            loop.remove_writer(fd)
        else:
            loop.remove_reader(fd)
