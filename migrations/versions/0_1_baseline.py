"""The baseline of runledger 0.1: the whole schema, from the living files
(service/runledger/db/sql/) as they were at the release. Replaces revisions 0001-0032 of
the unreleased history: an empty database gets this revision; one at 0032 (runledger at
4b19f01) is brought here by migrations/env.py (0_1_baseline.from_0032.sql, then a stamp);
an older one is refused. The downgrade removes everything in schema runledger but the
version table.

Revision ID: 0.1
Revises:
Create Date: 2026-12-07
"""

from __future__ import annotations

from pathlib import Path

from alembic import context, op

revision = "0.1"
down_revision = None
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
