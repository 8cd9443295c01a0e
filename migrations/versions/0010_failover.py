"""Failover (issue #10 "Leases across real failures", deliverable 3): a failover that
loses commits causes no second effect and no reused token.

Tables ``timelines`` and ``failover_runs``; fencing tokens carry the server's timeline
(a claim grants ``greatest(token + 1, ((timeline - 1) << 32) + 1)``), a write with a token
of an earlier timeline is refused (RL001), and the first claim on a new timeline records
it with the runs it affected (their leases end, their planned calls are marked
dispatched); a lease of an earlier timeline is not renewed. The record is append-only
(the wall). New worker function ``claim_runs_v3`` (``claim_runs_v2`` with
``failover_turn``). The downgrade restores claim_runs, renew_leases and _lock_leased_run
of 0009 and drops the rest.

Revision ID: 0010
Revises: 0009
Create Date: 2027-02-01
"""

from __future__ import annotations

from pathlib import Path

from alembic import context, op

revision = "0010"
down_revision = "0009"
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
