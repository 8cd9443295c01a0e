"""``runledger doctor``: what a deployment must get right before runledger's guarantees
hold, checked against the database a worker would use.

Each check is a :class:`Result` with a status: ``ok``; ``warn``, a setting under which
some guarantee does not hold (an asynchronous standby: a failover to it loses commits,
see docs/failover.md); ``fail``, something a worker cannot work with (no connection, a
standby, a schema behind). ``runledger doctor`` exits 1 when any check is not ``ok``.
Read-only: nothing is written.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import psycopg
from psycopg.rows import dict_row

from runledger.db import migrate

OK, WARN, FAIL = "ok", "warn", "fail"
MIN_SERVER = 130000  # gen_random_uuid() without an extension


@dataclass(frozen=True, slots=True)
class Result:
    check: str
    status: str
    detail: str
    data: dict[str, Any]

    @property
    def ok(self) -> bool:
        return self.status == OK


def _one(conn: psycopg.Connection[dict[str, Any]], sql: Any) -> dict[str, Any]:
    row = conn.execute(sql).fetchone()
    assert row is not None
    return row


def server(conn: psycopg.Connection[dict[str, Any]]) -> Result:
    row = _one(
        conn,
        "SELECT current_setting('server_version') AS version, "
        "current_setting('server_version_num')::int AS num, pg_is_in_recovery() AS standby, "
        "inet_server_addr()::text AS host, inet_server_port() AS port",
    )
    data = dict(row)
    where = f"PostgreSQL {row['version']} at {row['host'] or 'the local socket'}"
    if row["port"] is not None:
        where += f":{row['port']}"
    if row["num"] < MIN_SERVER:
        return Result("server", FAIL, f"{where}: runledger needs PostgreSQL 13 or later", data)
    if row["standby"]:
        return Result(
            "server",
            FAIL,
            f"{where} is a standby (in recovery): workers need the primary; list every host "
            "with target_session_attrs=read-write (docs/failover.md)",
            data,
        )
    return Result("server", OK, f"{where}, a primary", data)


def schema(conn: psycopg.Connection[dict[str, Any]]) -> Result:
    head = migrate.head()
    row = _one(conn, "SELECT to_regclass('runledger.alembic_version') IS NOT NULL AS present")
    if not row["present"]:
        return Result(
            "schema", FAIL, "no runledger schema: run `runledger migrate`", {"head": head}
        )
    found = conn.execute("SELECT version_num FROM runledger.alembic_version").fetchone()
    revision = found["version_num"] if found else None
    data = {"revision": revision, "head": head}
    if revision != head:
        return Result(
            "schema",
            FAIL,
            f"revision {revision}, this code's head is {head}: run `runledger migrate`",
            data,
        )
    return Result("schema", OK, f"revision {revision} (head)", data)


def replication(conn: psycopg.Connection[dict[str, Any]]) -> Result:
    """Standbys and how commits wait for them: a failover to a standby that is not
    synchronous (or with ``synchronous_commit`` below ``on``) can lose commits."""
    settings = _one(
        conn,
        "SELECT current_setting('synchronous_standby_names') AS names, "
        "current_setting('synchronous_commit') AS commit",
    )
    standbys = conn.execute(
        "SELECT application_name, client_addr::text AS client_addr, state, sync_state "
        "FROM pg_stat_replication ORDER BY application_name, client_addr"
    ).fetchall()
    data = {
        "synchronous_standby_names": settings["names"],
        "synchronous_commit": settings["commit"],
        "standbys": standbys,
    }
    if not standbys:
        return Result(
            "replication",
            OK,
            "no streaming standby: nothing to fail over to (a restore from backup is a "
            "failover too, see docs/failover.md)",
            data,
        )
    hidden = [s for s in standbys if s["sync_state"] is None]
    if hidden:
        return Result(
            "replication",
            WARN,
            f"{len(standbys)} standby(s), their sync state is hidden from this role "
            "(grant it pg_monitor to see it)",
            data,
        )
    unsafe = [s for s in standbys if s["sync_state"] not in ("sync", "quorum")]
    names = ", ".join(
        f"{s['application_name'] or s['client_addr']} ({s['sync_state']})" for s in standbys
    )
    if unsafe:
        return Result(
            "replication",
            WARN,
            f"asynchronous standby(s): {names}. A failover to one of them can lose the last "
            "commits; runledger then grants no token twice and sends nothing as new that "
            "may have been sent, but runs may pause for a person and lost effects are only "
            "found by lookup (docs/failover.md). Use synchronous_standby_names",
            data,
        )
    if settings["commit"] in ("off", "local"):
        return Result(
            "replication",
            WARN,
            f"synchronous standby(s) {names}, but synchronous_commit = {settings['commit']}: "
            "commits do not wait for them",
            data,
        )
    return Result("replication", OK, f"synchronous standby(s): {names}", data)


def timelines(conn: psycopg.Connection[dict[str, Any]]) -> Result:
    rows = conn.execute(
        "SELECT position, timeline, previous_timeline, seen_at, affected_runs "
        "FROM runledger.timelines ORDER BY position"
    ).fetchall()
    now = _one(
        conn,
        "SELECT ('x' || substr(pg_walfile_name(pg_current_wal_lsn()), 1, 8))::bit(32)::int "
        "AS timeline",
    )["timeline"]
    data = {"timeline": now, "seen": rows}
    failovers = rows[1:]
    if not failovers:
        return Result("timeline", OK, f"timeline {now}, no failover recorded", data)
    last = failovers[-1]
    return Result(
        "timeline",
        OK,
        f"timeline {now}; {len(failovers)} failover(s) recorded, the last to timeline "
        f"{last['timeline']} at {last['seen_at']} ({last['affected_runs']} runs affected: "
        "`runledger audit` lists them)",
        data,
    )


def run_doctor(database_url: str, *, connect_timeout: float) -> list[Result]:
    """Every check, in order; one that cannot run (no connection, no schema) ends the
    list with its failure."""
    try:
        conn = psycopg.connect(
            database_url,
            autocommit=True,
            row_factory=dict_row,
            connect_timeout=max(2, int(connect_timeout + 0.999)),
            application_name="runledger-doctor",
        )
    except psycopg.Error as exc:
        reason = " ".join(str(exc).split())
        return [Result("connection", FAIL, f"cannot connect: {reason}", {})]
    results = [Result("connection", OK, "connected", {})]
    with conn:
        conn.execute("SET default_transaction_read_only = on")
        results.append(server(conn))
        results.append(schema(conn))
        results.append(replication(conn))
        if results[-2].ok and not results[1].data.get("standby"):
            results.append(timelines(conn))
    return results
