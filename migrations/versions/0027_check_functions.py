"""Every CHECK constraint of ``runs``, ``run_turns``, ``run_calls`` and ``run_events``
calls a PL/pgSQL function of the columns it reads (``runledger._ck_<constraint>``), whose
body is the constraint's expression as before: the same names, rows and errors, without
the expressions deserialized and compiled again at every INSERT and UPDATE statement.
The downgrade puts the expressions back inline and drops the functions.

Revision ID: 0027
Revises: 0026
Create Date: 2026-12-05
"""

from __future__ import annotations

from pathlib import Path

from alembic import context, op

revision = "0027"
down_revision = "0026"
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
