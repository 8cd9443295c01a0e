"""Revision 0.2, open until the 0.2.0 release (CONTRIBUTING.md): the witness of how
commits are acknowledged (runledger.commit_guarantees), and a failover detection that
doubts nothing after a failover that could lose no acknowledged commit. A delta on the
baseline 0.1; the downgrade puts 0.1's functions back and drops what this added.

Revision ID: 0.2
Revises: 0.1
Create Date: 2026-12-07
"""

from __future__ import annotations

from pathlib import Path

from alembic import context, op

revision = "0.2"
down_revision = "0.1"
branch_labels = None
depends_on = None

_HERE = Path(__file__).with_suffix("")


def _run(sql_file: Path) -> None:
    # Sent as is through the driver (no bind-parameter parsing of % or :name).
    sql = sql_file.read_text(encoding="utf-8")
    if context.is_offline_mode():
        op.get_context().impl.static_output(sql)
    else:
        op.get_bind().connection.driver_connection.execute(sql)


def upgrade() -> None:
    _run(_HERE.with_suffix(".sql"))


def downgrade() -> None:
    _run(_HERE.with_suffix(".down.sql"))
