"""Human approval of tool calls (issue "Real agents", item 6).

Adds ``run_calls.approval`` (NULL, ``pending``, ``approved``, ``denied``) with
``approval_by``, ``approval_note`` and ``approval_at`` and their constraints;
``record_turn_v2`` takes an optional ``"approval": true`` per call and ``dispatch_call``
refuses a pending call. New operator functions ``approve_call`` and ``deny_call``
(granted to ``runledger_operator``), and the helper ``_requeue_if_settled`` that
``resolve_call`` now shares with them. The guard of ``run_calls`` keeps a decision from
moving or changing. The downgrade restores 0005 exactly.

Revision ID: 0006
Revises: 0005
Create Date: 2027-01-05
"""

from __future__ import annotations

from pathlib import Path

from alembic import context, op

revision = "0006"
down_revision = "0005"
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
