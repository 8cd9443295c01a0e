"""The audit's queries: one per invariant, each returning the rows that break it.

The checks and their SQL live here, with the reads :func:`runledger.audit.audit` makes on
one read-only connection (:func:`audit_connection`). The chain checks verify the hash
chains of run_events and their checkpoints; docs/audit.md explains them.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any, LiteralString

import psycopg
from psycopg.rows import dict_row

from runledger.config import connection_settings
from runledger.db.pooler import read_only_session

Row = dict[str, Any]


@dataclass(frozen=True, slots=True)
class Check:
    name: str
    description: str
    sql: LiteralString


CHECKS: tuple[Check, ...] = (
    Check(
        "succeeded_call_without_completion",
        "a succeeded call has the token it completed under and never more attempts than dispatches",
        """SELECT idempotency_key, completed_token, attempts FROM runledger.run_calls
           WHERE status = 'succeeded' AND resolved_by IS NULL
             AND (completed_token IS NULL OR dispatched_token IS NULL OR attempts < 1)""",
    ),
    Check(
        "token_from_the_future",
        "no call was dispatched or completed under a token the run never had",
        """SELECT c.idempotency_key, c.dispatched_token, c.completed_token, r.fencing_token
           FROM runledger.run_calls c JOIN runledger.runs r USING (run_id)
           WHERE c.dispatched_token > r.fencing_token OR c.completed_token > r.fencing_token""",
    ),
    Check(
        "claim_token_reused",
        "each claim of a run has its own fencing token (no token granted twice)",
        """SELECT run_id, fencing_token, count(*) AS claims FROM runledger.run_events
           WHERE kind IN ('claimed', 'takeover')
           GROUP BY run_id, fencing_token HAVING count(*) > 1""",
    ),
    Check(
        "turn_after_open_call",
        "no turn was recorded while a call of an earlier turn had no final result",
        """SELECT t.run_id, t.turn FROM runledger.run_turns t
           JOIN runledger.run_calls c ON c.run_id = t.run_id AND c.turn < t.turn
           WHERE c.status IN ('planned', 'dispatched', 'unknown')""",
    ),
    Check(
        "paused_without_reason",
        "a paused run says why",
        "SELECT run_id FROM runledger.runs WHERE status = 'paused' AND pause_reason IS NULL",
    ),
    Check(
        "finished_with_open_call",
        "a succeeded run has no call left planned, dispatched or unknown",
        """SELECT r.run_id, c.idempotency_key, c.status FROM runledger.runs r
           JOIN runledger.run_calls c USING (run_id)
           WHERE r.status = 'succeeded' AND c.status NOT IN ('succeeded', 'failed')""",
    ),
    Check(
        "event_token_went_back",
        "the fencing tokens a run's events carry never decrease",
        """SELECT run_id, event_id, fencing_token, previous FROM (
             SELECT run_id, event_id, fencing_token,
                    max(fencing_token) OVER (PARTITION BY run_id ORDER BY event_id
                        ROWS BETWEEN UNBOUNDED PRECEDING AND 1 PRECEDING) AS previous
             FROM runledger.run_events WHERE fencing_token IS NOT NULL) e
           WHERE fencing_token < previous""",
    ),
    # Not a broken invariant of the rows here, but what they cannot show: commits of the
    # old timeline after last_replay_at may be lost, and with them any dispatch, result or
    # event this audit would have checked (docs/failover.md). A failover that could lose
    # no acknowledged commit (lossless: the evidence says how the commits were
    # acknowledged) leaves nothing unseen and is not listed; `runledger doctor` lists both.
    Check(
        "failover",
        "the database never changed timeline in a way that may have lost commits (each row "
        "is a promotion or a restore without evidence that every acknowledged commit "
        "survived; its runs were recovered as possibly sent)",
        """SELECT t.position, t.previous_timeline, t.timeline, t.seen_at, t.seen_by,
                  t.last_replay_at, t.last_event_id, t.max_token, t.affected_runs,
                  t.lossless, t.evidence,
                  ARRAY(SELECT f.run_id FROM runledger.failover_runs f
                        WHERE f.position = t.position ORDER BY f.run_id LIMIT 100) AS runs
           FROM runledger.timelines t WHERE t.position > 1 AND t.lossless IS NOT TRUE
           ORDER BY t.position""",
    ),
)


# Revision 0016: the hash chains of run_events and their checkpoints (docs/audit.md). The
# hashes are recomputed here from the documented formula with built-in functions only
# (pg_catalog, schema-qualified), never with runledger._event_hash: a superuser who could
# rewrite the events could as well replace that function with one that agrees.
EVENT_HASH: LiteralString = """pg_catalog.sha256(
    coalesce(x.previous, ''::bytea) OPERATOR(pg_catalog.||) pg_catalog.convert_to(
        pg_catalog.jsonb_build_array(x.event_id, x.run_id,
        (EXTRACT(epoch FROM x.at) OPERATOR(pg_catalog.*) 1000000)::bigint, x.kind, x.actor,
        x.fencing_token, x.state_version, x.detail)::text, 'UTF8'))"""

CHAIN_CHECKS: tuple[Check, ...] = (
    Check(
        "event_chain_broken",
        "each event's hash links it to the run's event before it: none was changed, "
        "inserted or deleted in the middle of a run (the first broken link of each run)",
        """SELECT DISTINCT ON (x.run_id) x.run_id, x.event_id, x.kind,
                  CASE WHEN x.hash IS NULL THEN 'the event has no hash'
                       ELSE 'the hash does not match this event and the one before it: '
                            'this event, or the one before it, was changed, inserted or '
                            'deleted' END AS problem
           FROM (SELECT e.*, lag(e.hash) OVER (PARTITION BY e.run_id ORDER BY e.event_id)
                             AS previous
                 FROM runledger.run_events e) x
           WHERE (x.hash IS NOT NULL OR x.event_id > (
                      SELECT k.through_event_id FROM runledger.event_checkpoints k
                      WHERE k.checkpoint_id = 0))
             AND x.hash IS DISTINCT FROM """
        + EVENT_HASH
        + """
           ORDER BY x.run_id, x.event_id""",
    ),
    Check(
        "checkpoint_head_changed",
        "every run head a checkpoint recorded is still there with its hash (a deleted tail, "
        "a deleted run or a rehashed chain breaks it; runs pruned with their events are "
        "recorded in event_chain_prunes and pass)",
        """SELECT h.checkpoint_id, h.run_id, h.event_id,
                  CASE WHEN e.event_id IS NULL THEN 'the event is gone'
                       WHEN e.run_id <> h.run_id THEN 'the event id belongs to another run'
                       ELSE 'the event''s hash is not the one checkpointed' END AS problem
           FROM runledger.event_checkpoint_heads h
           LEFT JOIN runledger.run_events e ON e.event_id = h.event_id
           WHERE (e.event_id IS NULL OR e.run_id <> h.run_id OR e.hash IS DISTINCT FROM h.hash)
             AND NOT (e.event_id IS NULL AND EXISTS (
                 SELECT 1 FROM runledger.event_chain_prunes p
                 WHERE p.run_id = h.run_id AND p.last_event_id >= h.event_id))
           ORDER BY h.checkpoint_id, h.run_id""",
    ),
    # A gap after checkpoint 0 is no break when runledger.prune_records made it: its newest
    # record in event_checkpoint_prunes says every checkpoint from 1 through the one before
    # the gap's end was pruned, and holds the digest of that last one, which the first
    # checkpoint kept must chain over.
    Check(
        "checkpoint_chain_broken",
        "the checkpoints are numbered without a gap from 0 (but the oldest ones that "
        "retention pruned, recorded in event_checkpoint_prunes) and each digest chains over "
        "the previous one and its own heads (none removed, changed or forged)",
        """SELECT z.checkpoint_id, z.problem FROM (
             SELECT k.checkpoint_id,
                    CASE WHEN k.checkpoint_id = coalesce(k.prior_id OPERATOR(pg_catalog.+) 1, 0)
                              AND k.previous_digest IS DISTINCT FROM k.prior_digest
                         THEN 'its previous digest is not the digest of the checkpoint before it'
                         WHEN k.checkpoint_id <> coalesce(k.prior_id OPERATOR(pg_catalog.+) 1, 0)
                              AND (k.prior_id IS DISTINCT FROM 0
                                   OR k.pruned_through IS DISTINCT FROM
                                      k.checkpoint_id OPERATOR(pg_catalog.-) 1)
                         THEN 'the checkpoints before it are missing'
                         WHEN k.checkpoint_id <> coalesce(k.prior_id OPERATOR(pg_catalog.+) 1, 0)
                              AND k.previous_digest IS DISTINCT FROM k.pruned_digest
                         THEN 'its previous digest is not the digest of the last checkpoint '
                              'pruned before it (event_checkpoint_prunes)'
                         WHEN k.digest IS DISTINCT FROM pg_catalog.sha256(
                                  coalesce(k.previous_digest, ''::bytea) OPERATOR(pg_catalog.||)
                                  pg_catalog.convert_to(k.checkpoint_id::text || ' '
                                      || k.through_event_id::text || E'\n'
                                      || coalesce(k.heads, ''), 'UTF8'))
                         THEN 'its digest does not match its heads'
                         WHEN k.runs <> k.n THEN 'its number of runs does not match its heads'
                    END AS problem
             FROM (SELECT c.*,
                          lag(c.checkpoint_id) OVER (ORDER BY c.checkpoint_id) AS prior_id,
                          lag(c.digest) OVER (ORDER BY c.checkpoint_id) AS prior_digest,
                          (SELECT pg_catalog.string_agg(h.run_id || ' ' || h.event_id::text
                                      || ' ' || pg_catalog.encode(h.hash, 'hex'), E'\n'
                                      ORDER BY h.run_id COLLATE "C")
                           FROM runledger.event_checkpoint_heads h
                           WHERE h.checkpoint_id = c.checkpoint_id) AS heads,
                          (SELECT count(*) FROM runledger.event_checkpoint_heads h
                           WHERE h.checkpoint_id = c.checkpoint_id) AS n,
                          p.through_checkpoint_id AS pruned_through, p.digest AS pruned_digest
                   FROM runledger.event_checkpoints c
                   LEFT JOIN (SELECT x.through_checkpoint_id, x.digest
                              FROM runledger.event_checkpoint_prunes x
                              ORDER BY x.through_checkpoint_id DESC LIMIT 1) p ON true) k) z
           WHERE z.problem IS NOT NULL
           ORDER BY z.checkpoint_id""",
    ),
)
CHECKS = CHECKS + CHAIN_CHECKS

LATEST_CHECKPOINT: LiteralString = """
    SELECT k.checkpoint_id, k.at, k.through_event_id, k.runs,
           pg_catalog.encode(k.digest, 'hex') AS digest
    FROM runledger.event_checkpoints k ORDER BY k.checkpoint_id DESC LIMIT 1"""


@contextmanager
def audit_connection(database_url: str) -> Iterator[psycopg.Connection[Row]]:
    """An autocommit connection in a read-only session, except on a transaction pooler's
    session (it would stay read-only for the pooler's next client there: a worker)."""
    with psycopg.connect(database_url, autocommit=True, row_factory=dict_row) as conn:
        read_only_session(conn, database_url, connection_settings().pooler)
        yield conn


def violations(conn: psycopg.Connection[Row], check: Check, limit: int) -> list[Row]:
    """Up to ``limit`` rows that break ``check``."""
    return conn.execute(check.sql).fetchmany(limit)


def latest_checkpoint(conn: psycopg.Connection[Row]) -> Row | None:
    """The newest checkpoint of the event chains, its digest in hex (None: none yet)."""
    return conn.execute(LATEST_CHECKPOINT).fetchone()


def lossless_failovers(conn: psycopg.Connection[Row]) -> list[Row]:
    """The failovers recorded lossless, with their evidence: not violations (every
    acknowledged commit is here to be checked), but the audit names them."""
    return conn.execute(
        "SELECT t.position, t.previous_timeline, t.timeline, t.seen_at, t.seen_by,"
        " t.affected_runs, t.evidence FROM runledger.timelines t"
        " WHERE t.position > 1 AND t.lossless ORDER BY t.position"
    ).fetchall()


def checkpoints_pruned(conn: psycopg.Connection[Row]) -> Row | None:
    """The newest record of the checkpoints retention deleted (every one from 1 through
    ``through_checkpoint_id``); None when none was."""
    return conn.execute(
        "SELECT p.through_checkpoint_id, p.through_at, p.pruned_at, p.pruned_by"
        " FROM runledger.event_checkpoint_prunes p"
        " ORDER BY p.through_checkpoint_id DESC LIMIT 1"
    ).fetchone()


def checkpoint_digest(conn: psycopg.Connection[Row], checkpoint_id: int) -> str | None:
    """The digest (hex) of checkpoint ``checkpoint_id``; None when it is gone."""
    row = conn.execute(
        "SELECT pg_catalog.encode(k.digest, 'hex') AS digest"
        " FROM runledger.event_checkpoints k WHERE k.checkpoint_id = %s",
        (checkpoint_id,),
    ).fetchone()
    return None if row is None else str(row["digest"])
