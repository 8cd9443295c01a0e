"""``runledger doctor``: check the connection, the server, the schema revision and the
replication a deployment runs on (:mod:`runledger.doctor`). Registered on the
``runledger`` group by :mod:`runledger.cli`; exit 1 when a check is not ok."""

from __future__ import annotations

import sys

import click

from runledger.cli_options import (
    CONTEXT,
    _database_url,
    connect_option,
    database_option,
    emit,
    json_option,
)


@click.command(context_settings=CONTEXT)
@database_option
@connect_option
@json_option
def doctor(database_url: str | None, connect_timeout: float, as_json: bool) -> None:
    """Check the connection, server, schema revision, replication, roles and clock; show
    the settings (secrets redacted); exit 1 on a problem.

    A warning is a setting under which a guarantee does not hold: an asynchronous
    standby, which a failover can promote with the last commits lost (docs/failover.md);
    a missing role; this host's clock more than a second off the database's.
    """
    from runledger.doctor import run_doctor

    results = run_doctor(_database_url(database_url), connect_timeout=connect_timeout)
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
    sys.exit(0 if all(r.ok for r in results) else 1)
