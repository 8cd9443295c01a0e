"""What a database URL reaches: PostgreSQL itself, or a pooler (docs/operating.md, "PgBouncer").

Three answers (:data:`Reach`):

- ``direct``: PostgreSQL, each connection its own server session;
- ``session``: a pooler or proxy that gives each client a server session of its own for
  as long as the client stays connected (PgBouncer's ``pool_mode = session``, HAProxy, a
  TCP proxy). Prepared statements and LISTEN work; a session does not end when its
  client does, so a session lock or a registration tied to it outlives the worker;
- ``transaction``: a pooler that hands the server session to another client at the end
  of each transaction (PgBouncer's ``transaction`` and ``statement`` modes, the default of
  most managed poolers). Nothing prepared or set on a session is there at the next
  transaction, another client's may be, and LISTEN and session locks are meaningless.

``RUNLEDGER_POOLER`` (``session`` or ``transaction``) says which, as Prisma's
``pgbouncer=true`` and psycopg's ``prepare_threshold=None`` are told, and then nothing is
probed. Left at ``auto``, :func:`reach` finds out on a connection that is open anyway:
one statement when the server sees the client port this connection's socket has (a TCP
connection straight to the server); otherwise a second connection, and a transaction
pooler is what lets that one see the first one's backend, or the first one another
backend, while both stay connected. A session never changes hands, so nothing else can
look like a transaction pooler; one whose pool happens to hand out other backends three
times in a row would look like a session pooler (say ``transaction`` there).
"""

from __future__ import annotations

import os
import socket
from typing import Any, Literal

import psycopg
from psycopg.rows import tuple_row

__all__ = ["Reach", "backend", "local_port", "reach", "reach_blocking", "read_only_session"]

Reach = Literal["direct", "session", "transaction"]

ROUNDS = 3
BACKEND = "SELECT pg_backend_pid(), inet_client_port()"


def local_port(conn: psycopg.AsyncConnection[Any] | psycopg.Connection[Any]) -> int | None:
    """The client port of the connection's socket; None for a Unix socket."""
    dup = socket.socket(fileno=os.dup(conn.pgconn.socket))
    try:
        if dup.family not in (socket.AF_INET, socket.AF_INET6):
            return None
        return int(dup.getsockname()[1])
    finally:
        dup.close()


async def backend(conn: psycopg.AsyncConnection[Any]) -> tuple[int, int | None]:
    """The backend pid that answers on ``conn``, and the client port the server sees."""
    async with conn.cursor(row_factory=tuple_row) as cur:
        await cur.execute(BACKEND, prepare=False)
        row = await cur.fetchone()
    assert row is not None
    return int(row[0]), (None if row[1] is None else int(row[1]))


async def reach(
    conn: psycopg.AsyncConnection[Any], url: str, *, connect_timeout: int, application_name: str
) -> tuple[Reach, str]:
    """What ``conn`` (opened from ``url``, autocommit, idle) reaches, and why it looks so."""
    first, port = await backend(conn)
    local = local_port(conn)
    if local is not None and local == port:
        return DIRECT
    other = await psycopg.AsyncConnection.connect(
        url,
        autocommit=True,
        prepare_threshold=None,
        connect_timeout=connect_timeout,
        application_name=application_name,
    )
    try:
        for _ in range(ROUNDS):
            theirs, _ = await backend(other)
            mine, _ = (first, None) if theirs == first else await backend(conn)
            if theirs == first or mine != first:
                return _moved(first, theirs, mine)
    finally:
        await other.close()
    return _kept(port, local)


def reach_blocking(
    conn: psycopg.Connection[Any], url: str, *, connect_timeout: int, application_name: str
) -> tuple[Reach, str]:
    """:func:`reach` for a synchronous connection."""
    first, port = _backend_blocking(conn)
    local = local_port(conn)
    if local is not None and local == port:
        return DIRECT
    with psycopg.connect(
        url,
        autocommit=True,
        prepare_threshold=None,
        connect_timeout=connect_timeout,
        application_name=application_name,
    ) as other:
        for _ in range(ROUNDS):
            theirs, _ = _backend_blocking(other)
            mine, _ = (first, None) if theirs == first else _backend_blocking(conn)
            if theirs == first or mine != first:
                return _moved(first, theirs, mine)
    return _kept(port, local)


def read_only_session(conn: psycopg.Connection[Any], url: str, pooler: str) -> None:
    """Make the session of ``conn`` (from ``url``; ``pooler``: the setting) read-only
    (``default_transaction_read_only``), where that session is this client's alone.

    Through a pooler in transaction mode the setting would stay on the pooler's server
    session after this client is gone, and the next client there (a worker) would have
    every write refused (25006): there the session is left as it is, and only what
    psycopg starts itself is read-only (``BEGIN READ ONLY``); what reads this way sends
    nothing but reads anyway. (A pooler in session mode resets a session, ``DISCARD
    ALL``, before the next client has it.)"""
    conn.read_only = True
    through = pooler
    if pooler == "auto":
        timeout = int(conn.info.get_parameters().get("connect_timeout") or 5)
        through, _ = reach_blocking(
            conn, url, connect_timeout=max(2, timeout), application_name="runledger-probe"
        )
    if through != "transaction":
        conn.execute("SET default_transaction_read_only = on")


DIRECT: tuple[Reach, str] = ("direct", "the server sees this connection's own client port")


def _backend_blocking(conn: psycopg.Connection[Any]) -> tuple[int, int | None]:
    with conn.cursor(row_factory=tuple_row) as cur:
        row = cur.execute(BACKEND, prepare=False).fetchone()
    assert row is not None
    return int(row[0]), (None if row[1] is None else int(row[1]))


def _moved(first: int, theirs: int, mine: int) -> tuple[Reach, str]:
    if theirs == first:
        return "transaction", (
            f"another connection was answered by backend {first}, which answered this one, "
            "while both stayed connected: a pooler in transaction mode"
        )
    return "transaction", (
        f"the backend changed between two statements ({first}, then {mine}): a pooler in "
        "transaction mode"
    )


def _kept(port: int | None, local: int | None) -> tuple[Reach, str]:
    """No session changed hands: PostgreSQL itself over a Unix socket, or a proxy."""
    if local is None and port is None:
        return "direct", "a Unix socket whose session never changed hands"
    where = "a Unix socket" if local is None else f"client port {local}"
    return "session", (
        f"the server sees client port {port}, this connection has {where}: a pooler or "
        "proxy that keeps a server session per client"
    )
