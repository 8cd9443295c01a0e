"""SQLAlchemy Core description of the runledger tables: the model Alembic compares against.

The schema itself is created by the SQL of the migrations (``migrations/versions/*.sql``);
this module describes the result, so ``alembic.autogenerate.compare_metadata`` can tell
when the two drift apart (``tests/migrations`` asserts they do not). Nothing here runs
DDL, and no revision imports it. Constraint and index names follow the naming
convention below, so a violation reported by PostgreSQL names itself.
"""

from __future__ import annotations

from typing import Final

from sqlalchemy import (
    BigInteger,
    Boolean,
    CheckConstraint,
    Column,
    DateTime,
    ForeignKeyConstraint,
    Index,
    Integer,
    LargeBinary,
    MetaData,
    PrimaryKeyConstraint,
    Table,
    Text,
    UniqueConstraint,
    text,
)
from sqlalchemy.dialects.postgresql import ARRAY, INTERVAL, JSONB, UUID

SCHEMA: Final = "runledger"

NAMING_CONVENTION: Final[dict[str, str]] = {
    "pk": "pk_%(table_name)s",
    "uq": "uq_%(table_name)s_%(column_0_name)s",
    "fk": "fk_%(table_name)s_%(column_0_name)s_%(referred_table_name)s",
    "ix": "ix_%(table_name)s_%(column_0_name)s",
    "ck": "ck_%(table_name)s_%(constraint_name)s",
}

metadata: Final = MetaData(schema=SCHEMA, naming_convention=dict(NAMING_CONVENTION))

RUN_STATUSES: Final = ("queued", "running", "paused", "succeeded", "failed", "cancelled")
CALL_STATUSES: Final = ("planned", "dispatched", "succeeded", "failed", "unknown")
APPROVALS: Final = ("pending", "approved", "denied")
RUN_ID_PATTERN: Final = "^[A-Za-z0-9][A-Za-z0-9._:@-]{0,127}$"
# a W3C trace context header, version 00 (revision 0017)
TRACEPARENT_PATTERN: Final = "^00-[0-9a-f]{32}-[0-9a-f]{16}-[0-9a-f]{2}$"


def _tstz() -> DateTime:
    return DateTime(timezone=True)


def _ck(table: str, name: str, *columns: str) -> CheckConstraint:
    """Revision 0027: the CHECK ``ck_<table>_<name>`` calls the function
    ``runledger._ck_<table>_<name>`` of ``columns``, whose body is the constraint's
    expression (db/sql/01_tables.sql): PostgreSQL compiles a CHECK's expression at every
    INSERT and UPDATE statement, a PL/pgSQL body once per session. ``create_all`` needs
    those functions first (tests/migrations/test_tables_match.py makes them)."""
    return CheckConstraint(f"{SCHEMA}._ck_{table}_{name}({', '.join(columns)})", name=name)


settings: Final = Table(
    "settings",
    metadata,
    Column("singleton", Boolean, nullable=False, server_default=text("true")),
    Column("max_payload_bytes", Integer, nullable=False, server_default=text("1048576")),
    Column("clock_offset", INTERVAL, nullable=False, server_default=text("'00:00:00'::interval")),
    Column("max_json_depth", Integer, nullable=False, server_default=text("64")),
    # 0001 declares this key inline, so PostgreSQL named it; the convention would say
    # pk_settings. Kept as created until a revision renames it.
    PrimaryKeyConstraint("singleton", name="settings_pkey"),
    CheckConstraint("singleton", name="singleton"),
    CheckConstraint("max_payload_bytes BETWEEN 1024 AND 268435456", name="max_payload_bytes"),
    CheckConstraint("max_json_depth BETWEEN 1 AND 1000", name="max_json_depth"),
)

