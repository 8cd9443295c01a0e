"""Hostile input is refused in SQL and writes nothing; one live session per worker id.

Brings a 0002 database to the schema of ``service/runledger/db/sql`` (the living files):
``settings.max_json_depth`` (default 64) and the depth check of every JSON argument
(_check_json_depth; the JSON checks take ``p_wrap``); caps on every text and array
argument in one place (_cap, _check_text); the worker-id check in every function that
takes one; ``report_stale_write`` refuses a missing run (RL003); the lease is judged by
the clock read after the run's row lock; ``register_worker`` records the calling session
(``workers.session_pid``, ``session_started_at``) and refuses the id to another live
session (RL008). The downgrade restores the 0002 functions exactly and drops the columns.

Revision ID: 0003
Revises: 0002
Create Date: 2026-12-14
"""

from __future__ import annotations

from pathlib import Path

from alembic import context, op

revision = "0003"
down_revision = "0002"
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
