"""The decision, verbatim (issue 8, items 1 and 2).

Adds ``run_turns.record`` and ``run_turns.output``, ``run_calls.provider_id`` and the
function ``record_turn_v2`` that writes them (granted to ``runledger_worker``);
``record_turn`` is unchanged. The guard of ``run_calls`` keeps ``provider_id``
immutable. The downgrade restores 0004 exactly.

Revision ID: 0005
Revises: 0004
Create Date: 2026-12-15
"""

from __future__ import annotations

from pathlib import Path

from alembic import context, op

revision = "0005"
down_revision = "0004"
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
