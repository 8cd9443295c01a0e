"""A tamper-evident event log (issue "Operate and observe"): every ``run_events`` row
carries its link in the run's hash chain, ``checkpoint_events`` records the chain heads
chained by digest, ``prune_runs`` records the chains it deletes. The downgrade drops them.

Revision ID: 0016
Revises: 0015
Create Date: 2027-02-01
"""

from __future__ import annotations

from pathlib import Path

from alembic import context, op

revision = "0016"
down_revision = "0015"
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
