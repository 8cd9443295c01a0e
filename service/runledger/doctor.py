"""``runledger doctor``: what a deployment must get right before runledger's guarantees
hold, checked against the database a worker would use.

Each check is a :class:`Result` with a status: ``ok``; ``warn``, a setting under which
some guarantee does not hold (no synchronous standby: a failover to an asynchronous one
can lose commits, see docs/failover.md); ``fail``, something a worker cannot work with (no
connection, a standby, a schema behind). ``runledger doctor`` exits 3 when the database is
unreachable or its schema missing or behind this code, else 1 when any check is not
``ok``.
Nothing is kept: the one write (the write check's) is rolled back.

The checks: the connection; the server (version, primary or standby); the schema
revision against this code's head; replication (synchronous or not); the timelines seen;
the roles the schema grants to; the default transaction isolation (READ COMMITTED);
whether the database takes a write that needs new space (a full disk fails every write
while every read still works); this host's clock against the database's, and each live
worker's as that worker measured it (warn past :data:`MAX_CLOCK_SKEW`); the settings it
ran with and the ``RUNLEDGER_*`` environment, the URL's password and any variable named
like a secret redacted.
"""

from __future__ import annotations

import os
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import psycopg
from psycopg.conninfo import conninfo_to_dict, make_conninfo

from runledger.db import diagnosis, revisions

OK, WARN, FAIL = "ok", "warn", "fail"
MIN_SERVER = 130000  # gen_random_uuid() without an extension
ROLES = ("runledger_worker", "runledger_operator", "runledger_auditor")
MAX_CLOCK_SKEW = 1.0  # seconds between this host's clock and the database's
REDACTED = "***"
_SECRET_WORDS = ("PASSWORD", "SECRET", "TOKEN", "KEY")


@dataclass(frozen=True, slots=True)
class Result:
    check: str
    status: str
    detail: str
    data: dict[str, Any]

    @property
    def ok(self) -> bool:
        return self.status == OK


def server(conn: psycopg.Connection[diagnosis.Row]) -> Result:
    row = diagnosis.server_facts(conn)
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


def schema(conn: psycopg.Connection[diagnosis.Row]) -> Result:
    head = revisions.head()
    present, revision = diagnosis.schema_revision(conn)
    if not present:
        return Result(
            "schema",
            FAIL,
            "no runledger schema: run `runledger migrate`",
            {"head": head, "behind": True},
        )
    data = {"revision": revision, "head": head, "behind": revisions.behind(revision)}
    if data["behind"]:
        return Result(
            "schema",
            FAIL,
            f"revision {revision}, this code's head is {head}: run `runledger migrate`",
            data,
        )
    if revision != head:
        # a newer release's schema (a rolling deploy): this code still works with it
        return Result(
            "schema",
            FAIL,
            f"revision {revision} is newer than this code's head {head}: upgrade runledger here",
            data,
        )
    return Result("schema", OK, f"revision {revision} (head)", data)


SYNC_STATES = ("sync", "quorum")  # pg_stat_replication.sync_state of a synchronous standby
STRONG_COMMITS = ("on", "remote_write", "remote_apply")  # commits wait for the standby


def _standby_name(row: Mapping[str, Any]) -> str:
    return f"{row['application_name'] or row['client_addr']} ({row['sync_state']})"


