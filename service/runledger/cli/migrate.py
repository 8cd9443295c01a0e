"""``runledger migrate``: upgrade the runledger schema, print its SQL (``--sql``), or check
that it is up to date (``--check``). Registered on the ``runledger`` group by
:mod:`runledger.cli`."""

from __future__ import annotations

import sys

import click

from runledger.cli.options import CONTEXT, connect_option, database_option, opt, require_url


@click.command(context_settings=CONTEXT)
@database_option
@connect_option
@opt("--sql", "sql_only", is_flag=True, help="Print the SQL; do not connect.")
@opt("--check", is_flag=True, help="Exit 1 when the database is behind; change nothing.")
@opt("--revision", default="head", help="Target revision.")
def migrate(
    database_url: str | None,
    connect_timeout: float,
    sql_only: bool,
    check: bool,
    revision: str,
) -> None:
    """Upgrade the runledger schema (safe to run from several processes at once).

    The database must exist (`createdb NAME` first); a database that cannot be reached
    is one line and exit 3.
    """
    from runledger.db import migrate as m

    if sql_only:
        click.echo(m.offline_sql(revision), nl=False)
        return
    url = require_url(database_url)
    m.check_reachable(url, connect_timeout, upgrade=not check)
    if check:
        current, head = m.current(url), m.head()
        if current != head:
            state = "behind" if current is None or m.known(current) else "unknown to this code"
            click.echo(f"{state}: database at {current or 'nothing'}, code at {head}", err=True)
            sys.exit(1)
        click.echo(f"up to date: {head}")
        return
    before = m.current(url)
    m.upgrade(url, revision)
    after = m.current(url)
    click.echo(f"migrated: {before or 'empty'} -> {after}")
