"""Live updates (issue "The operator console"): ``_event`` also sends an operator-visible
event (not the per-call and per-turn ones, nor claims) on NOTIFY channel ``runledger_events``, payload
``<event_id> <run_id> <kind>``. The downgrade restores the 0007 ``_event``.

Revision ID: 0015
Revises: 0014
Create Date: 2027-02-01
"""

from __future__ import annotations

from pathlib import Path

from alembic import context, op

revision = "0015"
down_revision = "0014"
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
