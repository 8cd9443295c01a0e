"""Each event chain that ``prune_runs`` deletes records the database login that deleted
it (``event_chain_prunes.pruned_by``, ``session_user``; NULL for chains pruned before).
The downgrade drops the column and restores ``prune_runs_v2`` of 0016.

Revision ID: 0024
Revises: 0023
Create Date: 2026-12-03
"""

from __future__ import annotations

from pathlib import Path

from alembic import context, op

revision = "0024"
down_revision = "0023"
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
