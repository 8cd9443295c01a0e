"""The WHEN of each guard trigger that the contract functions' UPDATEs fire calls a PL/pgSQL
function whose body is the condition as before (``runledger._tw_<trigger>``, executable by
PUBLIC, schema-qualified): a small node to prepare in every statement instead of the whole
condition. The downgrade puts the conditions back inline and drops the functions.

Revision ID: 0029
Revises: 0028
Create Date: 2026-12-05
"""

from __future__ import annotations

from pathlib import Path

from alembic import context, op

revision = "0029"
down_revision = "0028"
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
