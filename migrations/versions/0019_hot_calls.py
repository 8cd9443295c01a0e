"""The hot path's per-call SQL, cheaper (issue "The hot path"): the same contract.
``_lock_leased_run_at`` (new) returns the clock reading of the lease check, which
dispatch_call, complete_call(_v2), complete_calls, checkpoint and finish_run use instead
of reading the clock again; a call's dispatch (``_dispatch``) and completion
(``complete_call``, ``complete_call_v2``) are one UPDATE ... RETURNING, with the lock and
checks of ``_lock_call`` only to refuse; ``_check_json_value_or_null`` skips the depth walk
for a text with few brackets. The downgrade restores the bodies of 0018 and drops
``_lock_leased_run_at``.

Revision ID: 0019
Revises: 0018
Create Date: 2027-02-09
"""

from __future__ import annotations

from pathlib import Path

from alembic import context, op

revision = "0019"
down_revision = "0018"
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
