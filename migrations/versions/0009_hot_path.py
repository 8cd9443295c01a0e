"""The hot path, second part (issue "The hot path: 1.5x the fastest Postgres peer").

``record_turn_v4`` (granted to ``runledger_worker``) records a decision and dispatches its
first calls in one transaction; ``record_turn_v3`` becomes ``record_turn_v4`` without them.
One helper, ``_dispatch``, writes every dispatch. ``complete_call`` and
``complete_call_v2`` write the run row only when a stalled-claim count is to be reset.
``ix_run_calls_open`` is dropped (its predicate on status kept call updates from being
heap-only) and ``runs`` and ``run_calls`` get fillfactor 80. The downgrade restores 0008.

Revision ID: 0009
Revises: 0008
Create Date: 2027-02-01
"""

from __future__ import annotations

from pathlib import Path

from alembic import context, op

revision = "0009"
down_revision = "0008"
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
