"""The fast path (issue "The hot path: 1.5x the fastest Postgres peer, at most two
commits per tool call").

New worker functions (granted to ``runledger_worker``): ``claim_runs_v2`` returns each
claimed run's stalled-claim count and journal with the claim; ``record_turn_v3`` records a
decision with the checkpoint before it and, for the final decision, the run's success, in
one transaction; ``complete_call_v2`` completes a call and dispatches the next one in one
transaction. The old functions are unchanged. The downgrade drops the three.

Revision ID: 0008
Revises: 0007
Create Date: 2027-01-20
"""

from __future__ import annotations

from pathlib import Path

from alembic import context, op

revision = "0008"
down_revision = "0007"
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
