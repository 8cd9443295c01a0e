"""The ``runledger`` command (``python -m runledger`` is the same): the group and its
entry point. Each command group is a module of this package:

====================  ==================================================================
``runs``              submit, status, wait, cancel, retry
``calls``             resolve, approve, deny: a person settles a call
``reads``             list, show, workers, unknown (read-only)
``events``            events (``--follow`` tails the log)
``audit``             audit, checkpoint
``doctor``            doctor
``prune``             prune
``migrate``           migrate
``worker``            worker
``console``           console (the web console, :mod:`runledger.console`)
``start``             demo, init DIR
====================  ==================================================================

What they share: ``options`` (every option and its environment variable, the client,
the read-only connection), ``exits`` (the exit codes), ``terminal`` (rich tables and
lines); what the text says is :mod:`runledger.present`, which the console uses too.

Data goes to stdout, logs to stderr. Every failure is one line on stderr that starts
``error: `` (click's own usage errors included), never a traceback, and its exit code
says what kind it is (:data:`~runledger.cli.exits.EXIT_CODES`, shown by ``runledger
--help``): 0 ok; 1 a check failed, a run did not succeed, or the database refused or
failed the request (a write on a standby: ``ReadOnly``; any other error of the server,
a full disk say: ``ServerError``, naming its SQLSTATE); 2 usage (a bad option, argument or value,
input that is not JSON or nests too deeply, no or a malformed database URL); 3 the
database is unavailable or has no (or an older) runledger schema, or is a standby under
``runledger worker``, which only writes. :func:`run` maps the exceptions onto them.

One environment rule for every option of every command: ``--some-option`` reads
``RUNLEDGER_SOME_OPTION`` (``--database-url`` then falls back to ``DATABASE_URL``), and
``--help`` shows it. The variables are set on each option explicitly
(:func:`~runledger.cli.options.opt`), never derived by click from parameter names.
``--json`` reads ``RUNLEDGER_JSON`` and nothing else.
"""

from __future__ import annotations

import sys

import click
import psycopg

from runledger import errors
from runledger.cli import (
    audit,
    calls,
    console,
    doctor,
    events,
    migrate,
    prune,
    reads,
    runs,
    start,
    worker,
)
from runledger.cli.exits import (
    EXIT_CODES,
    EXIT_FAILED,
    EXIT_UNAVAILABLE,
    EXIT_USAGE,
    exit_codes_help,
    fail,
    joined,
    one_line,
)
from runledger.cli.options import CONTEXT

__all__ = ["EXIT_CODES", "main", "run"]


@click.group(
    context_settings=CONTEXT,
    epilog="\b\nExit codes (every error is one line on stderr):\n" + exit_codes_help(),
)
@click.version_option(package_name="runledger-pg")
def main() -> None:
    """runledger: durable, fenced AI-agent runs on PostgreSQL."""


for command in (
    runs.submit,
    runs.status,
    runs.wait,
    runs.cancel,
    runs.retry,
    calls.resolve,
    calls.approve,
    calls.deny,
    reads.list_runs,
    reads.show,
    reads.workers,
    reads.unknown,
    events.events,
    audit.audit,
    audit.checkpoint,
    doctor.doctor,
    prune.prune,
    migrate.migrate,
    worker.worker,
    console.console,
    start.demo,
    start.init,
):
    main.add_command(command)


def run() -> None:
    """The entry point: every error is one line on stderr and an exit code of EXIT_CODES.

    Usage errors (click's, and a malformed or missing URL: ``ConfigurationError``) exit 2;
    a database that cannot be reached or has no (or an older) schema exits 3; any other
    runledger error (a refusal by the database or the store, a standby's ``ReadOnly``
    included: the worker command exits 3 for that one itself; a ``ServerError``, a full
    disk say) exits 1, and so does a driver error no store mapped, as the error it
    stands for (a lost connection exits 3).
    """
    try:
        main(standalone_mode=False)
    except click.exceptions.Abort:
        fail("aborted", EXIT_FAILED)
    except click.exceptions.NoArgsIsHelpError as exc:  # `runledger` alone: the help, as click
        exc.show()
        sys.exit(EXIT_USAGE)
    except click.UsageError as exc:  # lowercase, as every other error (click says "Error:")
        fail(f"error: {joined(exc.format_message())}", EXIT_USAGE)
    except click.ClickException as exc:
        fail(f"error: {joined(exc.format_message())}", exc.exit_code)
    except errors.ConfigurationError as exc:
        fail(f"error: ConfigurationError: {one_line(exc)}", EXIT_USAGE)
    except (errors.DatabaseUnavailable, errors.SchemaMissing) as exc:
        fail(f"error: {type(exc).__name__}: {one_line(exc)}", EXIT_UNAVAILABLE)
    except errors.RunLedgerError as exc:
        fail(f"error: {type(exc).__name__}: {one_line(exc)}", EXIT_FAILED)
    except psycopg.Error as exc:  # one the store did not map (a read's own connection)
        fail(f"error: {driver_line(exc)}", _driver_exit(exc))


def driver_line(exc: psycopg.Error) -> str:
    """A driver error as the line of the runledger error it stands for: a lost
    connection, a refusal, or a :class:`~runledger.errors.ServerError` naming its
    SQLSTATE (:func:`runledger.db.sqlstate.describe`)."""
    from runledger.db.sqlstate import is_connection_error, map_error, server_error

    if is_connection_error(exc):
        return f"DatabaseUnavailable: {one_line(exc)}"
    mapped = map_error(exc) or server_error(exc)
    if mapped is not None:
        return f"{type(mapped).__name__}: {one_line(mapped)}"
    return f"{type(exc).__name__}: {one_line(exc)}"


def _driver_exit(exc: psycopg.Error) -> int:
    from runledger.db.sqlstate import is_connection_error

    return EXIT_UNAVAILABLE if is_connection_error(exc) else EXIT_FAILED
