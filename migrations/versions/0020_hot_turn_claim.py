"""The hot path's SQL, cheaper (issue "The hot path"): the claim has one body,
``_claim``, whose columns ``claim_runs`` and ``claim_runs_v2``, ``v3`` and ``v4`` select;
it plans its claim statement once per session (``plan_cache_mode = force_generic_plan``)
instead of at every call and reads the worker's per-run journal in that statement; and
``record_turn_v4`` reads what its checks need in one statement and skips the checks'
queries in the common case. Same signatures, results, errors, rows and events.
The downgrade restores the bodies of 0019 and drops ``_claim``.

Revision ID: 0020
Revises: 0019
Create Date: 2027-02-03
"""

from __future__ import annotations

from pathlib import Path

from alembic import context, op

revision = "0020"
down_revision = "0019"
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
