"""Connecting: fail fast and say why in one line.

:func:`probe` (which :meth:`runledger.db.execution.Executor.connect` and ``runledger
migrate`` call first) connects within the connect timeout and raises a
:class:`~runledger.errors.DatabaseUnavailable` naming host, port and database and what to
do (``createdb``, the role and password, the server), a
:class:`~runledger.errors.ConfigurationError` for a URL that is not one, and a
:class:`~runledger.errors.SchemaMissing` for a database without the runledger schema or
with an older revision of it (``runledger migrate``).
"""

from __future__ import annotations

import asyncio
import math
import os
import threading
from typing import Any

import psycopg
from psycopg.conninfo import conninfo_to_dict

from runledger import errors
from runledger.db.pooler import Reach, reach
from runledger.db.revisions import behind, head
from runledger.db.server import failure_reason, hosts_ports, in_recovery

# libpq's TCP settings for the pooled connections, where the URL sets none of its own: a
# server that vanishes without a reset (a primary cut off the network, then failed over)
# fails a statement in flight within seconds instead of when the kernel gives up
# retransmitting (tcp_retries2: about 15 min), during which every pooled connection waits
# on the dead host and the worker claims nothing on the new primary. A healthy server
# acknowledges at the TCP level while it runs a long statement: neither setting cuts that.
POOL_TCP: dict[str, str] = {
    "keepalives": "1",
    "keepalives_idle": "5",
    "keepalives_interval": "1",
    "keepalives_count": "3",
    "tcp_user_timeout": "10000",
}


def tcp_settings(url: str) -> dict[str, str]:
    """:data:`POOL_TCP` without the settings ``url`` makes itself."""
    try:
        given = conninfo_to_dict(url)
    except psycopg.ProgrammingError:
        return {}  # not a URL: the probe says so in one line
    return {k: v for k, v in POOL_TCP.items() if k not in given}


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


def _os_user() -> str:
    import getpass

    try:
        return getpass.getuser()
    except Exception:
        return "?"


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
        return errors.ConfigurationError(f"bad connection setting: {failure_reason(exc)}")
    host, port, dbname, role = _where(url)
    at = f"PostgreSQL at {hosts_ports(host, port)}"
    reason = failure_reason(exc)
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
