"""The claim's scans of expired and orphaned leases compare the flow through an
expression no index has, so they go through ``ix_runs_lease_expiry`` and
``ix_runs_lease_lock`` whatever the statistics say: a generic plan built before
autovacuum had analyzed a large burst read every queued run of the flow at each claim
(1.1 s a claim at a million). Same signatures, results, errors, rows and events. The
downgrade restores ``_claim`` of 0022.

Revision ID: 0030
Revises: 0029
Create Date: 2026-12-06
"""

from __future__ import annotations

from pathlib import Path

from alembic import context, op

revision = "0030"
down_revision = "0029"
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
