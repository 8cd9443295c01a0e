"""Alembic driven from code, so ``runledger migrate`` works from an installed wheel.

The revisions live in ``migrations/`` of a checkout; the wheel ships them inside the
package as ``runledger/_migrations``.

Alembic and SQLAlchemy are imported only by the functions that need them: the revision
chain every connection checks is read from the files (:mod:`runledger.db.revisions`),
and that should not cost a command half a second.

A database that cannot be reached is :class:`~runledger.errors.DatabaseUnavailable`,
one line naming host, port and database and what to do (``createdb <name>``), never a
driver traceback: :func:`check_reachable` connects once with a timeout before Alembic
does, and :func:`current` and :func:`upgrade` map a connection failure the same way.
"""

from __future__ import annotations

import contextlib
import io
from collections.abc import Iterator
from typing import TYPE_CHECKING

import psycopg

from runledger.db.connecting import connect_error, probe_blocking
from runledger.db.revisions import (
    BEFORE_BASELINE,
    behind,
    head,
    migrations_dir,
    revision_chain,
)
from runledger.db.sqlstate import is_connection_error
from runledger.errors import RunLedgerError, SchemaTooOld

if TYPE_CHECKING:
    from alembic.config import Config

__all__ = [
    "alembic_config",
    "behind",
    "check_reachable",
    "current",
    "downgrade",
    "head",
    "known",
    "migrations_dir",
    "offline_sql",
    "revision_chain",
    "sqlalchemy_url",
    "upgrade",
]


def sqlalchemy_url(url: str) -> str:
    """The URL for SQLAlchemy's psycopg dialect. A multi-host URL (``postgresql://a:1,b:2/db``
    or ``host=a,b port=1,2 ...``, what a worker uses to follow a promotion) becomes the
    dialect's form, ``postgresql+psycopg://user@/db?host=a:1&host=b:2&...``: SQLAlchemy
    cannot parse several hosts in the netloc."""
    multi = _multi_host(url)
    if multi is not None:
        return multi
    for prefix in ("postgresql://", "postgres://"):
        if url.startswith(prefix):
            return "postgresql+psycopg://" + url[len(prefix) :]
    return url


def _multi_host(url: str) -> str | None:
    from psycopg.conninfo import conninfo_to_dict
    from sqlalchemy.engine import URL

    try:
        params = {k: str(v) for k, v in conninfo_to_dict(url).items() if v is not None}
    except psycopg.Error:
        return None  # not libpq's: left for SQLAlchemy to judge
    hosts = params.pop("host", "").split(",")
    if len(hosts) < 2:
        return None
    ports = params.pop("port", "").split(",")
    if len(ports) == 1:
        ports = ports * len(hosts)
    query: dict[str, str | list[str]] = {
        "host": [f"{h}:{p}" if p else h for h, p in zip(hosts, ports, strict=False)]
    }
    user, password = params.pop("user", None), params.pop("password", None)
    dbname = params.pop("dbname", None)
    query.update(params)
    return URL.create(
        "postgresql+psycopg", username=user, password=password, database=dbname, query=query
    ).render_as_string(hide_password=False)


def alembic_config(url: str | None, *, output: io.StringIO | None = None) -> Config:
    from alembic.config import Config

    cfg = Config(output_buffer=output) if output is not None else Config()
    cfg.set_main_option("script_location", str(migrations_dir()))
    if url:
        # ConfigParser interpolates %; escape it for passwords that contain one.
        cfg.set_main_option("sqlalchemy.url", sqlalchemy_url(url).replace("%", "%%"))
    return cfg


def known(revision: str) -> bool:
    """Whether this code has ``revision`` (a database ahead of the code has one it lacks),
    or knows it as one the baseline replaced."""
    from alembic.script import ScriptDirectory

    if revision in BEFORE_BASELINE:
        return True

    script = ScriptDirectory.from_config(alembic_config(None))
    try:
        return script.get_revision(revision) is not None
    except Exception:
        return False


def check_reachable(url: str, connect_timeout: float, *, upgrade: bool = False) -> None:
    """Connect once, within ``connect_timeout`` seconds, or raise the one-line error
    (:class:`~runledger.errors.DatabaseUnavailable`: ``createdb <name>`` for a database
    that does not exist; :class:`~runledger.errors.ConfigurationError` for a bad URL).
    For an ``upgrade``, a standby is :class:`~runledger.errors.ReadOnly`: only the
    primary takes one (a check reads, and works on a standby too)."""
    probe_blocking(
        url,
        timeout=connect_timeout,
        application_name="runledger-migrate",
        check_schema=False,
        writes="the migration" if upgrade else None,
    )


@contextlib.contextmanager
def _mapped(url: str) -> Iterator[None]:
    """A connection failure inside SQLAlchemy or Alembic as the one-line runledger error."""
    from sqlalchemy.exc import DBAPIError

    try:
        yield
    except DBAPIError as exc:
        if isinstance(exc.orig, psycopg.Error) and is_connection_error(exc.orig):
            raise connect_error(exc.orig, url, None) from exc
        raise


def upgrade(url: str, revision: str = "head") -> None:
    """Upgrade to ``revision``. What Alembic or migrations/env.py refuse (a revision that
    does not exist; ``runledger.runs`` held past the wait of a revision that holds the
    event writers) is a :class:`~runledger.errors.RunLedgerError` of one line; a database
    at a revision older than the baseline can upgrade from, a
    :class:`~runledger.errors.SchemaTooOld`."""
    from alembic import command
    from alembic.util import CommandError

    cfg = alembic_config(url)
    with _mapped(url):
        try:
            command.upgrade(cfg, revision)
        except CommandError as exc:
            if cfg.attributes.get("before_baseline"):
                raise SchemaTooOld(str(exc)) from exc
            raise RunLedgerError(str(exc)) from exc


def downgrade(url: str, revision: str) -> None:
    from alembic import command

    command.downgrade(alembic_config(url), revision)


def offline_sql(revision: str = "head") -> str:
    from alembic import command

    out = io.StringIO()
    command.upgrade(alembic_config(None, output=out), revision, sql=True)
    return out.getvalue()


def current(url: str) -> str | None:
    from alembic.runtime.migration import MigrationContext
    from sqlalchemy import create_engine, pool

    engine = create_engine(sqlalchemy_url(url), poolclass=pool.NullPool)
    try:
        with _mapped(url), engine.connect() as conn:
            ctx = MigrationContext.configure(conn, opts={"version_table_schema": "runledger"})
            return ctx.get_current_revision()
    finally:
        engine.dispose()
