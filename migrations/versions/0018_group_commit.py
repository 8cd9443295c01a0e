"""Group commit (issue "The hot path"): ``complete_calls`` writes the results of several
calls of one run (a parallel group's results that are ready together) in one
transaction, with one run lock, and optionally dispatches the next call as
``complete_call_v2`` does. ``complete_call`` and ``complete_call_v2`` stay. The downgrade
drops ``complete_calls``.

Revision ID: 0018
Revises: 0017
Create Date: 2027-02-02
"""

from __future__ import annotations

from pathlib import Path

from alembic import context, op

revision = "0018"
down_revision = "0017"
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
