"""A lost connection is not a dead worker: a call an earlier holder sent, with no answer
journaled, is looked up or sent again only once that sender can no longer be sending it
(it released the call, its process is known gone, or its lease expired by the database
clock): ``_dispatch`` refuses with RL009 before then. ``call_sender`` and
``release_call``; ``workers.process`` and ``register_worker_v2``'s ``p_process``. The
downgrade restores 0030's functions and drops the column.

Revision ID: 0031
Revises: 0030
Create Date: 2026-12-07
"""

from __future__ import annotations

from pathlib import Path

from alembic import context, op

revision = "0031"
down_revision = "0030"
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
