"""``finish_and_claim``: a run's final decision (``record_turn_v4`` ending the run) and the
same worker's next claim (``claim_runs_v4``) in one transaction, for a worker with one run
in hand. The downgrade drops it.

Revision ID: 0026
Revises: 0025
Create Date: 2026-12-05
"""

from __future__ import annotations

from pathlib import Path

from alembic import context, op

revision = "0026"
down_revision = "0025"
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
