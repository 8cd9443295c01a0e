"""The reads of ``runledger doctor`` (:mod:`runledger.doctor`), each one statement on one
read-only connection: the server, the schema's revision, replication, the timelines seen,
the roles, the default isolation, the database's clock; and one write, rolled back
(:func:`write_probe`). Nothing is kept. And whether a login may act as an operator
(:func:`can_act`, for ``runledger console``)."""

from __future__ import annotations

from typing import Any, LiteralString

import psycopg
from psycopg import sql
from psycopg.rows import dict_row

from runledger.config import connection_settings
from runledger.db.pooler import read_only_session

Row = dict[str, Any]
Conn = psycopg.Connection[Row]

# The function an operator-role login may execute and an auditor's may not.
OPERATOR_ACT = "runledger.resolve_call(text, text, jsonb, text, text)"


def doctor_connection(database_url: str, connect_timeout: float) -> Conn:
    """An autocommit connection (the driver's error if there is none)."""
    return psycopg.connect(
        database_url,
        autocommit=True,
        row_factory=dict_row,
        connect_timeout=max(2, int(connect_timeout + 0.999)),
        application_name="runledger-doctor",
    )


def read_only(conn: Conn, database_url: str) -> None:
    """Make ``conn``'s session read-only, except on a transaction pooler's (it would stay
    read-only for the pooler's next client there: a worker)."""
    read_only_session(conn, database_url, connection_settings().pooler)


def _one(conn: Conn, sql: LiteralString, params: tuple[Any, ...] = ()) -> Row:
    row = conn.execute(sql, params).fetchone()
    assert row is not None
    return row


def server_facts(conn: Conn) -> Row:
    """``version``, ``num`` (server_version_num), ``standby``, ``host``, ``port``."""
    return _one(
        conn,
        "SELECT current_setting('server_version') AS version, "
        "current_setting('server_version_num')::int AS num, pg_is_in_recovery() AS standby, "
        "inet_server_addr()::text AS host, inet_server_port() AS port",
    )


def schema_revision(conn: Conn) -> tuple[bool, str | None]:
    """Whether the schema has its revision table, and the revision in it."""
    row = _one(conn, "SELECT to_regclass('runledger.alembic_version') IS NOT NULL AS present")
    if not row["present"]:
        return False, None
    found = conn.execute("SELECT version_num FROM runledger.alembic_version").fetchone()
    return True, (found["version_num"] if found else None)


def replication_facts(conn: Conn) -> tuple[Row, list[Row]]:
    """``synchronous_standby_names`` (``names``) and ``synchronous_commit`` (``commit``),
    and the streaming standbys with their sync state."""
    settings = _one(
        conn,
        "SELECT current_setting('synchronous_standby_names') AS names, "
        "current_setting('synchronous_commit') AS commit",
    )
    standbys = conn.execute(
        "SELECT application_name, client_addr::text AS client_addr, state, sync_state "
        "FROM pg_stat_replication ORDER BY application_name, client_addr"
    ).fetchall()
    return settings, standbys


def timeline_facts(conn: Conn) -> tuple[list[Row], int]:
    """The timelines runledger has seen, in order, and the server's timeline now."""
    rows = conn.execute(
        "SELECT position, timeline, previous_timeline, seen_at, affected_runs, lossless, "
        "evidence FROM runledger.timelines ORDER BY position"
    ).fetchall()
    now = _one(
        conn,
        "SELECT ('x' || substr(pg_walfile_name(pg_current_wal_lsn()), 1, 8))::bit(32)::int "
        "AS timeline",
    )["timeline"]
    return rows, int(now)


def present_roles(conn: Conn, roles: tuple[str, ...]) -> list[str]:
    """Those of ``roles`` that exist, sorted."""
    rows = conn.execute(
        "SELECT rolname FROM pg_roles WHERE rolname = ANY (%s)", (list(roles),)
    ).fetchall()
    return sorted(r["rolname"] for r in rows)


def default_isolation(conn: Conn) -> str:
    """This login's ``default_transaction_isolation``."""
    level: str = _one(conn, "SELECT current_setting('default_transaction_isolation') AS level")[
        "level"
    ]
    return level


def database_clock(conn: Conn) -> float:
    """The database's ``clock_timestamp()``, seconds since the epoch."""
    return float(_one(conn, "SELECT extract(epoch FROM clock_timestamp())::float8 AS at")["at"])


def worker_clocks(conn: Conn) -> list[Row]:
    """Each live worker's host clock against the database's, as the worker measured it
    and said with its last heartbeat (``workers.clock_offset``), farthest first."""
    return conn.execute(
        """SELECT w.worker_id, w.hostname, w.pid,
                  extract(epoch FROM w.clock_offset)::float8 AS clock_offset_seconds
           FROM runledger.workers w
           WHERE w.stopped_at IS NULL AND w.clock_offset IS NOT NULL
             AND w.heartbeat_at > runledger.now() - coalesce(w.silent_after, interval '30 s')
           ORDER BY abs(extract(epoch FROM w.clock_offset)) DESC, w.worker_id"""
    ).fetchall()


# the tablespace runledger's journal grows in: run_events', else the database's default
_JOURNAL_TABLESPACE: LiteralString = (
    "SELECT coalesce(t.spcname, d.spcname) AS name FROM pg_class c "
    "LEFT JOIN pg_tablespace t ON t.oid = c.reltablespace "
    "CROSS JOIN (SELECT s.spcname FROM pg_database db JOIN pg_tablespace s "
    "ON s.oid = db.dattablespace WHERE db.datname = current_database()) d "
    "WHERE c.oid = 'runledger.run_events'::regclass"
)


def write_probe(conn: Conn) -> str:
    """A write that needs new space where runledger's journal grows, rolled back: a
    temporary table in the tablespace of ``runledger.run_events`` gets its first page (a
    new relation always extends its file, where a row added to a table may fit in a page
    it has). Returns that tablespace's name; raises the driver's error (SQLSTATE 53100 on
    a full disk). A temporary table takes no privilege on the database's default
    tablespace, only TEMPORARY on the database (PUBLIC has it unless revoked)."""
    with conn.transaction(force_rollback=True):
        conn.execute("SET TRANSACTION READ WRITE")  # the session is read-only
        name = str(_one(conn, _JOURNAL_TABLESPACE)["name"])
        conn.execute(
            sql.SQL(
                "CREATE TEMPORARY TABLE runledger_doctor_write (x integer) ON COMMIT DROP "
                "TABLESPACE {}"
            ).format(sql.Identifier(name))
        )
        conn.execute("INSERT INTO runledger_doctor_write VALUES (1)")
    return name


def can_act(conn: Conn) -> bool:
    """Whether this login may execute :data:`OPERATOR_ACT`: an operator's may, an
    auditor's may not."""
    row = conn.execute(
        "SELECT has_function_privilege(%s, 'EXECUTE') AS acts", (OPERATOR_ACT,)
    ).fetchone()
    return bool(row and row["acts"])
