"""Faster helpers (issue "The hot path"): the same contract, cheaper SQL.

No function's signature, result, refusal or event changes. ``runledger.now()`` becomes
PL/pgSQL without ``SET search_path`` (its query is planned once per session instead of at
every call site in every transaction); ``_event`` becomes PL/pgSQL for the same reason.
No internal helper keeps ``SET search_path``: they are granted to no one and run only
under the pinned path of their SECURITY DEFINER callers (02_helpers.sql says why that is
safe). ``_lock_leased_run`` locks the run with one indexed ``SELECT ... FOR NO KEY
UPDATE`` and checks the run id only when no row matched; ``_lock_call`` tests the key's
length before it calls ``_check_text``; ``_check_json_value_or_null`` skips the depth walk
for a text too short to nest past the limit. The guards of ``runs`` and ``run_calls``
are not called for the functions' own writes: WHEN clauses on the UPDATE triggers (on
``runs`` exactly the guard's refusals, on ``run_calls`` a short superset; one trigger of
each is ``UPDATE OF`` the columns no function sets), and a DELETE trigger of their own.
The downgrade restores 0006 exactly.

Revision ID: 0007
Revises: 0006
Create Date: 2027-01-12
"""

from __future__ import annotations

from pathlib import Path

from alembic import context, op

revision = "0007"
down_revision = "0006"
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
