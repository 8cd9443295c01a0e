"""The claim plans without sequential or bitmap scans (issue "The hot path"): a backlog
claimed before autovacuum had analyzed ``runs`` made the claim's generic plan read every
claimable row at each claim. Same signatures, results, errors, rows and events. The
downgrade restores ``_claim`` of 0020.

Revision ID: 0022
Revises: 0021
Create Date: 2026-12-03
"""

from __future__ import annotations

from pathlib import Path

from alembic import context, op

revision = "0022"
down_revision = "0021"
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