runs: Final = Table(
    "runs",
    metadata,
    Column("run_id", Text, nullable=False),
    Column("flow", Text, nullable=False),
    Column("flow_version", Text, nullable=False),
    Column("status", Text, nullable=False, server_default=text("'queued'::text")),
    Column("input", JSONB, nullable=False),
    Column("state", JSONB, nullable=True),
    Column("state_version", BigInteger, nullable=False, server_default=text("0")),
    Column("fencing_token", BigInteger, nullable=False, server_default=text("0")),
    Column("lease_id", UUID(as_uuid=True), nullable=True),
    Column("lease_owner", Text, nullable=True),
    Column("lease_expires_at", _tstz(), nullable=True),
    Column("claims", Integer, nullable=False, server_default=text("0")),
    Column("stalled_claims", Integer, nullable=False, server_default=text("0")),
    Column("priority", Integer, nullable=False, server_default=text("0")),
    Column("available_at", _tstz(), nullable=False),
    Column("pause_reason", Text, nullable=True),
    Column("result", JSONB, nullable=True),
    Column("error", JSONB, nullable=True),
    Column("created_at", _tstz(), nullable=False),
    Column("updated_at", _tstz(), nullable=False),
    Column("finished_at", _tstz(), nullable=True),
    # 0011: the session lock of the holder's listener (claim_runs stamps it; NULL: none)
    Column("lease_lock", BigInteger, nullable=True),
    # 0017: the submitter's W3C trace context (submit_run_v2); NULL: none
    Column("traceparent", Text, nullable=True),
    PrimaryKeyConstraint("run_id"),
    _ck("runs", "run_id", "run_id"),
    _ck("runs", "status", "status"),
    _ck("runs", "input_object", "input"),
    _ck("runs", "state_object", "state"),
    _ck("runs", "lease_complete", "lease_id", "lease_expires_at"),
    _ck("runs", "running_has_lease", "status", "lease_id"),
    _ck("runs", "finished_at", "status", "finished_at"),
    _ck("runs", "traceparent", "traceparent"),
)
Index(
    "ix_runs_claimable",
    runs.c.flow,
    runs.c.flow_version,
    runs.c.priority.desc(),
    runs.c.created_at,
    postgresql_where=runs.c.status.in_(["queued", "running"]),
)
Index("ix_runs_status", runs.c.status)
# revision 0012: runledger list, newest first
Index("ix_runs_created_at", runs.c.created_at, runs.c.run_id)
# revision 0014: prune_runs_v2, the oldest finished runs first
Index(
    "ix_runs_finished_at",
    runs.c.finished_at,
    postgresql_where=runs.c.finished_at.isnot(None),
)
Index(
    "ix_runs_lease_expiry",
    runs.c.lease_expires_at,
    postgresql_where=runs.c.status == "running",
)
Index(
    "ix_runs_lease_lock",
    runs.c.lease_lock,
    postgresql_where=(runs.c.status == "running") & runs.c.lease_lock.isnot(None),
)

run_turns: Final = Table(
    "run_turns",
    metadata,
    Column("run_id", Text, nullable=False),
    Column("turn", Integer, nullable=False),
    Column("calls", JSONB, nullable=False),
    Column("fencing_token", BigInteger, nullable=False),
    Column("created_at", _tstz(), nullable=False),
    Column("record", JSONB, nullable=True),  # 0005: the provider-native message
    Column("output", JSONB, nullable=True),  # 0005: the final decision's output
    PrimaryKeyConstraint("run_id", "turn"),
    ForeignKeyConstraint(["run_id"], [runs.c.run_id], ondelete="CASCADE"),
    _ck("run_turns", "turn", "turn"),
    _ck("run_turns", "calls_array", "calls"),
    _ck("run_turns", "record_object", "record"),
    _ck("run_turns", "output_final", "output", "calls"),
)

run_calls: Final = Table(
    "run_calls",
    metadata,
    Column("run_id", Text, nullable=False),
    Column("turn", Integer, nullable=False),
    Column("call_id", Text, nullable=False),
    Column("position", Integer, nullable=False),
    Column("tool", Text, nullable=False),
    Column("args", JSONB, nullable=False),
    Column("idempotency_key", Text, nullable=False),
    Column("status", Text, nullable=False, server_default=text("'planned'::text")),
    Column("attempts", Integer, nullable=False, server_default=text("0")),
    Column("result", JSONB, nullable=True),
    Column("receipt", JSONB, nullable=True),
    Column("error", JSONB, nullable=True),
    Column("dispatched_token", BigInteger, nullable=True),
    Column("completed_token", BigInteger, nullable=True),
    Column("dispatched_by", Text, nullable=True),
    Column("completed_by", Text, nullable=True),
    Column("dispatched_at", _tstz(), nullable=True),
    Column("completed_at", _tstz(), nullable=True),
    Column("resolved_by", Text, nullable=True),
    Column("resolved_at", _tstz(), nullable=True),
    Column("resolution_note", Text, nullable=True),
    Column("provider_id", Text, nullable=True),  # 0005: the model's id, never in a key
    # 0006: human approval (NULL: none needed) and who decided it, why and when
    Column("approval", Text, nullable=True),
    Column("approval_by", Text, nullable=True),
    Column("approval_note", Text, nullable=True),
    Column("approval_at", _tstz(), nullable=True),
    PrimaryKeyConstraint("run_id", "turn", "call_id"),
    UniqueConstraint("idempotency_key"),
    # Named by hand: the convention would use the first column (run_id).
    ForeignKeyConstraint(
        ["run_id", "turn"],
        [run_turns.c.run_id, run_turns.c.turn],
        name="fk_run_calls_turn_run_turns",
        ondelete="CASCADE",
    ),
    _ck("run_calls", "status", "status"),
    _ck("run_calls", "args_object", "args"),
    _ck("run_calls", "attempts", "attempts"),
    _ck("run_calls", "key", "idempotency_key", "run_id", "turn", "call_id"),
    _ck("run_calls", "approval", "approval"),
    _ck("run_calls", "approval_status", "approval", "status"),
    _ck("run_calls", "approval_decided", "approval", "approval_by", "approval_at", "approval_note"),
)
# No index on status (revision 0009): see 01_tables.sql.

