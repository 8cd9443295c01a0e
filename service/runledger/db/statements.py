"""The statements a worker sends for every tool call (and its claim), and how their rows
are read: prepared once per connection and sent without a cursor (:mod:`runledger.db.wire`).
The contract function each one calls is named in its text: the SQL version is the
store's business, never its callers'."""

from __future__ import annotations

from collections.abc import Sequence

from runledger.db import wire
from runledger.db.rows import ClaimedJournal, Row
from runledger.model import ClaimedRun, FencingToken, LeaseId, RunId

# The statements a worker sends for every tool call (and its claim), prepared once per
# connection and sent without a cursor (runledger.db.wire).
RECORD_TURN = wire.Prepared(
    "record_turn_v4",
    "SELECT * FROM runledger.record_turn_v4($1::text, $2::uuid, $3::bigint, $4::int,"
    " $5::jsonb, $6::jsonb, $7::jsonb, $8::bigint, $9::jsonb, $10::boolean, $11::text[])",
    11,
)
COMPLETE_AND_DISPATCH = wire.Prepared(
    "complete_call_v2",
    "SELECT runledger.complete_call_v2($1::text, $2::uuid, $3::bigint, $4::text, $5::text,"
    " $6::jsonb, $7::jsonb, $8::text) AS attempt",
    8,
)
CLAIM_RUNS = wire.Prepared(
    "claim_runs_v4",
    "SELECT * FROM runledger.claim_runs_v4($1::text, $2::text[], $3::interval, $4::int)",
    4,
)
FINISH_AND_CLAIM = wire.Prepared(
    "finish_and_claim",
    "SELECT * FROM runledger.finish_and_claim($1::text, $2::uuid, $3::bigint, $4::int,"
    " $5::jsonb, $6::jsonb, $7::bigint, $8::jsonb, $9::text, $10::text[], $11::interval,"
    " $12::int)",
    12,
)
COMPLETE_CALLS = wire.Prepared(
    "complete_calls",
    "SELECT runledger.complete_calls($1::text, $2::uuid, $3::bigint, $4::text[], $5::text[],"
    " $6::jsonb[], $7::jsonb[]) AS attempt",
    7,
)


def claimed(rows: Sequence[Row]) -> list[tuple[ClaimedRun, ClaimedJournal]]:
    """The runs of a ``claim_runs_v4`` reply (or of ``finish_and_claim``'s rows that carry
    a run), each with what the claim brought of its journal, left packed."""
    return [
        (
            claimed_run(r),
            ClaimedJournal(
                stalled_claims=int(r["stalled_claims"]),
                turns=r["turns"],
                calls=r["calls"],
                failover_turn=r["failover_turn"],
            ),
        )
        for r in rows
        if r["run_id"] is not None
    ]


def claimed_run(r: Row) -> ClaimedRun:
    return ClaimedRun(
        run_id=RunId(r["run_id"]),
        flow=r["flow"],
        flow_version=r["flow_version"],
        input=r["input"],
        state=r["state"],
        state_version=r["state_version"],
        fencing_token=FencingToken(r["fencing_token"]),
        lease_id=LeaseId(r["lease_id"]),
        lease_expires_at=r["lease_expires_at"],
        takeover=r["takeover"],
        traceparent=r.get("traceparent"),
    )


# a call's result committed alone (the last call of a turn): runledger.db.wire
COMPLETE_CALL = wire.Prepared(
    "complete_call",
    "SELECT runledger.complete_call($1::text, $2::uuid, $3::bigint, $4::text, $5::text,"
    " $6::jsonb, $7::jsonb)",
    7,
)
