"""The delete guards cannot be switched off by a session setting (issue 7, item 9).

Adds ``runledger.prune_authorizations`` (granted to no one) with its guard
``tg_prune_authorizations_guard`` and the helper ``_prune_authorized``; ``prune_runs``
authorizes its own deletes with a row for its transaction instead of the setting
``runledger.pruning``, and the four delete guards look for that row. The guard of runs
also refuses to delete a run that is not finished. The downgrade restores the 0002
functions exactly and drops the table.

Revision ID: 0004
Revises: 0003
Create Date: 2026-12-08
"""

from __future__ import annotations

from pathlib import Path

from alembic import context, op

revision = "0004"
down_revision = "0003"
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
