"""Session locks (issue "Leases across real failures"): a dead worker's runs are taken
over before their leases expire, without weakening fencing.

New columns ``runs.lease_lock`` and ``workers.session_lock`` (and index
``ix_runs_lease_lock``); new worker functions (granted to ``runledger_worker``):
``register_worker_v2`` (register, and hold a session-level advisory lock under a fresh
key on the calling session) and ``heartbeat_listener``; ``claim_runs`` (same signature)
stamps the claimer's key on each run and also takes a running run whose holder's lock is
free; ``register_worker`` clears the key. The downgrade restores both and drops the rest.

Revision ID: 0011
Revises: 0010
Create Date: 2027-02-01
"""

from __future__ import annotations

from pathlib import Path

from alembic import context, op

# one constant each: renumbered on merge (another branch takes 0009)
revision = "0011"
down_revision = "0010"
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
