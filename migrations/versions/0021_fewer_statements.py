"""Fewer statements per tool call (issue "The hot path"): ``complete_call_v2`` completes a
call and dispatches the next one in one UPDATE of both rows, ``record_turn_v4`` inserts
the calls it dispatches as dispatched and takes the lease check's clock, and ``_event``
checks in its INSERT that the event it locked is still the run's last (no fork of the
chain when three writers of one run meet). Same signatures, results, errors, rows and
events. The downgrade restores the bodies of 0020.

Revision ID: 0021
Revises: 0020
Create Date: 2026-12-03
"""

from __future__ import annotations

from pathlib import Path

from alembic import context, op

revision = "0021"
down_revision = "0020"
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
