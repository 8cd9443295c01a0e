"""The exit codes of every ``runledger`` command, and the one-line error that goes with one.

0 ok; 1 a check failed, a run did not succeed, or the database refused or failed the
request (a write on a standby: ``ReadOnly``; a full disk or any other error of the server:
``ServerError``, its line naming the SQLSTATE); 2 usage; 3 the database is unavailable or has no (or
an older) runledger schema, or is a standby under ``runledger worker``, which only writes.
``runledger --help`` lists them (:data:`EXIT_CODES`); :func:`runledger.cli.run` maps the
exceptions onto them.
"""

from __future__ import annotations

import sys
from typing import NoReturn

import click

EXIT_OK, EXIT_FAILED, EXIT_USAGE, EXIT_UNAVAILABLE = 0, 1, 2, 3
EXIT_CODES = {
    EXIT_OK: "ok",
    EXIT_FAILED: "a check failed, a run did not succeed, or the database refused or failed "
    "(a write on a standby, a full disk: the line names the SQLSTATE)",
    EXIT_USAGE: "usage: a bad option, value or JSON; no or a malformed database URL; a "
    "--flows module that does not import",
    EXIT_UNAVAILABLE: "database unreachable, its runledger schema missing or behind, or a "
    "standby (worker)",
}


def exit_codes_help() -> str:
    return "\n".join(f"  {code}  {what}" for code, what in EXIT_CODES.items())


def fail(message: str, code: int) -> NoReturn:
    """``message`` on stderr (an error starts ``error: ``, as everywhere), then exit."""
    click.echo(message, err=True)
    sys.exit(code)


def joined(text: str) -> str:
    """The lines of ``text`` on one, separated by ``; ``."""
    return "; ".join(part.strip() for part in text.splitlines() if part.strip())


def one_line(exc: BaseException) -> str:
    """An error's message, DETAIL and HINT on one line."""
    return joined(str(exc))
