"""A run's event chain is extended in READ COMMITTED transactions only (RL006 otherwise):
under a snapshot of the whole transaction, ``_event`` could chain a new event to the same
event as one committed since, forking the chain. The downgrade restores ``_event`` of 0021.

Revision ID: 0023
Revises: 0022
Create Date: 2026-12-03
"""

from __future__ import annotations

from pathlib import Path

from alembic import context, op

revision = "0023"
down_revision = "0022"
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
