"""runledger_worker may read ``runledger.alembic_version`` (issue "Operate and observe"):
a worker checks the schema revision when it connects, so a login user in the role alone
(``deploy/roles.sql``) could not start. The downgrade revokes it.

Revision ID: 0013
Revises: 0012
Create Date: 2027-03-01
"""

from __future__ import annotations

from pathlib import Path

from alembic import context, op

revision = "0013"
down_revision = "0012"
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