def judge_replication(
    settings: Mapping[str, Any], standbys: Sequence[Mapping[str, Any]]
) -> tuple[str, str, dict[str, Any]]:
    """The replication check's status, line and data from ``synchronous_standby_names``
    (``names``) and ``synchronous_commit`` (``commit``) and the rows of
    ``pg_stat_replication``: a pure function, for the table of cases in the tests.

    A standby in ``sync`` or ``quorum`` state is synchronous; one in ``async`` or
    ``potential`` (an asynchronous one next in line to become synchronous) is not. One
    synchronous standby that commits wait for (``synchronous_commit`` ``on``,
    ``remote_write`` or ``remote_apply``) is enough: a failover must then go to it, as
    Patroni's ``synchronous_mode`` does, and loses no acknowledged commit."""
    data: dict[str, Any] = {
        "synchronous_standby_names": settings["names"],
        "synchronous_commit": settings["commit"],
        "standbys": list(standbys),
    }
    if not standbys:
        return (
            OK,
            "no streaming standby: nothing to fail over to (a restore from backup is a "
            "failover too, see docs/failover.md)",
            data,
        )
    if any(s["sync_state"] is None for s in standbys):
        return (
            WARN,
            f"{len(standbys)} standby(s), their sync state is hidden from this role "
            "(grant it pg_monitor to see it)",
            data,
        )
    sync = [s for s in standbys if s["sync_state"] in SYNC_STATES]
    other = [s for s in standbys if s["sync_state"] not in SYNC_STATES]
    data["synchronous"] = [_standby_name(s) for s in sync]
    data["asynchronous"] = [_standby_name(s) for s in other]
    if not sync:
        names = ", ".join(data["asynchronous"])
        return (
            WARN,
            f"asynchronous standby(s): {names}. A failover to one of them can lose the last "
            "commits; runledger then grants no token twice and sends nothing as new that "
            "may have been sent, but runs may pause for a person and lost effects are only "
            "found by lookup (docs/failover.md). Use synchronous_standby_names",
            data,
        )
    line = f"synchronous standby(s): {', '.join(data['synchronous'])}"
    if settings["commit"] not in STRONG_COMMITS:
        if other:
            line += f"; asynchronous standby(s): {', '.join(data['asynchronous'])}"
        return (
            WARN,
            f"{line}, but synchronous_commit = {settings['commit']}: commits do not wait "
            "for the synchronous standby(s)",
            data,
        )
    if other:
        line += f"; asynchronous standby(s): {', '.join(data['asynchronous'])}"
        if any(s["sync_state"] == "potential" for s in other):
            line += " (a potential one becomes synchronous if a synchronous one goes)"
        line += (
            ". A failover must go to a synchronous standby, as Patroni's synchronous_mode "
            "does: a promoted asynchronous one can lack the last commits (docs/failover.md)"
        )
    elif not any(s["sync_state"] == "quorum" for s in sync):
        line += ". A failover to any of them loses no acknowledged commit"
    if any(s["sync_state"] == "quorum" for s in sync):
        line += (
            "; with quorum commit (ANY) only the standby that received the most is sure "
            "to hold every acknowledged commit: promote that one"
        )
    return OK, line, data


def replication(conn: psycopg.Connection[diagnosis.Row]) -> Result:
    """Standbys and how commits wait for them: a failover to a standby that is not
    synchronous (or with ``synchronous_commit`` below ``on``) can lose commits."""
    settings, standbys = diagnosis.replication_facts(conn)
    status, detail, data = judge_replication(settings, standbys)
    return Result("replication", status, detail, data)


def timelines(conn: psycopg.Connection[diagnosis.Row]) -> Result:
    rows, now = diagnosis.timeline_facts(conn)
    data = {"timeline": now, "seen": rows}
    failovers = rows[1:]
    if not failovers:
        return Result("timeline", OK, f"timeline {now}, no failover recorded", data)
    last = failovers[-1]
    return Result(
        "timeline",
        OK,
        f"timeline {now}; {len(failovers)} failover(s) recorded, the last to timeline "
        f"{last['timeline']} at {last['seen_at']}: {failover_case(last)}",
        data,
    )


def failover_case(row: dict[str, Any]) -> str:
    """Which failover it was, and why runledger judged so (docs/failover.md)."""
    guarantee = (row.get("evidence") or {}).get("commit_guarantee")
    if guarantee is None:
        why = "no claim had recorded how commits were acknowledged"
    else:
        why = (
            f"synchronous_commit {guarantee['synchronous_commit']}, "
            f"synchronous_standby_names '{guarantee['synchronous_standby_names']}'"
            f" (seen {guarantee['seen_at']})"
        )
    if row.get("lossless"):
        return (
            f"lossless ({why}: every acknowledged commit was on every synchronous standby); "
            f"{row['affected_runs']} lease(s) ended, no run doubted"
        )
    return (
        f"may have lost commits ({why}); {row['affected_runs']} unfinished run(s) recovered "
        "as possibly sent: `runledger audit` lists them"
    )