# No foreign key to runs: events outlive their run when prune_runs keeps them.
run_events: Final = Table(
    "run_events",
    metadata,
    Column("event_id", BigInteger, nullable=False, autoincrement=True),
    Column("run_id", Text, nullable=False),
    Column("at", _tstz(), nullable=False),
    Column("kind", Text, nullable=False),
    Column("actor", Text, nullable=True),
    Column("fencing_token", BigInteger, nullable=True),
    Column("state_version", BigInteger, nullable=True),
    Column("detail", JSONB, nullable=False, server_default=text("'{}'::jsonb")),
    # revision 0016: the link of the run's hash chain (NULL before 0016)
    Column("hash", LargeBinary, nullable=True),
    PrimaryKeyConstraint("event_id"),
    _ck("run_events", "hash", "hash"),
)
Index("ix_run_events_run_id", run_events.c.run_id, run_events.c.event_id)

workers: Final = Table(
    "workers",
    metadata,
    Column("worker_id", Text, nullable=False),
    Column("hostname", Text, nullable=False),
    Column("pid", Integer, nullable=False),
    Column("flows", ARRAY(Text), nullable=False),
    Column("started_at", _tstz(), nullable=False),
    Column("heartbeat_at", _tstz(), nullable=False),
    Column("stopped_at", _tstz(), nullable=True),
    # the database session that registered (register_worker): the id is refused to another
    # session while this one is alive
    Column("session_pid", Integer, nullable=True),
    Column("session_started_at", _tstz(), nullable=True),
    # 0011: the key of the session lock the registering session holds (register_worker_v2)
    Column("session_lock", BigInteger, nullable=True),
    # 0031: the worker's process as its host names it, for a peer on the same host to tell
    # whether it is gone (runledger.worker.liveness); NULL: unknown
    Column("process", Text, nullable=True),
    # 0032: the worker process's own random id (the same process registering again) and
    # how long it may be silent before its id is free when it has no session of its own
    # (registered through a pooler: session_pid NULL)
    Column("incarnation", UUID(as_uuid=True), nullable=True),
    Column("silent_after", INTERVAL, nullable=True),
    Column("clock_offset", INTERVAL, nullable=True),
    PrimaryKeyConstraint("worker_id"),
)

# Written only by prune_runs (the authorization the delete guards look for) and granted
# to no one; empty outside a prune_runs call. See docs/design.md, "The trigger wall".
prune_authorizations: Final = Table(
    "prune_authorizations",
    metadata,
    Column("txid", BigInteger, nullable=False, autoincrement=False),
    PrimaryKeyConstraint("txid"),
)

# Revision 0010 (failover): the timelines the schema was seen on, in order, and the runs a
# failover found unfinished (docs/failover.md).
timelines: Final = Table(
    "timelines",
    metadata,
    Column("position", Integer, nullable=False, autoincrement=False),
    Column("timeline", Integer, nullable=False),
    Column("previous_timeline", Integer, nullable=True),
    Column("seen_at", _tstz(), nullable=False),
    Column("seen_by", Text, nullable=True),
    Column("last_replay_at", _tstz(), nullable=True),
    Column("last_event_id", BigInteger, nullable=True),
    Column("max_token", BigInteger, nullable=True),
    Column("affected_runs", Integer, nullable=False, server_default=text("0")),
    Column("lossless", Boolean, nullable=True),  # 0.2: could it lose an acknowledged commit
    Column("evidence", JSONB, nullable=True),  # 0.2: the commit_guarantees row it judged by
    PrimaryKeyConstraint("position"),
    CheckConstraint("timeline >= 1", name="timeline"),
)

