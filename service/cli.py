"""The ``runledger`` command (``python -m service`` is the same).

Data goes to stdout, logs to stderr. Exit codes: 0 ok, 1 check failed or refused,
2 usage. Every option also reads ``RUNLEDGER_<OPTION>`` (``--help`` shows it).
"""

from __future__ import annotations

import json
import sys
from typing import Any

import click

from service import errors
from service.config import load_settings

CONTEXT = {"auto_envvar_prefix": "RUNLEDGER", "show_default": True}


def _database_url(value: str | None) -> str:
    try:
        return load_settings(database_url=value).require_database_url()
    except errors.ConfigurationError as exc:
        raise click.UsageError(str(exc)) from exc


def emit(data: Any, *, as_json: bool) -> None:
    if as_json:
        click.echo(json.dumps(data, default=str, indent=2, sort_keys=True))
    else:
        click.echo(data)


database_option = click.option(
    "--database-url",
    envvar=["RUNLEDGER_DATABASE_URL", "DATABASE_URL"],
    show_envvar=True,
    help="PostgreSQL URL (RUNLEDGER_DATABASE_URL, then DATABASE_URL).",
)


@click.group(context_settings=CONTEXT)
@click.version_option(package_name="runledger")
def main() -> None:
    """runledger: durable, fenced AI-agent runs on PostgreSQL."""


@main.command(context_settings=CONTEXT)
@database_option
@click.option("--sql", "sql_only", is_flag=True, help="Print the SQL; do not connect.")
@click.option("--check", is_flag=True, help="Exit 1 when the database is behind; change nothing.")
@click.option("--revision", default="head", help="Target revision.")
def migrate(database_url: str | None, sql_only: bool, check: bool, revision: str) -> None:
    """Upgrade the runledger schema (safe to run from several processes at once)."""
    from service.db import migrate as m

    if sql_only:
        click.echo(m.offline_sql(revision), nl=False)
        return
    url = _database_url(database_url)
    if check:
        current, head = m.current(url), m.head()
        if current != head:
            click.echo(f"behind: database at {current or 'nothing'}, code at {head}", err=True)
            sys.exit(1)
        click.echo(f"up to date: {head}")
        return
    before = m.current(url)
    m.upgrade(url, revision)
    after = m.current(url)
    click.echo(f"migrated: {before or 'empty'} -> {after}")


def run() -> None:
    """Entry point that turns runledger errors into exit code 1 with a clear line."""
    try:
        main(standalone_mode=True)
    except errors.RunLedgerError as exc:
        click.echo(f"error: {exc}", err=True)
        sys.exit(1)
