"""Alembic driven from code, so ``runledger migrate`` works from an installed wheel.

The revisions live in ``migrations/`` of a checkout; the wheel ships them inside the
package as ``runledger/_migrations``.
"""

from __future__ import annotations

import io
from pathlib import Path

from alembic import command
from alembic.config import Config
from alembic.runtime.migration import MigrationContext
from alembic.script import ScriptDirectory
from sqlalchemy import create_engine, pool

from runledger.errors import ConfigurationError

_PACKAGE = Path(__file__).resolve().parent.parent


def migrations_dir() -> Path:
    for candidate in (_PACKAGE / "_migrations", _PACKAGE.parent.parent / "migrations"):
        if (candidate / "env.py").is_file():
            return candidate
    raise ConfigurationError("runledger migrations not found (broken installation?)")


def sqlalchemy_url(url: str) -> str:
    for prefix in ("postgresql://", "postgres://"):
        if url.startswith(prefix):
            return "postgresql+psycopg://" + url[len(prefix) :]
    return url


def alembic_config(url: str | None, *, output: io.StringIO | None = None) -> Config:
    cfg = Config(output_buffer=output) if output is not None else Config()
    cfg.set_main_option("script_location", str(migrations_dir()))
    if url:
        # ConfigParser interpolates %; escape it for passwords that contain one.
        cfg.set_main_option("sqlalchemy.url", sqlalchemy_url(url).replace("%", "%%"))
    return cfg


def head() -> str:
    heads = ScriptDirectory.from_config(alembic_config(None)).get_heads()
    if len(heads) != 1:
        raise ConfigurationError(f"expected one migration head, found {heads}")
    return heads[0]


def known(revision: str) -> bool:
    """Whether this code has ``revision`` (a database ahead of the code has one it lacks)."""
    script = ScriptDirectory.from_config(alembic_config(None))
    try:
        return script.get_revision(revision) is not None
    except Exception:
        return False


def upgrade(url: str, revision: str = "head") -> None:
    command.upgrade(alembic_config(url), revision)


def downgrade(url: str, revision: str) -> None:
    command.downgrade(alembic_config(url), revision)


def offline_sql(revision: str = "head") -> str:
    out = io.StringIO()
    command.upgrade(alembic_config(None, output=out), revision, sql=True)
    return out.getvalue()


def current(url: str) -> str | None:
    engine = create_engine(sqlalchemy_url(url), poolclass=pool.NullPool)
    try:
        with engine.connect() as conn:
            ctx = MigrationContext.configure(conn, opts={"version_table_schema": "runledger"})
            return ctx.get_current_revision()
    finally:
        engine.dispose()