# Revision 0.2: how the workers' commits were acknowledged, as their claims saw it.
commit_guarantees: Final = Table(
    "commit_guarantees",
    metadata,
    Column("position", Integer, nullable=False, autoincrement=False),
    Column("synchronous_commit", Text, nullable=False),
    Column("synchronous_standby_names", Text, nullable=False),
    Column("timeline", Integer, nullable=False),
    Column("seen_at", _tstz(), nullable=False),
    Column("seen_by", Text, nullable=True),
    PrimaryKeyConstraint("position"),
)

failover_runs: Final = Table(
    "failover_runs",
    metadata,
    Column("run_id", Text, nullable=False),
    Column("position", Integer, nullable=False, autoincrement=False),
    Column("status", Text, nullable=False),
    Column("lease_owner", Text, nullable=True),
    Column("fencing_token", BigInteger, nullable=False),
    Column("turn", Integer, nullable=False),
    Column("marked_calls", ARRAY(Text), nullable=False),
    PrimaryKeyConstraint("run_id", "position"),
    ForeignKeyConstraint(["run_id"], [runs.c.run_id], ondelete="CASCADE"),
    ForeignKeyConstraint(["position"], [timelines.c.position]),
)

# Revision 0016: the checkpoints of the event chains, their heads, the chains pruned.
event_checkpoints: Final = Table(
    "event_checkpoints",
    metadata,
    Column("checkpoint_id", BigInteger, nullable=False, autoincrement=False),
    Column("at", _tstz(), nullable=False),
    Column("actor", Text, nullable=True),
    Column("through_event_id", BigInteger, nullable=False),
    Column("runs", Integer, nullable=False),
    Column("previous_digest", LargeBinary, nullable=True),
    Column("digest", LargeBinary, nullable=False),
    PrimaryKeyConstraint("checkpoint_id"),
    CheckConstraint("(checkpoint_id = 0) = (previous_digest IS NULL)", name="first"),
)

event_checkpoint_heads: Final = Table(
    "event_checkpoint_heads",
    metadata,
    Column("checkpoint_id", BigInteger, nullable=False, autoincrement=False),
    Column("run_id", Text, nullable=False),
    Column("event_id", BigInteger, nullable=False),
    Column("hash", LargeBinary, nullable=False),
    PrimaryKeyConstraint("checkpoint_id", "run_id"),
    ForeignKeyConstraint(["checkpoint_id"], [event_checkpoints.c.checkpoint_id]),
)
# 0.2: the heads of one run (prune_records)
Index(
    "ix_event_checkpoint_heads_run_id",
    event_checkpoint_heads.c.run_id,
    event_checkpoint_heads.c.event_id,
)

event_chain_prunes: Final = Table(
    "event_chain_prunes",
    metadata,
    Column("run_id", Text, nullable=False),
    Column("last_event_id", BigInteger, nullable=False, autoincrement=False),
    Column("last_hash", LargeBinary, nullable=True),
    Column("events", Integer, nullable=False),
    Column("pruned_at", _tstz(), nullable=False),
    Column("pruned_by", Text, nullable=True),  # revision 0024
    PrimaryKeyConstraint("run_id", "last_event_id"),
)
# 0.2: retention of the records, the oldest first (prune_records)
Index("ix_event_chain_prunes_pruned_at", event_chain_prunes.c.pruned_at)

# Revision 0.2: the checkpoints prune_records deleted (the range, its last digest).
event_checkpoint_prunes: Final = Table(
    "event_checkpoint_prunes",
    metadata,
    Column("through_checkpoint_id", BigInteger, nullable=False, autoincrement=False),
    Column("digest", LargeBinary, nullable=False),
    Column("through_at", _tstz(), nullable=False),
    Column("checkpoints", Integer, nullable=False),
    Column("heads", Integer, nullable=False),
    Column("carried", Integer, nullable=False),
    Column("carried_into", BigInteger, nullable=True),
    Column("pruned_at", _tstz(), nullable=False),
    Column("pruned_by", Text, nullable=True),
    PrimaryKeyConstraint("through_checkpoint_id"),
)

__all__ = [
    "APPROVALS",
    "CALL_STATUSES",
    "NAMING_CONVENTION",
    "RUN_ID_PATTERN",
    "RUN_STATUSES",
    "SCHEMA",
    "TRACEPARENT_PATTERN",
    "commit_guarantees",
    "event_chain_prunes",
    "event_checkpoint_heads",
    "event_checkpoint_prunes",
    "event_checkpoints",
    "failover_runs",
    "metadata",
    "prune_authorizations",
    "run_calls",
    "run_events",
    "run_turns",
    "runs",
    "settings",
    "timelines",
    "workers",
]
