"""A run's events are appended under the run's row lock, which every writer of them holds
(``renew_leases`` and ``report_stale_write`` now lock the run too), not under a lock of
the run's last event row taken by ``_event``. The downgrade restores the three functions
as they were (``_event`` of 0023, ``renew_leases`` of 0010, ``report_stale_write`` of
0003).

Revision ID: 0025
Revises: 0024
Create Date: 2026-12-05
"""

from __future__ import annotations

from pathlib import Path

from alembic import context, op

revision = "0025"
down_revision = "0024"
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
