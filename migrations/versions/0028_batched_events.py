"""Less set-up per statement on the hot path: the events one write appends to a run together
go in one INSERT (``runledger._events``), with the rows, ids and hashes of one ``_event``
per kind; ``_check_json_value_or_null`` reads the settings only for a value an allowed
setting could refuse. The downgrade puts back one ``_event`` per kind and the settings
read for every value.

Revision ID: 0028
Revises: 0027
Create Date: 2026-12-05
"""

from __future__ import annotations

from pathlib import Path

from alembic import context, op

revision = "0028"
down_revision = "0027"
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
