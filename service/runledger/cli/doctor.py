"""``runledger doctor``: check the connection, the server, the schema revision and the
replication a deployment runs on (:mod:`runledger.doctor`). Registered on the
``runledger`` group by :mod:`runledger.cli`; exit 3 when the database is unreachable or its
schema missing or behind (the CLI's code for that), else 1 when a check is not ok."""

from __future__ import annotations

import sys
from collections.abc import Sequence
from typing import TYPE_CHECKING

import click

from runledger.cli.exits import EXIT_FAILED, EXIT_OK, EXIT_UNAVAILABLE
from runledger.cli.options import (
    CONTEXT,
    connect_option,
    database_option,
    emit,
    json_option,
    require_url,
)

if TYPE_CHECKING:
    from runledger.doctor import Result


@click.command(context_settings=CONTEXT)
@database_option
@connect_option
@json_option
def doctor(database_url: str | None, connect_timeout: float, as_json: bool) -> None:
    """Check the connection, server, schema revision, replication, roles, default
    isolation, that the database takes a write (rolled back; a full disk fails it) and
    the clock; show the settings (secrets redacted); exit 3 when the database is
    unreachable or its schema missing or behind, 1 on any other problem.

    A warning is a setting under which a guarantee does not hold: an asynchronous
    standby, which a failover can promote with the last commits lost (docs/failover.md);
    a missing role; this host's clock, or a live worker's host clock (as that worker
    measured it), more than a second off the database's.
    """
    from runledger.doctor import run_doctor

    results = run_doctor(require_url(database_url), connect_timeout=connect_timeout)
    if as_json:
        emit(
            [
                {"check": r.check, "status": r.status, "detail": r.detail, "data": r.data}
                for r in results
            ],
            as_json=True,
        )
    else:
        for r in results:
            click.echo(f"{r.status:<4} {r.check}: {r.detail}")
    sys.exit(exit_code(results))


def exit_code(results: Sequence[Result]) -> int:
    """0 when every check is ok; EXIT_UNAVAILABLE when the database is unreachable or its
    schema missing or behind this code (what every other command exits with then); else
    EXIT_FAILED, a revision newer than this code's included (every other command works
    with that one: two releases share a database during a rolling deploy)."""
    if all(r.ok for r in results):
        return EXIT_OK
    unavailable = any(
        r.status == "fail"
        and (r.check == "connection" or (r.check == "schema" and r.data["behind"]))
        for r in results
    )
    return EXIT_UNAVAILABLE if unavailable else EXIT_FAILED
