-- runledger: the living SQL contract, the current schema by concern.
--
-- These files are the schema as it is now, and the source of every revision in
-- migrations/versions/ (CONTRIBUTING.md). A fresh install runs the files in name order
-- (runledger.db.schema.install); tests/migrations/test_catalog.py proves that it and
-- `alembic upgrade head` give the same catalog. Change a function here AND in the open
-- revision of the release, never in a released one.
--
--   00_clock.sql     schema runledger; settings (one row: payload cap, test clock offset,
--                    JSON depth limit); runledger.now(), the only clock
--   01_tables.sql    runs, run_turns, run_calls, run_events, workers, prune_authorizations,
--                    timelines, failover_runs, commit_guarantees (failover); event_checkpoints,
--                    event_checkpoint_heads, event_chain_prunes, event_checkpoint_prunes
--                    (the event chains); their indexes
--   02_helpers.sql   internal helpers, granted to no one: _raise; _cap (every cap on a text
--                    or array argument); checks (_check_run_id, _check_text,
--                    _check_worker_id, _check_lease, _check_flow, _check_json_depth,
--                    _check_json_*, _check_word, _parse_flows); _event (an event row),
--                    _events and _event_rows (the events of one write in one INSERT),
--                    _refuse_event_isolation, _event_hash and _checkpoint_digest (the
--                    event chains); _notify_queued; locks (_lock_run, _lock_leased_run,
--                    _lock_leased_run_at, _lock_call); _dispatch, _dispatch_each;
--                    timelines (_timeline, _token_floor, _synchronous,
--                    _note_commit_guarantee)
--   03_leases.sql    submit_run, submit_run_v2, _note_timeline (failover detection), _claim
--                    (the body of the claim), _gone_sessions (session locks),
--                    claim_runs_v4, renew_leases, release_lease (3 and 5 arguments),
--                    release_stale_lease;
--                    worker registry: _register_worker, register_worker_v2,
--                    heartbeat_listener, heartbeat_worker, report_stale_write; senders of
--                    calls in flight: _sender_until, call_sender, release_call; the
--                    timeline the schema is installed on
--   04_journal.sql   checkpoint, record_turn_v4, finish_and_claim, dispatch_call,
--                    complete_call, complete_call_v2, complete_calls, finish_run
--   05_operator.sql  resolve_call; approve_call, deny_call (human approval); cancel_run,
--                    retry_run, prune_runs, prune_records (retention); their helpers
--                    _requeue_if_settled and _lock_awaiting_call; checkpoint_events and
--                    checkpoint 0
--   06_wall.sql      the second wall: guard trigger functions, their triggers and the
--                    functions their WHEN clauses call (_tw_*), and
--                    the pruning authorization (_prune_authorized) that prune_runs grants itself
--   07_views.sql     audit views: run_timeline, effect_ledger, lease_history
--   08_roles.sql     REVOKE from PUBLIC; roles runledger_worker, _operator, _auditor and
--                    their grants
--
-- Every event kind is written as a literal in a runledger._event(...) call, so
-- `grep -rn "'run_paused'" service/runledger/db/sql` finds where it is written.

CREATE SCHEMA IF NOT EXISTS runledger;

-- ---------------------------------------------------------------------------------
-- Settings and the clock
-- ---------------------------------------------------------------------------------

-- One row. clock_offset exists for tests only: it shifts runledger.now() for every
-- session of this database. Workers cannot write it (no table writes), so a stale
-- worker cannot move the clock to keep its lease alive. max_json_depth: how deep every
-- JSON argument may nest (runledger._check_json_depth says how depth is counted).
CREATE TABLE runledger.settings (
    singleton boolean PRIMARY KEY DEFAULT true,
    max_payload_bytes integer NOT NULL DEFAULT 1048576,
    clock_offset interval NOT NULL DEFAULT interval '0',
    max_json_depth integer NOT NULL DEFAULT 64,
    CONSTRAINT ck_settings_singleton CHECK (singleton),
    CONSTRAINT ck_settings_max_payload_bytes CHECK (max_payload_bytes BETWEEN 1024 AND 268435456),
    CONSTRAINT ck_settings_max_json_depth CHECK (max_json_depth BETWEEN 1 AND 1000)
);
INSERT INTO runledger.settings DEFAULT VALUES;

-- The clock: clock_timestamp() plus the test offset, read when it is called. VOLATILE:
-- its query takes a new snapshot on each call under READ COMMITTED, so a lease check made
-- after a row lock sees an offset committed while it waited. PL/pgSQL without SET
-- search_path: a SQL function with a subquery (or a SET) is not inlined, so every call
-- site would parse and plan its body again in every transaction; PL/pgSQL plans its
-- query once per session. Every name is
-- schema-qualified: it runs as its caller (not SECURITY DEFINER), with the caller's path.
CREATE FUNCTION runledger.now() RETURNS timestamptz
LANGUAGE plpgsql VOLATILE
AS $$
DECLARE
    v_offset interval;
BEGIN
    SELECT s.clock_offset INTO v_offset FROM runledger.settings s;
    RETURN pg_catalog.clock_timestamp() OPERATOR(pg_catalog.+) coalesce(v_offset, interval '0');
END
$$;
