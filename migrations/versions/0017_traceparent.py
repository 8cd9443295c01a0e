"""Tracing (issue #11, deliverable 5): ``runs.traceparent`` (the submitter's W3C trace
context, checked), ``submit_run_v2`` (``submit_run`` with ``p_traceparent``; ``submit_run``
becomes its wrapper) and ``claim_runs_v4`` (``claim_runs_v3`` and each run's traceparent).
The downgrade drops the two functions and the column and restores ``submit_run``.

Revision ID: 0017
Revises: 0016
Create Date: 2027-02-08
"""

from __future__ import annotations

from pathlib import Path

from alembic import context, op

revision = "0017"
down_revision = "0016"
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