def roles(conn: psycopg.Connection[diagnosis.Row]) -> Result:
    """The three roles the schema grants to (docs/design.md): without them every login
    needs the owner's privileges."""
    present = diagnosis.present_roles(conn, ROLES)
    missing = [r for r in ROLES if r not in present]
    data = {"present": present, "missing": missing}
    if missing:
        return Result(
            "roles",
            WARN,
            f"missing role(s) {', '.join(missing)}: create them as an admin and run "
            "`runledger migrate` again (it grants to them)",
            data,
        )
    return Result("roles", OK, f"roles present: {', '.join(present)}", data)


def isolation(conn: psycopg.Connection[diagnosis.Row]) -> Result:
    """This login's default transaction isolation, which every autocommit write takes: a
    run's event chain is extended in READ COMMITTED transactions only (revision 0023;
    RL006 under REPEATABLE READ or SERIALIZABLE). Set per database or role, so a worker
    that logs in as another role may have another: run doctor with its URL too."""
    level = diagnosis.default_isolation(conn)
    data = {"default_transaction_isolation": level}
    if level in ("repeatable read", "serializable"):
        return Result(
            "isolation",
            FAIL,
            f"default_transaction_isolation is {level}: every write after a run's first event "
            "is refused (RL006); set it to read committed for runledger's roles (ALTER ROLE "
            "... SET or ALTER DATABASE ... SET)",
            data,
        )
    return Result("isolation", OK, f"default_transaction_isolation {level}", data)


def write(conn: psycopg.Connection[diagnosis.Row]) -> Result:
    """Whether the database takes a write where runledger's journal grows: a temporary
    table gets its first page in the tablespace of ``runledger.run_events``, in a
    transaction rolled back (:func:`runledger.db.diagnosis.write_probe`). A full disk
    fails it (SQLSTATE 53100), and with it every write of the workers and the commands,
    while every read, and every other check here, still works. A role that may not
    create a temporary table there is a warning: the write is not checked."""
    from runledger.db.sqlstate import describe

    try:
        name = diagnosis.write_probe(conn)
    except psycopg.Error as exc:
        data = {"sqlstate": exc.sqlstate, "error": describe(exc)}
        if exc.sqlstate == "42501":
            return Result(
                "write",
                WARN,
                f"not checked: this role may not create a temporary table ({describe(exc)})",
                data,
            )
        if exc.sqlstate == "53100":
            return Result(
                "write",
                FAIL,
                f"the database takes no write: {describe(exc)}. Every write of the workers "
                "and the commands fails until space is freed where runledger's tables are",
                data,
            )
        return Result("write", FAIL, f"a write failed: {describe(exc)}", data)
    return Result(
        "write", OK, f"a write in tablespace {name} succeeded (rolled back)", {"tablespace": name}
    )


def clock(conn: psycopg.Connection[diagnosis.Row]) -> Result:
    """This host's clock against the database's (``clock_timestamp()``, taken halfway
    through the round trip). runledger judges time by the database alone; a host far off
    still misleads the people reading its logs and the times it prints."""
    before = time.time()
    at = diagnosis.database_clock(conn)
    after = time.time()
    skew = at - (before + after) / 2
    data = {"skew_seconds": round(skew, 4), "round_trip_seconds": round(after - before, 4)}
    side = "ahead of" if skew >= 0 else "behind"
    said = f"the database's clock is {abs(skew):.3f} s {side} this host's"
    if abs(skew) > MAX_CLOCK_SKEW:
        return Result("clock", WARN, f"{said} (more than {MAX_CLOCK_SKEW:g} s): check NTP", data)
    return Result("clock", OK, said, data)


