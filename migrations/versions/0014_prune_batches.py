"""Retention at scale (issue "Operate and observe"): ``prune_runs_v2`` deletes finished
runs in batches (oldest first, SKIP LOCKED), found through ``ix_runs_finished_at``.
Granted to ``runledger_operator``. The downgrade drops both.

Revision ID: 0014
Revises: 0013
Create Date: 2027-02-01
"""

from __future__ import annotations

from pathlib import Path

from alembic import context, op

revision = "0014"
down_revision = "0013"
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
