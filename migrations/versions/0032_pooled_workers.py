"""A worker behind a pooler has no database session of its own: its registration is not
tied to one. ``register_worker_v2``'s ``p_session`` false records none, and the id is the
worker's until it stops or has been silent for ``p_silent_after`` (``workers.silent_after``);
the same process (``p_incarnation``, ``workers.incarnation``) and a worker that found the
registered process gone on its own host (``p_gone_process``) take it at once;
``heartbeat_worker``'s ``p_incarnation`` refuses a process whose id was taken over. The
downgrade restores 0031's functions and drops the columns.

Revision ID: 0032
Revises: 0031
Create Date: 2026-12-07
"""

from __future__ import annotations

from pathlib import Path

from alembic import context, op

revision = "0032"
down_revision = "0031"
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
