"""Every SQLSTATE the store meets, and what it becomes: the one place that maps them.

A refusal of a contract function (class ``RL``, registered in :mod:`runledger.errors`)
becomes its :class:`~runledger.errors.RunLedgerError`, raised ``from`` the driver error
(:func:`map_error`); bad input the driver or the server refuses is
:class:`~runledger.errors.InvalidInput`; a write refused because the server only reads is
:class:`~runledger.errors.ReadOnly` (:func:`read_only`). What is neither a refusal nor
mapped is a lost connection (:func:`is_connection_error`) or worth sending again
(:data:`RETRYABLE_SQLSTATES`): :class:`runledger.db.execution.Executor` decides. Any
other error the server sends is :class:`~runledger.errors.ServerError`
(:func:`server_error`), one line that names its SQLSTATE: a full disk, a missing
privilege, a statement timeout. :func:`describe` says any exception in one line, its
cause first, for a log line.
"""

from __future__ import annotations

import re
from typing import Any

import psycopg

from runledger import errors
from runledger.db.server import AnyConnection, failure_reason, hosts_ports, hot_standby

RETRYABLE_SQLSTATES = {"40001", "40P01", "57P01", "57P02", "57P03", "55P03"}
INPUT_SQLSTATES = {"22P05", "22021", "22P02", "22007", "22008", "22003", "54000"}
READ_ONLY_SQLSTATE = "25006"  # read_only_sql_transaction: a hot standby, or a read-only session


def is_connection_error(exc: psycopg.Error) -> bool:
    """Whether ``exc`` says the connection is gone (a statement in flight: its outcome unknown)."""
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


def condition(exc: psycopg.Error) -> str | None:
    """PostgreSQL's name for the error's SQLSTATE, in words, from the driver's class for
    it (``DiskFull``: "disk full"); None when the driver has none (a generic class)."""
    name = type(exc).__name__.rstrip("_")
    if type(exc).__module__ != psycopg.errors.__name__ or not getattr(type(exc), "sqlstate", None):
        return None
    return re.sub(r"(?<=[a-z0-9])(?=[A-Z])", " ", name).lower()


def said(exc: psycopg.Error) -> str:
    """What the server said, on one line: its message, DETAIL and HINT."""
    diag = exc.diag
    parts = [diag.message_primary or failure_reason(exc)]
    if diag.message_detail:
        parts.append(f"DETAIL: {diag.message_detail}")
    if diag.message_hint:
        parts.append(f"HINT: {diag.message_hint}")
    return "; ".join(" ".join(part.split()) for part in parts)


def server_error(exc: psycopg.Error, **fields: Any) -> errors.ServerError | None:
    """The :class:`~runledger.errors.ServerError` for an error the server sent that is
    neither one of runledger's refusals nor a lost connection; None for those, and for
    an error without a SQLSTATE (the driver's own). Its message starts with the
    condition ("disk full: could not extend file ...; HINT: Check free disk space.") and
    ends with the SQLSTATE ("(SQLSTATE 53100)")."""
    code = exc.sqlstate
    if code is None or is_connection_error(exc) or map_error(exc) is not None:
        return None
    named = condition(exc)
    message = f"{named}: {said(exc)}" if named else said(exc)
    return errors.ServerError(f"{message} (SQLSTATE {code})", code=code, condition=named, **fields)


def describe(exc: BaseException) -> str:
    """Any exception as one line, its cause first: a runledger error's message (a server
    error's names its condition and SQLSTATE), a driver error's server message with its
    SQLSTATE, else the exception's type and text."""
    if isinstance(exc, errors.ServerError):  # the condition first, not the class
        return " ".join(str(exc).split())
    if isinstance(exc, errors.RunLedgerError):
        return f"{type(exc).__name__}: " + "; ".join(
            " ".join(line.split()) for line in str(exc).splitlines() if line.strip()
        )
    if isinstance(exc, psycopg.Error):
        mapped = map_error(exc) or server_error(exc)
        if mapped is not None:
            return describe(mapped)
        if exc.sqlstate:
            return f"{type(exc).__name__}: {said(exc)} (SQLSTATE {exc.sqlstate})"
    text = " ".join(str(exc).split())
    return f"{type(exc).__name__}: {text}" if text else type(exc).__name__


# the outermost function of a refusal's CONTEXT: its last line, innermost first
_CONTEXT_FUNCTION = re.compile(r'(?:PL/pgSQL function |SQL function ")(?:runledger\.)?(\w+)')


def read_only(exc: psycopg.Error, conn: AnyConnection | None, **fields: Any) -> errors.ReadOnly:
    """A write refused with SQLSTATE 25006, as one line: the contract function refused
    (or "the write"), the server's reason, and what to do: on a standby, point writes at
    the primary. Reads work there, so only a write ever gets this."""
    diag = exc.diag
    reason = diag.message_primary or failure_reason(exc)
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


def raise_mapped(exc: psycopg.Error, *, conn: AnyConnection | None = None, **fields: Any) -> None:
    """Raise the runledger exception for ``exc`` (from it) when it is a refusal; else return."""
    mapped = map_error(exc, conn=conn, **fields)
    if mapped is not None:
        raise mapped from exc
