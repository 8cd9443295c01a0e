"""The contract's living home: helpers per check, literal event kinds, release with a reason.

Brings a 0001 database to the schema of ``service/runledger/db/sql`` (the living files):
new helpers (_check_worker_id, _check_lease, _check_flow, _check_json_object,
_check_json_object_or_null, _check_json_value, _check_json_value_or_null, _notify_queued),
_event with the time of a set-based statement, changed bodies that use them, and
``release_lease(p_run_id, p_lease_id, p_fencing_token, p_reason, p_error)``. No table
changes. The downgrade restores the 0001 functions exactly.

Revision ID: 0002
Revises: 0001
Create Date: 2026-12-07
"""

from __future__ import annotations

from pathlib import Path

from alembic import context, op

revision = "0002"
down_revision = "0001"
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