def worker_clocks(conn: psycopg.Connection[diagnosis.Row]) -> Result:
    """Each live worker's host clock against the database's, as the worker measured it
    (``workers.clock_offset``, said with every heartbeat). A worker judges every time by
    the database's clock, whatever its host's says; a host far off still misleads the
    people reading its logs."""
    try:
        rows = diagnosis.worker_clocks(conn)
    except psycopg.Error as exc:
        reason = " ".join(str(exc).split())
        return Result("worker clocks", WARN, f"cannot read the workers' clocks: {reason}", {})
    data = {
        "workers": [
            {
                "worker_id": r["worker_id"],
                "hostname": r["hostname"],
                "pid": r["pid"],
                "clock_offset_seconds": round(r["clock_offset_seconds"], 4),
            }
            for r in rows
        ]
    }
    off = [r for r in rows if abs(r["clock_offset_seconds"]) > MAX_CLOCK_SKEW]
    if off:
        said = "; ".join(
            f"{r['worker_id']} on {r['hostname'] or '?'}: {offset_words(r['clock_offset_seconds'])}"
            for r in off
        )
        return Result(
            "worker clocks",
            WARN,
            f"{len(off)} of {len(rows)} live workers' hosts are more than {MAX_CLOCK_SKEW:g} s "
            f"off the database's clock ({said}): check NTP on them",
            data,
        )
    if not rows:
        return Result("worker clocks", OK, "no live worker has said its clock yet", data)
    worst = max(abs(r["clock_offset_seconds"]) for r in rows)
    return Result("worker clocks", OK, f"{len(rows)} live workers, at most {worst:.3f} s off", data)


def offset_words(seconds: float) -> str:
    """``+300.000 s`` as "300.000 s ahead of the database's clock"."""
    side = "ahead of" if seconds >= 0 else "behind"
    return f"host clock {abs(seconds):.3f} s {side} the database's"


def redact_url(url: str) -> str:
    """``url`` with its password replaced (then in libpq's ``key=value`` form); one that
    cannot be parsed is not shown at all."""
    try:
        params = conninfo_to_dict(url)
    except psycopg.Error:
        return REDACTED
    if "password" not in params:
        return url
    params["password"] = REDACTED
    return make_conninfo("", **params)


def settings(
    database_url: str, connect_timeout: float, environ: Mapping[str, str] | None = None
) -> Result:
    """What doctor ran with and the ``RUNLEDGER_*`` environment, secrets redacted."""
    env = os.environ if environ is None else environ
    shown: dict[str, str] = {}
    for name in sorted(env):
        if not (name.startswith("RUNLEDGER_") or name == "DATABASE_URL"):
            continue
        value = env[name]
        if name.endswith("_URL"):  # RUNLEDGER_DATABASE_URL, RUNLEDGER_DIRECT_URL, ...
            value = redact_url(value)
        elif any(word in name for word in _SECRET_WORDS):
            value = REDACTED
        shown[name] = value
    data = {
        "database_url": redact_url(database_url),
        "connect_timeout": connect_timeout,
        "environment": shown,
    }
    return Result("settings", OK, f"database {data['database_url']}", data)


def run_doctor(database_url: str, *, connect_timeout: float) -> list[Result]:
    """Every check, in order; one that cannot run (no connection, no schema) ends the
    checks of the database with its failure. The settings (redacted) come last, always."""
    try:
        conn = diagnosis.doctor_connection(database_url, connect_timeout)
    except psycopg.Error as exc:
        reason = " ".join(str(exc).split())
        return [
            Result("connection", FAIL, f"cannot connect: {reason}", {}),
            settings(database_url, connect_timeout),
        ]
    results = [Result("connection", OK, "connected", {})]
    with conn:
        diagnosis.read_only(conn, database_url)
        results.append(server(conn))
        results.append(schema(conn))
        results.append(replication(conn))
        if results[-2].ok and not results[1].data.get("standby"):
            results.append(timelines(conn))
        results.append(roles(conn))
        results.append(isolation(conn))
        if results[2].ok and not results[1].data.get("standby"):  # a primary, at head
            results.append(write(conn))
        results.append(clock(conn))
        if all(r.ok for r in results if r.check == "schema"):
            results.append(worker_clocks(conn))
    results.append(settings(database_url, connect_timeout))
    return results
