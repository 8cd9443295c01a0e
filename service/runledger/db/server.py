"""What a connection says of its server: a standby or not, and where it is (its address,
its data directory)."""

from __future__ import annotations

import re
from typing import Any

import psycopg

AnyConnection = psycopg.Connection[Any] | psycopg.AsyncConnection[Any]


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


def data_directory(conn: psycopg.Connection[Any]) -> str | None:
    """The server's ``data_directory`` (needs superuser or ``pg_read_all_settings``);
    None if it said nothing."""
    row = conn.execute("SHOW data_directory").fetchone()
    return str(row[0]) if row else None


def hosts_ports(host: str, port: str) -> str:
    """``host:port``; for a multi-host URL (``host=a,b port=1,2``) ``a:1,b:2``."""
    hosts, ports = host.split(","), port.split(",")
    if len(hosts) == 1:
        return f"{host}:{port}"
    if len(ports) == 1:
        ports = ports * len(hosts)
    return ",".join(f"{h}:{p}" for h, p in zip(hosts, ports, strict=False))


_FAILED_AT = re.compile(r"^.*?failed: ", re.DOTALL)


def failure_reason(exc: BaseException) -> str:
    """libpq's reason, on one line: 'FATAL:  database "x" does not exist' -> 'database ...'."""
    lines = [line.strip() for line in str(exc).splitlines() if line.strip()]
    first = lines[0] if lines else type(exc).__name__
    first = _FAILED_AT.sub("", first.removeprefix("connection failed: "))
    return first.removeprefix("FATAL:").strip()
