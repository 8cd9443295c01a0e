-- Revision 0.1, the baseline of runledger 0.1: the whole schema, as the living files in
-- service/runledger/db/sql/ had it at the release (tests/migrations/make_baseline.py
-- wrote it from them). An empty database gets it from `runledger migrate`; a database
-- at revision 0032 is brought to it by 0_1_baseline.from_0032.sql (migrations/env.py).

-- file: 00_clock.sql
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
--                    timelines and failover_runs (failover); event_checkpoints,
--                    event_checkpoint_heads, event_chain_prunes (the event chains);
--                    their indexes
--   02_helpers.sql   internal helpers, granted to no one: _raise; _cap (every cap on a text
--                    or array argument); checks (_check_run_id, _check_text,
--                    _check_worker_id, _check_lease, _check_flow, _check_json_depth,
--                    _check_json_*, _check_word, _parse_flows); _event (an event row),
--                    _events and _event_rows (the events of one write in one INSERT),
--                    _refuse_event_isolation, _event_hash and _checkpoint_digest (the
--                    event chains); _notify_queued; locks (_lock_run, _lock_leased_run,
--                    _lock_leased_run_at, _lock_call); _dispatch, _dispatch_each;
--                    timelines (_timeline, _token_floor)
--   03_leases.sql    submit_run, submit_run_v2, _note_timeline (failover detection), _claim
--                    (the body of the claim), _gone_sessions (session locks),
--                    claim_runs_v4, renew_leases, release_lease (3 and 5 arguments);
--                    worker registry: _register_worker, register_worker_v2,
--                    heartbeat_listener, heartbeat_worker, report_stale_write; senders of
--                    calls in flight: _sender_until, call_sender, release_call; the
--                    timeline the schema is installed on
--   04_journal.sql   checkpoint, record_turn_v4, finish_and_claim, dispatch_call,
--                    complete_call, complete_call_v2, complete_calls, finish_run
--   05_operator.sql  resolve_call; approve_call, deny_call (human approval); cancel_run,
--                    retry_run, prune_runs (retention); their helpers _requeue_if_settled
--                    and _lock_awaiting_call; checkpoint_events and checkpoint 0
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

-- file: 01_tables.sql
-- ---------------------------------------------------------------------------------
-- Tables
-- ---------------------------------------------------------------------------------

-- The CHECK constraints of runs, run_turns, run_calls and run_events each call a PL/pgSQL
-- function of the columns they read, whose body is the constraint's expression (a
-- violation is SQLSTATE 23514 naming the constraint). PostgreSQL 15 deserializes,
-- simplifies and compiles the expression of every CHECK of a table again at each INSERT
-- or UPDATE statement, whichever columns it sets: as inline expressions they cost about a
-- tenth of the backend's CPU per tool call. A function
-- call is a small node to read, and PL/pgSQL compiles its body once per session; what is
-- left per row is the call. IMMUTABLE: they read nothing but their arguments. Granted to
-- no one (the writers are the contract functions, run as the owner, and the owner).

CREATE FUNCTION runledger._ck_runs_run_id(run_id text)
RETURNS boolean LANGUAGE plpgsql IMMUTABLE PARALLEL SAFE
AS $$ BEGIN
    RETURN run_id OPERATOR(pg_catalog.~) '^[A-Za-z0-9][A-Za-z0-9._:@-]{0,127}$';
END $$;

CREATE FUNCTION runledger._ck_runs_status(status text)
RETURNS boolean LANGUAGE plpgsql IMMUTABLE PARALLEL SAFE
AS $$ BEGIN
    RETURN status OPERATOR(pg_catalog.=) ANY (ARRAY['queued', 'running', 'paused', 'succeeded', 'failed',
           'cancelled']);
END $$;

CREATE FUNCTION runledger._ck_runs_input_object(input jsonb)
RETURNS boolean LANGUAGE plpgsql IMMUTABLE PARALLEL SAFE
AS $$ BEGIN
    RETURN pg_catalog.jsonb_typeof(input) OPERATOR(pg_catalog.=) 'object';
END $$;

CREATE FUNCTION runledger._ck_runs_state_object(state jsonb)
RETURNS boolean LANGUAGE plpgsql IMMUTABLE PARALLEL SAFE
AS $$ BEGIN
    RETURN state IS NULL OR pg_catalog.jsonb_typeof(state) OPERATOR(pg_catalog.=) 'object';
END $$;

CREATE FUNCTION runledger._ck_runs_lease_complete(lease_id uuid, lease_expires_at timestamptz)
RETURNS boolean LANGUAGE plpgsql IMMUTABLE PARALLEL SAFE
AS $$ BEGIN
    RETURN (lease_id IS NULL) OPERATOR(pg_catalog.=) (lease_expires_at IS NULL);
END $$;

CREATE FUNCTION runledger._ck_runs_running_has_lease(status text, lease_id uuid)
RETURNS boolean LANGUAGE plpgsql IMMUTABLE PARALLEL SAFE
AS $$ BEGIN
    RETURN (status OPERATOR(pg_catalog.=) 'running') OPERATOR(pg_catalog.=) (lease_id IS NOT NULL);
END $$;

CREATE FUNCTION runledger._ck_runs_finished_at(status text, finished_at timestamptz)
RETURNS boolean LANGUAGE plpgsql IMMUTABLE PARALLEL SAFE
AS $$ BEGIN
    RETURN (status OPERATOR(pg_catalog.=) ANY (ARRAY['succeeded', 'failed', 'cancelled']))
           OPERATOR(pg_catalog.=) (finished_at IS NOT NULL);
END $$;

CREATE FUNCTION runledger._ck_runs_traceparent(traceparent text)
RETURNS boolean LANGUAGE plpgsql IMMUTABLE PARALLEL SAFE
AS $$ BEGIN
    RETURN traceparent OPERATOR(pg_catalog.~) '^00-[0-9a-f]{32}-[0-9a-f]{16}-[0-9a-f]{2}$';
END $$;

CREATE FUNCTION runledger._ck_run_turns_turn(turn integer)
RETURNS boolean LANGUAGE plpgsql IMMUTABLE PARALLEL SAFE
AS $$ BEGIN
    RETURN turn OPERATOR(pg_catalog.>=) 0;
END $$;

CREATE FUNCTION runledger._ck_run_turns_calls_array(calls jsonb)
RETURNS boolean LANGUAGE plpgsql IMMUTABLE PARALLEL SAFE
AS $$ BEGIN
    RETURN pg_catalog.jsonb_typeof(calls) OPERATOR(pg_catalog.=) 'array';
END $$;

CREATE FUNCTION runledger._ck_run_turns_record_object(record jsonb)
RETURNS boolean LANGUAGE plpgsql IMMUTABLE PARALLEL SAFE
AS $$ BEGIN
    RETURN record IS NULL OR pg_catalog.jsonb_typeof(record) OPERATOR(pg_catalog.=) 'object';
END $$;

CREATE FUNCTION runledger._ck_run_turns_output_final(output jsonb, calls jsonb)
RETURNS boolean LANGUAGE plpgsql IMMUTABLE PARALLEL SAFE
AS $$ BEGIN
    RETURN output IS NULL OR calls OPERATOR(pg_catalog.=) '[]'::pg_catalog.jsonb;
END $$;

CREATE FUNCTION runledger._ck_run_calls_status(status text)
RETURNS boolean LANGUAGE plpgsql IMMUTABLE PARALLEL SAFE
AS $$ BEGIN
    RETURN status OPERATOR(pg_catalog.=) ANY (ARRAY['planned', 'dispatched', 'succeeded', 'failed',
           'unknown']);
END $$;

CREATE FUNCTION runledger._ck_run_calls_args_object(args jsonb)
RETURNS boolean LANGUAGE plpgsql IMMUTABLE PARALLEL SAFE
AS $$ BEGIN
    RETURN pg_catalog.jsonb_typeof(args) OPERATOR(pg_catalog.=) 'object';
END $$;

CREATE FUNCTION runledger._ck_run_calls_attempts(attempts integer)
RETURNS boolean LANGUAGE plpgsql IMMUTABLE PARALLEL SAFE
AS $$ BEGIN
    RETURN attempts OPERATOR(pg_catalog.>=) 0;
END $$;

CREATE FUNCTION runledger._ck_run_calls_key(idempotency_key text, run_id text, turn integer,
                                            call_id text)
RETURNS boolean LANGUAGE plpgsql IMMUTABLE PARALLEL SAFE
AS $$ BEGIN
    RETURN idempotency_key OPERATOR(pg_catalog.=) (run_id OPERATOR(pg_catalog.||) ':'
           OPERATOR(pg_catalog.||) turn::pg_catalog.text OPERATOR(pg_catalog.||) ':'
           OPERATOR(pg_catalog.||) call_id);
END $$;

CREATE FUNCTION runledger._ck_run_calls_approval(approval text)
RETURNS boolean LANGUAGE plpgsql IMMUTABLE PARALLEL SAFE
AS $$ BEGIN
    RETURN approval OPERATOR(pg_catalog.=) ANY (ARRAY['pending', 'approved', 'denied']);
END $$;

CREATE FUNCTION runledger._ck_run_calls_approval_status(approval text, status text)
RETURNS boolean LANGUAGE plpgsql IMMUTABLE PARALLEL SAFE
AS $$ BEGIN
    RETURN CASE WHEN approval OPERATOR(pg_catalog.=) 'pending' THEN status OPERATOR(pg_catalog.=) 'planned'
           WHEN approval OPERATOR(pg_catalog.=) 'denied' THEN status OPERATOR(pg_catalog.=) 'failed'
           ELSE true END;
END $$;

CREATE FUNCTION runledger._ck_run_calls_approval_decided(approval text, approval_by text,
                                                         approval_at timestamptz,
                                                         approval_note text)
RETURNS boolean LANGUAGE plpgsql IMMUTABLE PARALLEL SAFE
AS $$ BEGIN
    RETURN CASE WHEN approval OPERATOR(pg_catalog.=) ANY (ARRAY['approved', 'denied'])
           THEN approval_by IS NOT NULL AND approval_at IS NOT NULL
           ELSE approval_by IS NULL AND approval_at IS NULL AND approval_note IS NULL END;
END $$;

CREATE FUNCTION runledger._ck_run_events_hash(hash bytea)
RETURNS boolean LANGUAGE plpgsql IMMUTABLE PARALLEL SAFE
AS $$ BEGIN
    RETURN hash IS NULL OR pg_catalog.octet_length(hash) OPERATOR(pg_catalog.=) 32;
END $$;

CREATE TABLE runledger.runs (
    run_id text NOT NULL,
    flow text NOT NULL,
    flow_version text NOT NULL,
    status text NOT NULL DEFAULT 'queued',
    input jsonb NOT NULL,
    state jsonb,
    state_version bigint NOT NULL DEFAULT 0,
    fencing_token bigint NOT NULL DEFAULT 0,
    lease_id uuid,
    lease_owner text,
    lease_expires_at timestamptz,
    claims integer NOT NULL DEFAULT 0,
    stalled_claims integer NOT NULL DEFAULT 0,
    priority integer NOT NULL DEFAULT 0,
    available_at timestamptz NOT NULL,
    pause_reason text,
    result jsonb,
    error jsonb,
    created_at timestamptz NOT NULL,
    updated_at timestamptz NOT NULL,
    finished_at timestamptz,
    -- the session lock of the holder's listener (the claim stamps the
    -- claimer's workers.session_lock; NULL: none, the lease is taken over on expiry only).
    -- Meaningful while the run is running.
    lease_lock bigint,
    -- the submitter's W3C trace context (submit_run_v2), which every
    -- worker that drives the run continues; NULL: submitted without one
    traceparent text,
    CONSTRAINT pk_runs PRIMARY KEY (run_id),
    CONSTRAINT ck_runs_run_id CHECK (runledger._ck_runs_run_id(run_id)),
    CONSTRAINT ck_runs_status CHECK (runledger._ck_runs_status(status)),
    CONSTRAINT ck_runs_input_object CHECK (runledger._ck_runs_input_object(input)),
    CONSTRAINT ck_runs_state_object CHECK (runledger._ck_runs_state_object(state)),
    CONSTRAINT ck_runs_lease_complete CHECK (
        runledger._ck_runs_lease_complete(lease_id, lease_expires_at)),
    CONSTRAINT ck_runs_running_has_lease CHECK (
        runledger._ck_runs_running_has_lease(status, lease_id)),
    CONSTRAINT ck_runs_finished_at CHECK (runledger._ck_runs_finished_at(status, finished_at)),
    CONSTRAINT ck_runs_traceparent CHECK (runledger._ck_runs_traceparent(traceparent))
)
-- room in each page for the updated row versions: most writes of a run
-- leave its indexed columns alone and then stay heap-only (HOT) updates
WITH (fillfactor = 80);
-- the claim's order: highest priority first, then oldest
CREATE INDEX ix_runs_claimable ON runledger.runs (flow, flow_version, priority DESC, created_at)
    WHERE status IN ('queued', 'running');
CREATE INDEX ix_runs_status ON runledger.runs (status);
CREATE INDEX ix_runs_lease_expiry ON runledger.runs (lease_expires_at) WHERE status = 'running';
-- `runledger list`, newest first (created_at never changes: the row's
-- other updates stay heap-only)
CREATE INDEX ix_runs_created_at ON runledger.runs (created_at, run_id);
-- retention in batches, the oldest finished runs first (prune_runs_v2);
-- finished_at is set once, with the change of status that rewrites the indexes anyway
CREATE INDEX ix_runs_finished_at ON runledger.runs (finished_at) WHERE finished_at IS NOT NULL;
-- the distinct holder sessions of running runs (runledger._gone_sessions)
CREATE INDEX ix_runs_lease_lock ON runledger.runs (lease_lock)
    WHERE status = 'running' AND lease_lock IS NOT NULL;

CREATE TABLE runledger.run_turns (
    run_id text NOT NULL,
    turn integer NOT NULL,
    calls jsonb NOT NULL,
    fencing_token bigint NOT NULL,
    created_at timestamptz NOT NULL,
    -- the provider-native assistant message, verbatim, and the final decision's output
    -- (the run's result); NULL when the worker recorded none
    record jsonb,
    output jsonb,
    CONSTRAINT pk_run_turns PRIMARY KEY (run_id, turn),
    CONSTRAINT fk_run_turns_run_id_runs FOREIGN KEY (run_id)
        REFERENCES runledger.runs (run_id) ON DELETE CASCADE,
    CONSTRAINT ck_run_turns_turn CHECK (runledger._ck_run_turns_turn(turn)),
    CONSTRAINT ck_run_turns_calls_array CHECK (runledger._ck_run_turns_calls_array(calls)),
    CONSTRAINT ck_run_turns_record_object CHECK (runledger._ck_run_turns_record_object(record)),
    CONSTRAINT ck_run_turns_output_final CHECK (
        runledger._ck_run_turns_output_final(output, calls))
);

CREATE TABLE runledger.run_calls (
    run_id text NOT NULL,
    turn integer NOT NULL,
    call_id text NOT NULL,
    position integer NOT NULL,
    tool text NOT NULL,
    args jsonb NOT NULL,
    idempotency_key text NOT NULL,
    status text NOT NULL DEFAULT 'planned',
    attempts integer NOT NULL DEFAULT 0,
    result jsonb,
    receipt jsonb,
    error jsonb,
    dispatched_token bigint,
    completed_token bigint,
    dispatched_by text,
    completed_by text,
    dispatched_at timestamptz,
    completed_at timestamptz,
    resolved_by text,
    resolved_at timestamptz,
    resolution_note text,
    -- the model's own id for the call (record_turn_v4), to map its result
    -- back into the provider's messages; never part of the idempotency key
    provider_id text,
    -- human approval. NULL: the call needs none; 'pending': recorded with
    -- "approval": true, not dispatched until a person approves it (approve_call) or denies
    -- it (deny_call: the call fails, never sent); who decided, when, and their note
    approval text,
    approval_by text,
    approval_note text,
    approval_at timestamptz,
    CONSTRAINT pk_run_calls PRIMARY KEY (run_id, turn, call_id),
    CONSTRAINT uq_run_calls_idempotency_key UNIQUE (idempotency_key),
    CONSTRAINT fk_run_calls_turn_run_turns FOREIGN KEY (run_id, turn)
        REFERENCES runledger.run_turns (run_id, turn) ON DELETE CASCADE,
    CONSTRAINT ck_run_calls_status CHECK (runledger._ck_run_calls_status(status)),
    CONSTRAINT ck_run_calls_args_object CHECK (runledger._ck_run_calls_args_object(args)),
    CONSTRAINT ck_run_calls_attempts CHECK (runledger._ck_run_calls_attempts(attempts)),
    CONSTRAINT ck_run_calls_key CHECK (
        runledger._ck_run_calls_key(idempotency_key, run_id, turn, call_id)),
    CONSTRAINT ck_run_calls_approval CHECK (runledger._ck_run_calls_approval(approval)),
    CONSTRAINT ck_run_calls_approval_status CHECK (
        runledger._ck_run_calls_approval_status(approval, status)),
    CONSTRAINT ck_run_calls_approval_decided CHECK (
        runledger._ck_run_calls_approval_decided(approval, approval_by, approval_at, approval_note))
)
-- each call is updated two or three times, growing (its result): room for it
WITH (fillfactor = 80);
-- No index on status (nor a partial index of open calls): a call's status changes
-- two or three times, and an index on it, or a predicate naming it, makes every change a
-- new index entry in each index instead of a heap-only (HOT) update. A run's open calls
-- are found through the primary key (run_id first); the open calls of all runs through
-- runs (a run with one is running or paused).

CREATE TABLE runledger.run_events (
    event_id bigserial NOT NULL,
    run_id text NOT NULL,
    at timestamptz NOT NULL,
    kind text NOT NULL,
    actor text,
    fencing_token bigint,
    state_version bigint,
    detail jsonb NOT NULL DEFAULT '{}'::jsonb,
    -- the link of the run's hash chain (runledger._event_hash over the run's previous
    -- event's hash and this event's columns). NULL only for the events written before the
    -- chain began (event_id <= checkpoint 0's through_event_id). See docs/audit.md.
    hash bytea,
    CONSTRAINT pk_run_events PRIMARY KEY (event_id),
    CONSTRAINT ck_run_events_hash CHECK (runledger._ck_run_events_hash(hash))
);
-- No foreign key: events outlive their run when prune_runs(..., keep_events => true).
CREATE INDEX ix_run_events_run_id ON runledger.run_events (run_id, event_id);

-- Checkpoints of the event chains. A checkpoint is made with no event
-- write in flight (runledger.checkpoint_events): every event up to through_event_id had
-- committed, and each run with an event after the previous checkpoint's through_event_id
-- has its head (its last event then) in event_checkpoint_heads. digest chains the
-- checkpoints: runledger._checkpoint_digest over the previous digest, this checkpoint's
-- id and through_event_id, and its heads. Checkpoint 0 is written by the schema itself:
-- the events up to its through_event_id were written before the chain began and carry
-- no hash.
-- Append-only (06_wall.sql); an auditor who keeps a digest outside the database can tell
-- a rewritten history from the true one (runledger audit --expect).
CREATE TABLE runledger.event_checkpoints (
    checkpoint_id bigint NOT NULL,
    at timestamptz NOT NULL,
    actor text,
    through_event_id bigint NOT NULL,
    runs integer NOT NULL,
    previous_digest bytea,
    digest bytea NOT NULL,
    CONSTRAINT pk_event_checkpoints PRIMARY KEY (checkpoint_id),
    CONSTRAINT ck_event_checkpoints_first CHECK ((checkpoint_id = 0) = (previous_digest IS NULL))
);
CREATE TABLE runledger.event_checkpoint_heads (
    checkpoint_id bigint NOT NULL,
    run_id text NOT NULL,
    event_id bigint NOT NULL,
    hash bytea NOT NULL,
    CONSTRAINT pk_event_checkpoint_heads PRIMARY KEY (checkpoint_id, run_id),
    CONSTRAINT fk_event_checkpoint_heads_checkpoint_id_event_checkpoints FOREIGN KEY (checkpoint_id)
        REFERENCES runledger.event_checkpoints (checkpoint_id)
);
-- The chains prune_runs deleted (with keep events false), one row per run:
-- its last event and that event's hash. A checkpoint head of such a run is not missing
-- but pruned. Written only by prune_runs (the pruning authorization); append-only.
CREATE TABLE runledger.event_chain_prunes (
    run_id text NOT NULL,
    last_event_id bigint NOT NULL,
    last_hash bytea,
    events integer NOT NULL,
    pruned_at timestamptz NOT NULL,
    pruned_by text,  -- the database login (NULL: not recorded)
    CONSTRAINT pk_event_chain_prunes PRIMARY KEY (run_id, last_event_id)
);

CREATE TABLE runledger.workers (
    worker_id text NOT NULL,
    hostname text NOT NULL,
    pid integer NOT NULL,
    flows text[] NOT NULL,
    started_at timestamptz NOT NULL,
    heartbeat_at timestamptz NOT NULL,
    stopped_at timestamptz,
    -- the database session that registered: register_worker_v2 refuses the id to
    -- another session while this one is alive (NULL: registered without a session of its
    -- own, and then silent_after rules; or registered without either)
    session_pid integer,
    session_started_at timestamptz,
    -- the key of the session-level advisory lock the registering session
    -- holds (register_worker_v2), minted for that session; NULL: none
    session_lock bigint,
    -- the worker's process as its host names it, for a peer on the same
    -- host to tell whether that process is gone (runledger.worker.liveness); NULL: unknown
    -- (registered without it), and then its death is never certain
    process text,
    -- a random id its process minted when it started, which the same
    -- process presents when it registers again (its listener reconnected) and with each
    -- heartbeat; NULL: registered without it
    incarnation uuid,
    -- how long it may go without a heartbeat before it counts as gone (its
    -- lease: three missed heartbeats). A worker registered without a session of its own
    -- (through a pooler: session_pid NULL) holds its id until it stops or is silent
    -- that long; NULL: not given
    silent_after interval,
    CONSTRAINT pk_workers PRIMARY KEY (worker_id)
);

-- The pruning authorization (see 06_wall.sql): runledger.prune_runs writes the id of its
-- own transaction here, deletes, and removes the row before it returns; the delete guards
-- let a DELETE through only while a row for the current transaction exists. No role is
-- granted anything on it, so a session setting or a caller cannot forge one.
CREATE TABLE runledger.prune_authorizations (
    txid bigint NOT NULL,
    CONSTRAINT pk_prune_authorizations PRIMARY KEY (txid)
);

-- Failover: the timelines this database was seen on, in the order the schema saw them
-- (position 1: where it was installed). A row is
-- added by the first claim that finds the server on another timeline than the last row
-- says: a promotion (or a restore) that may have lost commits. It records what survived
-- (the last event, the greatest token, the last commit replayed before the promotion) and
-- how many unfinished runs were affected. See docs/failover.md.
CREATE TABLE runledger.timelines (
    position integer NOT NULL,
    timeline integer NOT NULL,
    previous_timeline integer,
    seen_at timestamptz NOT NULL,
    seen_by text,
    last_replay_at timestamptz,
    last_event_id bigint,
    max_token bigint,
    affected_runs integer NOT NULL DEFAULT 0,
    CONSTRAINT pk_timelines PRIMARY KEY (position),
    CONSTRAINT ck_timelines_timeline CHECK (timeline >= 1)
);

-- Each run that was unfinished when a failover was detected, as it was
-- then. Calls of `turn` and later turns that were never dispatched on this timeline may
-- still have been sent on the lost one: the worker recovers them by safety class before
-- it sends them (docs/failover.md). marked_calls: planned calls that the detection marked
-- dispatched (their dispatch may be lost).
CREATE TABLE runledger.failover_runs (
    run_id text NOT NULL,
    position integer NOT NULL,
    status text NOT NULL,
    lease_owner text,
    fencing_token bigint NOT NULL,
    turn integer NOT NULL,
    marked_calls text[] NOT NULL,
    CONSTRAINT pk_failover_runs PRIMARY KEY (run_id, position),
    CONSTRAINT fk_failover_runs_run_id_runs FOREIGN KEY (run_id)
        REFERENCES runledger.runs (run_id) ON DELETE CASCADE,
    CONSTRAINT fk_failover_runs_position_timelines FOREIGN KEY (position)
        REFERENCES runledger.timelines (position)
);

-- file: 02_helpers.sql
-- ---------------------------------------------------------------------------------
-- Helpers (not granted to anyone: only the SECURITY DEFINER functions call them)
-- ---------------------------------------------------------------------------------
-- No helper has SET search_path (nor has runledger.now()). A SET costs on
-- every call (the path is set and restored, and its cached lookups recomputed) and it
-- keeps a SQL function from being inlined. It is safe to leave out here because:
--   * a function without SET runs with its caller's search_path;
--   * the helpers are granted to no one (not even PUBLIC), so only the owner's code calls
--     them: the SECURITY DEFINER contract functions and the SECURITY DEFINER trigger
--     functions of 06_wall.sql, every one of which pins pg_catalog, runledger, pg_temp
--     (tests/migrations/test_function_contract.py checks both);
--   * under that path pg_catalog comes first and pg_temp last, so a built-in function,
--     operator or type named without a schema is the built-in one, and no temporary
--     object can stand in for a table; our own tables and functions are written
--     schema-qualified all the same.
-- A helper must never become SECURITY DEFINER nor be granted without getting the SET back.

-- Every refusal leaves the database through here: a custom SQLSTATE (class RL, see
-- runledger.errors), a message, and DETAIL and HINT for the person reading it.
CREATE FUNCTION runledger._raise(p_code text, p_message text, p_detail text, p_hint text)
RETURNS void LANGUAGE plpgsql
AS $$
BEGIN
    RAISE EXCEPTION USING ERRCODE = p_code, MESSAGE = p_message,
        DETAIL = coalesce(p_detail, ''), HINT = coalesce(p_hint, '');
END
$$;

-- -- checks: one helper per rule, each raising RL006 ------------------------------------

CREATE FUNCTION runledger._check_run_id(p_run_id text) RETURNS void
LANGUAGE plpgsql IMMUTABLE
AS $$
BEGIN
    IF p_run_id IS NULL OR p_run_id !~ '^[A-Za-z0-9][A-Za-z0-9._:@-]{0,127}$' THEN
        PERFORM runledger._raise('RL006',
            format('invalid run id %s', coalesce(quote_literal(left(p_run_id, 200)), 'NULL')),
            'a run id is 1-128 characters of [A-Za-z0-9._:@-], starting with a letter or digit',
            NULL);
    END IF;
END
$$;

-- Caps on text arguments (characters) and on array arguments (elements): the one place
-- they are written down, listed in docs/design.md ("Caps and limits"). IMMUTABLE: a call
-- with a literal name is folded into a constant when the calling statement is planned.
CREATE FUNCTION runledger._cap(p_name text) RETURNS integer
LANGUAGE sql IMMUTABLE
AS $$
    SELECT CASE p_name
        WHEN 'worker_id' THEN 200
        WHEN 'hostname' THEN 255
        WHEN 'actor' THEN 200
        WHEN 'release_reason' THEN 200
        WHEN 'reason' THEN 1000
        WHEN 'note' THEN 4000
        WHEN 'operation' THEN 100
        WHEN 'message' THEN 4000
        WHEN 'idempotency_key' THEN 300
        WHEN 'flows' THEN 1000
        WHEN 'run_ids' THEN 10000
        WHEN 'provider_id' THEN 200
    END
$$;

-- A text argument of p_min (0: NULL allowed; 1: NULL and '' refused) to p_max characters.
-- Refused, never cut: a stored value is the value sent.
CREATE FUNCTION runledger._check_text(p_what text, p_value text, p_min integer, p_max integer)
RETURNS void
LANGUAGE plpgsql IMMUTABLE
AS $$
DECLARE
    v_length integer := length(p_value);
BEGIN
    IF (p_value IS NULL AND p_min > 0) OR v_length < p_min OR v_length > p_max THEN
        PERFORM runledger._raise('RL006',
            format('%s must be %s-%s characters, got %s', p_what, p_min, p_max,
                   coalesce(v_length::text, 'NULL')),
            format('%s starts %s', p_what, coalesce(quote_literal(left(p_value, 60)), 'NULL')),
            'the caps of text arguments are listed in docs/design.md (Caps and limits)');
    END IF;
END
$$;

CREATE FUNCTION runledger._check_worker_id(p_worker_id text) RETURNS void
LANGUAGE plpgsql IMMUTABLE
AS $$
BEGIN
    PERFORM runledger._check_text('worker id', p_worker_id, 1, runledger._cap('worker_id'));
END
$$;

-- A lease is judged by the database clock; a day is far longer than any sane lease.
CREATE FUNCTION runledger._check_lease(p_lease interval) RETURNS void
LANGUAGE plpgsql STABLE
AS $$
BEGIN
    IF p_lease IS NULL OR p_lease <= interval '0' OR p_lease > interval '1 day' THEN
        PERFORM runledger._raise('RL006', format('lease %s must be positive and at most a day',
            coalesce(p_lease::text, 'NULL')), NULL, NULL);
    END IF;
END
$$;

-- A flow name and version, as submit_run takes them. A flow reference 'name@version'
-- (claim_runs_v4, register_worker_v2) is checked by _parse_flows below.
CREATE FUNCTION runledger._check_flow(p_flow text, p_flow_version text) RETURNS void
LANGUAGE plpgsql IMMUTABLE
AS $$
BEGIN
    IF p_flow IS NULL OR p_flow !~ '^[A-Za-z0-9][A-Za-z0-9._-]{0,127}$' THEN
        PERFORM runledger._raise('RL006', format('invalid flow name %s',
            coalesce(quote_literal(left(p_flow, 200)), 'NULL')),
            'a flow name is 1-128 characters of [A-Za-z0-9._-]', NULL);
    END IF;
    IF p_flow_version IS NULL OR p_flow_version !~ '^[A-Za-z0-9][A-Za-z0-9._+-]{0,63}$' THEN
        PERFORM runledger._raise('RL006', format('invalid flow version %s',
            coalesce(quote_literal(left(p_flow_version, 100)), 'NULL')),
            'a flow version is 1-64 characters of [A-Za-z0-9._+-]', NULL);
    END IF;
END
$$;

-- Nesting depth, counted so: a scalar is depth 0; an object or array is one more than its
-- deepest member, so {} and {"a": 1} are depth 1, [[]] and {"a": [1]} depth 2. A value
-- deeper than p_max has an object or array at level p_max (the root is level 0): jsonpath
-- (C) looks for one and does not walk below that level.
CREATE FUNCTION runledger._check_json_depth(p_what text, p_value jsonb, p_max integer)
RETURNS void
LANGUAGE plpgsql IMMUTABLE
AS $$
BEGIN
    IF jsonb_path_exists(p_value, format(
           'strict $.**{%s} ? (@.type() == "object" || @.type() == "array")', p_max)::jsonpath)
    THEN
        PERFORM runledger._raise('RL006',
            format('%s nests deeper than %s levels', p_what, p_max),
            'a scalar is depth 0 and each enclosing object or array adds one: {"a": [1]} is depth 2',
            'the limit is runledger.settings.max_json_depth');
    END IF;
END
$$;

-- JSON arguments: four named checks instead of two bare booleans. Each one refuses what
-- its name excludes (null, a non-object), then a payload over settings.max_payload_bytes,
-- then one nested deeper than settings.max_json_depth. p_wrap: levels of the contract's
-- own structure around the values a caller nests (record_turn_v4's array and call objects
-- around each call's args: 2), allowed on top of the limit.
CREATE FUNCTION runledger._check_json_value_or_null(p_what text, p_value jsonb,
                                                    p_wrap integer DEFAULT 0) RETURNS void
LANGUAGE plpgsql STABLE
AS $$
DECLARE
    v_cap integer;
    v_depth integer;
    v_size integer;
    v_text text;
    v_open integer;
BEGIN
    IF p_value IS NULL THEN
        RETURN;
    END IF;
    v_text := p_value::text;
    v_size := octet_length(v_text);
    v_open := v_size - octet_length(translate(v_text, '{[', ''));
    -- A value that no setting allowed by the settings' CHECKs can refuse
    -- (under 1024 bytes, the least max_payload_bytes; at most 1 + p_wrap opening brackets,
    -- the least depth: max_json_depth >= 1) needs no read of the settings.
    IF v_size < 1024 AND v_open <= 1 + p_wrap THEN
        RETURN;
    END IF;
    SELECT s.max_payload_bytes, s.max_json_depth INTO v_cap, v_depth FROM runledger.settings s;
    IF v_size > coalesce(v_cap, 1048576) THEN
        PERFORM runledger._raise('RL006',
            format('%s is %s bytes, over the cap of %s bytes', p_what, v_size, v_cap),
            NULL, 'the cap is runledger.settings.max_payload_bytes');
    END IF;
    v_depth := coalesce(v_depth, 64) + p_wrap;
    -- A value deeper than v_depth has a container at level v_depth inside v_depth others:
    -- at least 2 * (v_depth + 1) characters of brackets. A shorter text cannot be too deep,
    -- so the walk is skipped; the result is the same. Nor can a text with
    -- at most v_depth opening brackets ('{' and '[', in strings too: one
    -- for each object and array and maybe more), which the walk would cost far more to
    -- find.
    IF v_size >= 2 * (v_depth + 1) AND v_open > v_depth THEN
        PERFORM runledger._check_json_depth(p_what, p_value, v_depth);
    END IF;
END
$$;

CREATE FUNCTION runledger._check_json_value(p_what text, p_value jsonb,
                                            p_wrap integer DEFAULT 0) RETURNS void
LANGUAGE plpgsql STABLE
AS $$
BEGIN
    IF p_value IS NULL THEN
        PERFORM runledger._raise('RL006', format('%s must not be null', p_what), NULL, NULL);
    END IF;
    PERFORM runledger._check_json_value_or_null(p_what, p_value, p_wrap);
END
$$;

CREATE FUNCTION runledger._check_json_object_or_null(p_what text, p_value jsonb) RETURNS void
LANGUAGE plpgsql STABLE
AS $$
BEGIN
    IF p_value IS NULL THEN
        RETURN;
    END IF;
    IF jsonb_typeof(p_value) <> 'object' THEN
        PERFORM runledger._raise('RL006',
            format('%s must be a JSON object, got %s', p_what, jsonb_typeof(p_value)), NULL, NULL);
    END IF;
    PERFORM runledger._check_json_value_or_null(p_what, p_value);
END
$$;

CREATE FUNCTION runledger._check_json_object(p_what text, p_value jsonb) RETURNS void
LANGUAGE plpgsql STABLE
AS $$
BEGIN
    IF p_value IS NULL THEN
        PERFORM runledger._raise('RL006', format('%s must not be null', p_what), NULL, NULL);
    END IF;
    PERFORM runledger._check_json_object_or_null(p_what, p_value);
END
$$;

CREATE FUNCTION runledger._check_word(p_what text, p_value text, p_allowed text[]) RETURNS void
LANGUAGE plpgsql IMMUTABLE
AS $$
BEGIN
    IF p_value IS NULL OR NOT (p_value = ANY (p_allowed)) THEN
        PERFORM runledger._raise('RL006',
            format('unknown %s %s', p_what, coalesce(quote_literal(left(p_value, 100)), 'NULL')),
            format('expected one of: %s', array_to_string(p_allowed, ', ')), NULL);
    END IF;
END
$$;

CREATE FUNCTION runledger._parse_flows(p_flows text[], OUT names text[], OUT versions text[])
LANGUAGE plpgsql IMMUTABLE
AS $$
DECLARE
    f text;
BEGIN
    names := '{}';
    versions := '{}';
    IF p_flows IS NULL THEN
        PERFORM runledger._raise('RL006', 'flows must not be null', NULL, NULL);
    END IF;
    IF cardinality(p_flows) > runledger._cap('flows') THEN
        PERFORM runledger._raise('RL006',
            format('flows has %s elements, over the cap of %s', cardinality(p_flows),
                   runledger._cap('flows')), NULL, NULL);
    END IF;
    FOREACH f IN ARRAY p_flows LOOP
        IF f IS NULL OR f !~ '^[A-Za-z0-9][A-Za-z0-9._-]{0,127}@[A-Za-z0-9][A-Za-z0-9._+-]{0,63}$' THEN
            PERFORM runledger._raise('RL006',
                format('invalid flow reference %s', coalesce(quote_literal(left(f, 200)), 'NULL')),
                'a flow reference is name@version', NULL);
        END IF;
        names := names || split_part(f, '@', 1);
        versions := versions || split_part(f, '@', 2);
    END LOOP;
END
$$;

-- -- writes every function shares -----------------------------------------------------

-- The link of an event in its run's hash chain. sha256 over the previous
-- event's hash (none for a run's first event, or the first after the chain began) and the
-- event's columns as one JSON array: [event_id, run_id, at in microseconds since the
-- epoch, kind, actor, fencing_token, state_version, detail]. jsonb's text form is
-- canonical (keys sorted, one spelling of each number) and the time is an integer, so the
-- input depends on no session setting. Inlined where it is used (plain SQL, STABLE).
CREATE FUNCTION runledger._event_hash(p_previous bytea, p_event_id bigint, p_run_id text,
                                      p_at timestamptz, p_kind text, p_actor text,
                                      p_fencing_token bigint, p_state_version bigint,
                                      p_detail jsonb) RETURNS bytea
LANGUAGE sql STABLE
AS $$
    SELECT pg_catalog.sha256(
        coalesce(p_previous, ''::bytea) OPERATOR(pg_catalog.||) pg_catalog.convert_to(
            pg_catalog.jsonb_build_array(p_event_id, p_run_id,
                (EXTRACT(epoch FROM p_at) OPERATOR(pg_catalog.*) 1000000)::bigint,
                p_kind, p_actor, p_fencing_token, p_state_version, p_detail)::text, 'UTF8'))
$$;

-- A checkpoint's digest, chained over the previous one. heads: the
-- checkpoint's heads as 'run_id event_id hash-hex' lines in run_id order, joined by
-- newlines (see runledger.checkpoint_events).
CREATE FUNCTION runledger._checkpoint_digest(p_previous bytea, p_checkpoint_id bigint,
                                             p_through_event_id bigint, p_heads text)
RETURNS bytea
LANGUAGE sql IMMUTABLE
AS $$
    SELECT pg_catalog.sha256(
        coalesce(p_previous, ''::bytea) OPERATOR(pg_catalog.||) pg_catalog.convert_to(
            p_checkpoint_id::text || ' ' || p_through_event_id::text || E'\n'
            || coalesce(p_heads, ''), 'UTF8'))
$$;

-- The refusal of an event written to a run's chain outside READ COMMITTED
-- (see _event), for _event and _events alike; called only to refuse.
CREATE FUNCTION runledger._refuse_event_isolation(p_run_id text) RETURNS void
LANGUAGE plpgsql
AS $$
BEGIN
    PERFORM runledger._raise('RL006',
        format('events of run %s are written in READ COMMITTED transactions only, not %s',
               p_run_id, upper(pg_catalog.current_setting('transaction_isolation'))),
        'a transaction with one snapshot does not see the events committed since it'
        || ' began, and the run''s hash chain would fork',
        'call the contract functions in autocommit or in a READ COMMITTED transaction,'
        || ' with default_transaction_isolation read committed');
END
$$;

-- One of the two INSERTs into run_events (the other is _events: the events of one write
-- together). Callers pass the event kind as a literal, so a grep for it finds
-- the writer. p_at: the function's one reading of the clock when the event belongs to a
-- set-based statement (claims, renewals); otherwise the clock now.
-- PL/pgSQL: a SQL function that is not inlined (an INSERT never is)
-- parses and plans its body at every call site in every transaction; PL/pgSQL plans the
-- INSERT once per session.
-- An event that changes what an operator sees of a run (not the per-call
-- and per-turn ones) is also sent on NOTIFY channel runledger_events, payload
-- '<event_id> <run_id> <kind>', at commit (a rolled-back event sends nothing). Nor
-- 'claimed': a commit that notifies wakes every listening session of the database (each
-- worker's listener reads the queue in a transaction of its own), and a claim's commit
-- notifies nothing else; a run's end, a pause or an operator's act is what is sent.
-- 'submitted' costs no wake-up: its commit wakes the claimers (runledger_runs) anyway.
-- The event carries its link in the run's hash chain.
-- One run's events are appended one at a time under the run's row lock,
-- which every writer of them holds before it calls this function (FOR NO KEY UPDATE or
-- stronger, taken in an earlier statement; or the run row inserted by its own
-- transaction: submit_run's first event): the leased writes (_lock_leased_run_at), the
-- claims and the failover marking (their locking statements), the operator functions
-- (_lock_run), renew_leases and report_stale_write, as every writer of a run's calls
-- does. The lock was taken in an earlier statement, so under READ COMMITTED the
-- SELECT below takes a snapshot newer than it and reads the run's true last event; no
-- lock of the last event row is needed (it would be a heap lock and a WAL record per
-- event on top of the run's, for the same order). The event id is drawn inside the INSERT,
-- after its table lock: runledger.checkpoint_events, which takes the table in SHARE mode,
-- never misses an id drawn before it and inserted after it. A row lock takes no slot in
-- the lock table, so a failover that marks a million runs writes their events in one
-- transaction.
CREATE FUNCTION runledger._event(p_run_id text, p_kind text, p_actor text,
                                 p_fencing_token bigint, p_state_version bigint,
                                 p_detail jsonb, p_at timestamptz DEFAULT NULL) RETURNS void
LANGUAGE plpgsql
AS $$
DECLARE
    v_id bigint;
    v_at timestamptz := coalesce(p_at, runledger.now());
    v_detail jsonb := coalesce(p_detail, '{}'::jsonb);
    v_previous bytea;
BEGIN
    SELECT e.hash INTO v_previous FROM runledger.run_events e
    WHERE e.run_id = p_run_id ORDER BY e.event_id DESC LIMIT 1;
    -- The SELECT above needs a snapshot newer than the run's lock, which
    -- only READ COMMITTED (and READ UNCOMMITTED, the same in PostgreSQL) takes. Under
    -- REPEATABLE READ or SERIALIZABLE it reads the transaction's first snapshot: an event
    -- committed since is not seen, and the new one would chain to the same event as it (a
    -- fork). So a run's chain is extended only in READ COMMITTED; its first event (a
    -- submit inside the caller's own transaction) is written under any isolation.
    IF FOUND AND pg_catalog.current_setting('transaction_isolation')
                 IN ('repeatable read', 'serializable') THEN
        PERFORM runledger._refuse_event_isolation(p_run_id);
    END IF;
    INSERT INTO runledger.run_events (event_id, run_id, at, kind, actor, fencing_token,
                                      state_version, detail, hash)
    SELECT n.id, p_run_id, v_at, p_kind, p_actor, p_fencing_token, p_state_version,
           v_detail,
           runledger._event_hash(v_previous, n.id, p_run_id, v_at, p_kind, p_actor,
                                 p_fencing_token, p_state_version, v_detail)
    FROM (SELECT pg_catalog.nextval('runledger.run_events_event_id_seq'::regclass) AS id) n
    RETURNING event_id INTO v_id;
    IF p_kind NOT IN ('call_dispatched', 'call_succeeded', 'call_failed', 'call_not_applied',
                      'turn_recorded', 'checkpoint', 'claimed') THEN
        PERFORM pg_notify('runledger_events', v_id || ' ' || p_run_id || ' ' || p_kind);
    END IF;
END
$$;

-- The events of one write in one INSERT. _event appends one event per
-- statement: a SELECT of the run's last hash, then an INSERT with its own statement set-up
-- (the table's CHECK, its two indexes). The writes that append two or more events of a run
-- together (complete_call_v2 with the next call's dispatch, record_turn_v4: the checkpoint,
-- the decision, its dispatched calls, the run's end) read the last hash once and insert
-- every row in one statement, each row chained to the one before it, in the order given:
-- the same rows, ids in the same order, the same hashes as _event called once per kind.
-- p_kinds, p_state_versions and p_details are parallel arrays (a NULL detail is '{}').
-- The ids are drawn inside the INSERT, after its table lock, by _event_rows (a function the
-- INSERT runs to completion when it reads its first row: each row's id, then its link to
-- the one before), as _event draws its id: runledger.checkpoint_events never misses one.
-- The list of kinds not notified is _event's, word for word (tests/migrations/
-- test_living_files.py holds them equal); the isolation refusal is the same helper's.
-- The rules of _event hold: the run's row lock is held by the caller; the chain is
-- extended in READ COMMITTED only (a first event of a run under another level only alone,
-- as with _event: the second would find the first); the kinds an operator sees are sent
-- on runledger_events, in id order.
CREATE FUNCTION runledger._event_rows(p_previous bytea, p_run_id text, p_actor text,
                                      p_fencing_token bigint, p_at timestamptz,
                                      p_kinds text[], p_state_versions bigint[],
                                      p_details jsonb[], OUT event_id bigint, OUT kind text,
                                      OUT state_version bigint, OUT detail jsonb,
                                      OUT hash bytea)
RETURNS SETOF record
LANGUAGE plpgsql
AS $$
BEGIN
    hash := p_previous;
    FOR i IN 1 .. coalesce(cardinality(p_kinds), 0) LOOP
        event_id := pg_catalog.nextval('runledger.run_events_event_id_seq'::regclass);
        kind := p_kinds[i];
        state_version := p_state_versions[i];
        detail := coalesce(p_details[i], '{}'::jsonb);
        hash := runledger._event_hash(hash, event_id, p_run_id, p_at, kind, p_actor,
                                      p_fencing_token, state_version, detail);
        RETURN NEXT;
    END LOOP;
END
$$;

CREATE FUNCTION runledger._events(p_run_id text, p_actor text, p_fencing_token bigint,
                                  p_at timestamptz, p_kinds text[],
                                  p_state_versions bigint[], p_details jsonb[])
RETURNS void
LANGUAGE plpgsql
AS $$
DECLARE
    v_at timestamptz := coalesce(p_at, runledger.now());
    v_previous bytea;
    v_payloads text[];
BEGIN
    IF cardinality(p_state_versions) IS DISTINCT FROM cardinality(p_kinds)
       OR cardinality(p_details) IS DISTINCT FROM cardinality(p_kinds) THEN
        RAISE EXCEPTION 'runledger._events: % kinds, % state versions, % details',
            cardinality(p_kinds), cardinality(p_state_versions), cardinality(p_details)
            USING ERRCODE = 'XX000';
    END IF;
    SELECT e.hash INTO v_previous FROM runledger.run_events e
    WHERE e.run_id = p_run_id ORDER BY e.event_id DESC LIMIT 1;
    -- as _event, for each event after the first
    IF (FOUND OR cardinality(p_kinds) > 1)
       AND pg_catalog.current_setting('transaction_isolation')
           IN ('repeatable read', 'serializable') THEN
        PERFORM runledger._refuse_event_isolation(p_run_id);
    END IF;
    WITH ins AS (
        INSERT INTO runledger.run_events (event_id, run_id, at, kind, actor, fencing_token,
                                          state_version, detail, hash)
        SELECT r.event_id, p_run_id, v_at, r.kind, p_actor, p_fencing_token,
               r.state_version, r.detail, r.hash
        FROM runledger._event_rows(v_previous, p_run_id, p_actor, p_fencing_token, v_at,
                                   p_kinds, p_state_versions, p_details) AS r
        RETURNING run_events.event_id, run_events.kind)
    SELECT array_agg(ins.event_id || ' ' || p_run_id || ' ' || ins.kind ORDER BY ins.event_id)
           FILTER (WHERE ins.kind NOT IN ('call_dispatched', 'call_succeeded', 'call_failed',
                                          'call_not_applied', 'turn_recorded', 'checkpoint',
                                          'claimed'))
    INTO v_payloads FROM ins;
    FOR i IN 1 .. coalesce(cardinality(v_payloads), 0) LOOP
        PERFORM pg_notify('runledger_events', v_payloads[i]);
    END LOOP;
END
$$;

-- A run of this flow version became claimable: wake the claimers (LISTEN runledger_runs).
CREATE FUNCTION runledger._notify_queued(p_flow text, p_flow_version text) RETURNS void
LANGUAGE sql
AS $$
    SELECT pg_notify('runledger_runs', p_flow || '@' || p_flow_version);
$$;

-- -- locks: the run row first, then its calls -------------------------------------------

CREATE FUNCTION runledger._lock_run(p_run_id text) RETURNS runledger.runs
LANGUAGE plpgsql
AS $$
DECLARE
    r runledger.runs;
BEGIN
    -- The id is checked only when no row matched: every stored run_id
    -- passes the same rule (ck_runs_run_id), so a row found means a valid id, and an
    -- invalid one (NULL too) matches no row and waits on no lock. RL006 still comes before
    -- RL003, as before.
    SELECT * INTO r FROM runledger.runs x WHERE x.run_id = p_run_id FOR NO KEY UPDATE;
    IF NOT FOUND THEN
        PERFORM runledger._check_run_id(p_run_id);
        PERFORM runledger._raise('RL003', format('run %s not found', p_run_id), NULL, NULL);
    END IF;
    RETURN r;
END
$$;

-- The lease check and the clock reading it made after the lock, for the
-- callers that use the time as well: one reading per transaction instead of a second
-- runledger.now() right after it (the same semantics: the clock is read once the row lock
-- is held). _lock_leased_run is this function's run row.
CREATE FUNCTION runledger._lock_leased_run_at(p_run_id text, p_lease_id uuid,
                                              p_fencing_token bigint,
                                              OUT r runledger.runs, OUT at timestamptz)
LANGUAGE plpgsql
AS $$
BEGIN
    -- _lock_run, inline: one indexed SELECT ... FOR NO KEY UPDATE
    SELECT * INTO r FROM runledger.runs x WHERE x.run_id = p_run_id FOR NO KEY UPDATE;
    IF NOT FOUND THEN
        PERFORM runledger._check_run_id(p_run_id);
        PERFORM runledger._raise('RL003', format('run %s not found', p_run_id), NULL, NULL);
    END IF;
    -- The clock is read once the row lock is held: a write that waited on the lock past
    -- the lease's expiry is refused. runledger.now() is VOLATILE, so under READ COMMITTED
    -- its query takes a new snapshot and sees a clock_offset committed during the wait.
    at := runledger.now();
    IF r.status <> 'running' OR r.lease_id IS DISTINCT FROM p_lease_id
       OR r.fencing_token IS DISTINCT FROM p_fencing_token THEN
        PERFORM runledger._raise('RL001',
            format('lease lost on run %s: token %s is not the current lease', p_run_id,
                   coalesce(p_fencing_token::text, 'NULL')),
            format('run %s is %s; seen lease %s token %s; current lease %s token %s held by %s',
                   p_run_id, r.status, coalesce(p_lease_id::text, 'NULL'),
                   coalesce(p_fencing_token::text, 'NULL'), coalesce(r.lease_id::text, 'none'),
                   r.fencing_token, coalesce(r.lease_owner, 'nobody')),
            'another worker took the run over, or an operator finished it: drop it and do not retry');
    END IF;
    IF r.lease_expires_at <= at THEN
        PERFORM runledger._raise('RL001',
            format('lease expired on run %s: token %s', p_run_id, p_fencing_token),
            format('run %s is %s; seen lease %s token %s; current lease %s token %s held by %s '
                   'expired at %s, database clock is %s',
                   p_run_id, r.status, p_lease_id, p_fencing_token, r.lease_id, r.fencing_token,
                   coalesce(r.lease_owner, 'nobody'), r.lease_expires_at, at),
            'renew leases more often than the lease length; the run will be claimed again');
    END IF;
    -- A lease is good only on the timeline that granted it. After a
    -- promotion its token is at most the new timeline's floor (claims grant more), even
    -- before a claim has recorded the failover and ended the old leases.
    IF p_fencing_token <= runledger._token_floor() THEN
        PERFORM runledger._raise('RL001',
            format('lease lost on run %s: token %s was granted before a failover', p_run_id,
                   p_fencing_token),
            format('the server is on timeline %s; leases of this timeline have tokens over %s',
                   runledger._timeline(), runledger._token_floor()),
            'the database was promoted: drop the run, it will be claimed again');
    END IF;
END
$$;

-- Lock the run row, then check that (lease_id, fencing_token) is its current,
-- unexpired lease by the database clock read after the lock. Every worker write starts
-- here. The run row of _lock_leased_run_at (one body for both).
CREATE FUNCTION runledger._lock_leased_run(p_run_id text, p_lease_id uuid, p_fencing_token bigint)
RETURNS runledger.runs
LANGUAGE sql
AS $$
    SELECT (runledger._lock_leased_run_at(p_run_id, p_lease_id, p_fencing_token)).r
$$;

CREATE FUNCTION runledger._lock_call(p_run_id text, p_key text) RETURNS runledger.run_calls
LANGUAGE plpgsql
AS $$
DECLARE
    c runledger.run_calls;
BEGIN
    -- _check_text's rule, tested here first so that a valid key costs no call
    IF p_key IS NULL OR length(p_key) < 1 OR length(p_key) > runledger._cap('idempotency_key') THEN
        PERFORM runledger._check_text('idempotency key', p_key, 1,
                                      runledger._cap('idempotency_key'));
    END IF;
    SELECT * INTO c FROM runledger.run_calls x WHERE x.idempotency_key = p_key FOR UPDATE;
    IF NOT FOUND OR c.run_id <> p_run_id THEN
        PERFORM runledger._raise('RL003',
            format('call %s not found in run %s', p_key, p_run_id), NULL, NULL);
    END IF;
    RETURN c;
END
$$;

-- The dispatch of one call of a locked, leased run: dispatch_call,
-- complete_call_v2 (the next call) and record_turn_v4 (the first calls of a decision) call
-- it after their lease check, with the clock they read after the lock.
-- complete_call_v2 and record_turn_v4 write the same row themselves in their common case
-- (in the UPDATE of the completed call; in the INSERT of the decision's calls) and call
-- this function otherwise: a change here is a change there too. It refuses a call that
-- cannot be sent (final, unknown, awaiting approval), marks it dispatched under the token
-- and writes its call_dispatched event. Returns the attempt number.
-- One UPDATE ... RETURNING instead of SELECT ... FOR UPDATE and an UPDATE
-- of the same row (the lock was one more heap write and WAL record). The self-join reads
-- the status before the update (the event's previous_status): the row read is the row
-- updated, since every writer of a run's calls holds the run's row lock first (leased
-- writes, claims' failover marking, the operator functions via _lock_run), and the caller
-- holds it. Only when no row matched does the slow path lock and read the call, to refuse
-- it with the exact error (a key that is invalid or of another run matches none).
-- The run is compared with IS NOT DISTINCT FROM (run_id is NOT NULL: the same test) so
-- that it is a filter: the row is found by its key's unique index, as _lock_call finds
-- it, never by a scan of the run's calls through the primary key.
CREATE FUNCTION runledger._dispatch(p_run_id text, p_key text, p_owner text,
                                    p_fencing_token bigint, p_state_version bigint,
                                    p_now timestamptz) RETURNS integer
LANGUAGE plpgsql
AS $$
DECLARE
    c runledger.run_calls;
    v_tool text;
    v_attempt integer;
    v_previous text;
    v_sender bigint;
    v_until timestamptz;
BEGIN
    UPDATE runledger.run_calls x
    SET status = 'dispatched', attempts = x.attempts + 1, dispatched_token = p_fencing_token,
        dispatched_by = p_owner, dispatched_at = p_now
    FROM runledger.run_calls o
    WHERE x.idempotency_key = p_key AND o.idempotency_key = p_key
      AND x.run_id IS NOT DISTINCT FROM p_run_id
      AND x.status IN ('planned', 'dispatched') AND x.approval IS DISTINCT FROM 'pending'
    RETURNING x.tool, x.attempts, o.status, o.dispatched_token
    INTO v_tool, v_attempt, v_previous, v_sender;
    IF NOT FOUND THEN
        c := runledger._lock_call(p_run_id, p_key);
        IF c.status NOT IN ('planned', 'dispatched') THEN
            PERFORM runledger._raise('RL004',
                format('call %s is %s and cannot be dispatched', p_key, c.status),
                format('attempts %s, last token %s', c.attempts,
                       coalesce(c.completed_token, c.dispatched_token)),
                CASE c.status WHEN 'unknown'
                     THEN 'an operator must resolve it (runledger resolve)'
                     ELSE 'the call already has a final result: reuse it' END);
        END IF;
        IF c.approval = 'pending' THEN
            PERFORM runledger._raise('RL004',
                format('call %s awaits approval and cannot be dispatched', p_key),
                format('tool %s, recorded in turn %s', c.tool, c.turn),
                format('a person approves it (runledger approve %s) or denies it '
                       '(runledger deny %s --reason ...); pause the run until then',
                       p_key, p_key));
        END IF;
        -- not reached while every writer of the run's calls holds the run's lock (a call
        -- that passes the checks matched the UPDATE): the write, after the lock
        UPDATE runledger.run_calls
        SET status = 'dispatched', attempts = c.attempts + 1, dispatched_token = p_fencing_token,
            dispatched_by = p_owner, dispatched_at = p_now
        WHERE idempotency_key = p_key AND status IN ('planned', 'dispatched')
          AND approval IS DISTINCT FROM 'pending';
        v_tool := c.tool;
        v_attempt := c.attempts + 1;
        v_previous := c.status;
        v_sender := c.dispatched_token;
    END IF;
    -- A call an earlier holder sent, with no answer journaled, is sent
    -- again only once that sender can no longer be sending it (runledger._sender_until);
    -- the refusal undoes the UPDATE above.
    IF v_previous = 'dispatched' AND v_sender < p_fencing_token THEN
        v_until := runledger._sender_until(p_run_id, p_key, v_sender, v_attempt - 1, p_now);
        IF v_until IS NOT NULL THEN
            PERFORM runledger._raise('RL009',
                format('call %s may still be on its way from its earlier sender', p_key),
                format('attempt %s was sent under token %s, whose lease runs until %s; '
                       'the sender has not said that its send ended', v_attempt - 1, v_sender,
                       v_until),
                'wait until then, or until the sender releases it (runledger.release_call)');
        END IF;
    END IF;
    PERFORM runledger._event(p_run_id, 'call_dispatched', p_owner, p_fencing_token,
        p_state_version, jsonb_build_object('idempotency_key', p_key, 'tool', v_tool,
                                            'attempt', v_attempt,
                                            'previous_status', v_previous), p_now);
    RETURN v_attempt;
END
$$;

-- record_turn_v4's calls to dispatch (call ids of turn p_turn, checked by it), in order;
-- their attempt numbers. NULL or empty: none, and an empty array back.
CREATE FUNCTION runledger._dispatch_each(p_run runledger.runs, p_turn integer,
                                         p_call_ids text[], p_now timestamptz,
                                         p_state_version bigint) RETURNS integer[]
LANGUAGE plpgsql
AS $$
DECLARE
    v_id text;
    v_attempts integer[] := '{}';
BEGIN
    FOREACH v_id IN ARRAY coalesce(p_call_ids, '{}') LOOP
        v_attempts := v_attempts || runledger._dispatch(
            p_run.run_id, p_run.run_id || ':' || p_turn || ':' || v_id, p_run.lease_owner,
            p_run.fencing_token, p_state_version, p_now);
    END LOOP;
    RETURN v_attempts;
END
$$;

-- -- timelines ---------------------------------------------------------

-- The server's timeline: that of the WAL it writes now, from the name of the current WAL
-- file (a primary's new timeline shows there at once after a promotion, whereas
-- pg_control_checkpoint() names it only after the next checkpoint). Fails on a standby
-- (WAL control functions cannot run during recovery), as any write would. SQL, so that it
-- is inlined where it is called.
CREATE FUNCTION runledger._timeline() RETURNS integer
LANGUAGE sql VOLATILE
AS $$
    SELECT ('x' || substr(pg_walfile_name(pg_current_wal_lsn()), 1, 8))::bit(32)::integer
$$;

-- The fencing tokens of timeline N are over (N - 1) << 32, and a claim grants
-- greatest(token + 1, floor + 1): on timeline 1 tokens count 1, 2, ... as before, and
-- every token granted on a later timeline exceeds every token of an earlier one, those a
-- failover lost included (a run is claimed fewer than 2^32 times per timeline).
CREATE FUNCTION runledger._token_floor() RETURNS bigint
LANGUAGE sql VOLATILE
AS $$
    SELECT (runledger._timeline() - 1)::bigint << 32
$$;

-- file: 03_leases.sql
-- ---------------------------------------------------------------------------------
-- Leases: submit, claim, renew, release; the worker registry
-- ---------------------------------------------------------------------------------

-- submit_run_v2: submit_run, and the W3C trace context of the submitter
-- (p_traceparent, 'version-trace_id-parent_id-flags', version 00, lowercase hex; NULL:
-- none), stored on the run: every worker that drives the run continues that trace
-- (docs/operating.md, Tracing). A malformed one is refused (RL006) before anything is
-- written. A resubmission with another traceparent is still a no-op: the trace context
-- is not part of what identifies the run, and the first one stays.
CREATE FUNCTION runledger.submit_run_v2(p_run_id text, p_flow text, p_flow_version text,
                                        p_input jsonb, p_priority int DEFAULT 0,
                                        p_available_at timestamptz DEFAULT NULL,
                                        p_traceparent text DEFAULT NULL)
RETURNS TABLE (run_id text, created boolean)
LANGUAGE plpgsql SECURITY DEFINER
SET search_path = pg_catalog, runledger, pg_temp
AS $$
#variable_conflict use_column
DECLARE
    v_now timestamptz := runledger.now();
    v_existing runledger.runs;
    v_inserted text;
BEGIN
    PERFORM runledger._check_run_id(p_run_id);
    PERFORM runledger._check_flow(p_flow, p_flow_version);
    PERFORM runledger._check_json_object('input', p_input);
    IF p_priority IS NULL THEN
        PERFORM runledger._raise('RL006', 'priority must not be null', NULL, NULL);
    END IF;
    IF p_traceparent IS NOT NULL
       AND (p_traceparent !~ '^00-[0-9a-f]{32}-[0-9a-f]{16}-[0-9a-f]{2}$'
            OR substr(p_traceparent, 4, 32) = repeat('0', 32)
            OR substr(p_traceparent, 37, 16) = repeat('0', 16)) THEN
        PERFORM runledger._raise('RL006',
            format('invalid traceparent %s', quote_literal(left(p_traceparent, 100))),
            'a W3C traceparent: 00-<32 hex trace id>-<16 hex parent id>-<2 hex flags>, '
            'lowercase, neither id all zeros',
            'pass NULL when the submitter has no trace context');
    END IF;

    INSERT INTO runledger.runs AS r (run_id, flow, flow_version, status, input, priority,
                                     available_at, created_at, updated_at, traceparent)
    VALUES (p_run_id, p_flow, p_flow_version, 'queued', p_input, p_priority,
            coalesce(p_available_at, v_now), v_now, v_now, p_traceparent)
    ON CONFLICT ON CONSTRAINT pk_runs DO NOTHING
    RETURNING r.run_id INTO v_inserted;

    IF v_inserted IS NOT NULL THEN
        PERFORM runledger._event(p_run_id, 'submitted', NULL, NULL, 0,
            jsonb_build_object('flow', p_flow, 'flow_version', p_flow_version,
                               'priority', p_priority));
        PERFORM runledger._notify_queued(p_flow, p_flow_version);
        RETURN QUERY SELECT p_run_id, true;
        RETURN;
    END IF;

    SELECT * INTO v_existing FROM runledger.runs x WHERE x.run_id = p_run_id;
    IF v_existing.flow <> p_flow OR v_existing.flow_version <> p_flow_version
       OR v_existing.input <> p_input THEN
        PERFORM runledger._raise('RL005',
            format('run %s already exists with a different flow, version or input', p_run_id),
            format('existing run %s is %s@%s; submitted %s@%s%s', p_run_id, v_existing.flow,
                   v_existing.flow_version, p_flow, p_flow_version,
                   CASE WHEN v_existing.input <> p_input THEN ' with another input' ELSE '' END),
            'choose a new run id, or resubmit exactly the same flow, version and input');
    END IF;
    RETURN QUERY SELECT p_run_id, false;
END
$$;

-- submit_run: submit_run_v2 without a trace context (a wrapper of it).
CREATE FUNCTION runledger.submit_run(p_run_id text, p_flow text, p_flow_version text,
                                     p_input jsonb, p_priority int DEFAULT 0,
                                     p_available_at timestamptz DEFAULT NULL)
RETURNS TABLE (run_id text, created boolean)
LANGUAGE sql SECURITY DEFINER
SET search_path = pg_catalog, runledger, pg_temp
AS $$
    SELECT s.run_id, s.created
    FROM runledger.submit_run_v2(p_run_id, p_flow, p_flow_version, p_input, p_priority,
                                 p_available_at, NULL) s
$$;

-- Failover. The current timeline, recorded: when the server is on another
-- timeline than the last one runledger.timelines names (a promoted standby, or a restore),
-- the first claim to see it records the new timeline and, for every run that was not
-- finished, what may have been lost with the commits of the old one (docs/failover.md):
--   * a lease held then ends now (its holder may hold state that no longer exists here;
--     its writes are refused anyway: its token is under the new timeline's floor);
--   * a planned call (not awaiting approval) may have been dispatched and sent on the lost
--     timeline: it is marked dispatched, so that whoever claims the run next recovers it
--     by its safety class (lookup, same key, or unknown) instead of sending it as new;
--   * the run is listed in runledger.failover_runs with the turn from which its calls are
--     suspect, and gets a failover_detected event.
-- Claims on the old timeline's leases wait for this transaction (the run rows are locked).
-- An empty table (never seen) records the current timeline and nothing else.
CREATE FUNCTION runledger._note_timeline(p_actor text, p_now timestamptz) RETURNS void
LANGUAGE plpgsql
AS $$
DECLARE
    v_timeline integer := runledger._timeline();
    v_last runledger.timelines;
    v_position integer;
    v_runs text[] := '{}';
    v_run record;
BEGIN
    -- one detector at a time; the others find the row it wrote
    LOCK TABLE runledger.timelines IN SHARE ROW EXCLUSIVE MODE;
    SELECT * INTO v_last FROM runledger.timelines t ORDER BY t.position DESC LIMIT 1;
    IF FOUND AND v_last.timeline = v_timeline THEN
        RETURN;
    END IF;
    v_position := coalesce(v_last.position, 0) + 1;
    IF v_last.position IS NOT NULL THEN
        -- the unfinished runs, locked (in a fixed order) until the end of the claim
        SELECT coalesce(array_agg(u.run_id ORDER BY u.run_id), '{}') INTO v_runs
        FROM (SELECT r.run_id FROM runledger.runs r
              WHERE r.status IN ('queued', 'running', 'paused')
              ORDER BY r.run_id FOR NO KEY UPDATE) u;
    END IF;
    -- the table is append-only (the wall): the row is written whole, once
    INSERT INTO runledger.timelines (position, timeline, previous_timeline, seen_at, seen_by,
                                     last_replay_at, last_event_id, max_token, affected_runs)
    VALUES (v_position, v_timeline, v_last.timeline, p_now, p_actor,
            pg_last_xact_replay_timestamp(),
            (SELECT max(e.event_id) FROM runledger.run_events e),
            (SELECT max(r.fencing_token) FROM runledger.runs r), cardinality(v_runs));
    IF v_last.position IS NULL THEN
        RETURN;  -- the first timeline seen: nothing to compare with
    END IF;

    WITH affected AS (
        SELECT r.run_id, r.status, r.lease_owner, r.fencing_token,
               coalesce((SELECT max(t.turn) FROM runledger.run_turns t
                         WHERE t.run_id = r.run_id), 0) AS turn
        FROM runledger.runs r
        WHERE r.run_id = ANY (v_runs)
    ), marked AS (
        UPDATE runledger.run_calls c
        -- an attempt under the run's last surviving token: the dispatch that may be lost
        SET status = 'dispatched', attempts = c.attempts + 1, dispatched_token = a.fencing_token,
            dispatched_by = 'failover', dispatched_at = p_now
        FROM affected a
        WHERE c.run_id = a.run_id AND c.status = 'planned'
          AND c.approval IS DISTINCT FROM 'pending'
        RETURNING c.run_id, c.idempotency_key
    ), ended AS (
        -- Not taken over at once. The holder, cut off with the old primary,
        -- may still have a call in flight at a provider; it fences itself within its
        -- listener's budget (5 s), so the run waits 10 s before anyone claims it, and a
        -- lookup by the next holder then sees that call's effect. Its session lock is
        -- cleared: that session never existed here, and its key would look free at once.
        UPDATE runledger.runs r
        SET lease_expires_at = p_now + interval '10 seconds', lease_lock = NULL,
            updated_at = p_now
        FROM affected a
        WHERE r.run_id = a.run_id AND r.status = 'running'
        RETURNING r.run_id
    ), delayed AS (
        -- a queued run may have been claimed on the lost timeline: the same wait
        UPDATE runledger.runs r
        SET available_at = greatest(r.available_at, p_now + interval '10 seconds'),
            updated_at = p_now
        FROM affected a
        WHERE r.run_id = a.run_id AND r.status = 'queued'
        RETURNING r.run_id
    )
    INSERT INTO runledger.failover_runs (run_id, position, status, lease_owner, fencing_token,
                                         turn, marked_calls)
    SELECT a.run_id, v_position, a.status, a.lease_owner, a.fencing_token, a.turn,
           ARRAY(SELECT m.idempotency_key FROM marked m WHERE m.run_id = a.run_id
                 ORDER BY m.idempotency_key)
    FROM affected a
    -- the lease UPDATE runs with the statement even where nothing reads it
    LEFT JOIN (SELECT count(*) AS n FROM ended) e ON true;

    FOR v_run IN
        SELECT f.run_id, f.status, f.lease_owner, f.fencing_token, f.turn, f.marked_calls,
               r.state_version
        FROM runledger.failover_runs f JOIN runledger.runs r ON r.run_id = f.run_id
        WHERE f.position = v_position
    LOOP
        PERFORM runledger._event(v_run.run_id, 'failover_detected', p_actor, NULL,
            v_run.state_version,
            jsonb_build_object('timeline', v_timeline, 'previous_timeline', v_last.timeline,
                               'status', v_run.status, 'lease_owner', v_run.lease_owner,
                               'fencing_token', v_run.fencing_token,
                               'suspect_from_turn', v_run.turn,
                               'marked_dispatched', to_jsonb(v_run.marked_calls),
                               'last_replay_at', pg_last_xact_replay_timestamp()),
            p_now);
    END LOOP;
END
$$;

-- Session locks. A worker holds a session-level advisory lock on its
-- listener connection, under a random key minted for that session (workers.session_lock),
-- and each claim stamps the claimer's key on the run (runs.lease_lock). When the session
-- ends (the process died and the kernel closed its socket, or the server dropped the
-- session), the server frees the lock at once. The keys of running runs whose lock is
-- free: one index descent per distinct key (ix_runs_lease_lock), one try per key. The
-- try takes the free lock for the rest of the caller's transaction, so a key stays free
-- until the caller commits. Keys of live sessions are held: the try fails, nothing kept.
-- The calling session's own key is left out: its try would succeed (it holds the lock).
-- See docs/leases.md for why this is safe (the worker fences itself first).
CREATE FUNCTION runledger._gone_sessions()
RETURNS bigint[]
LANGUAGE plpgsql VOLATILE
AS $$
BEGIN
    -- PL/pgSQL, not SQL: its plan is cached for the session (a SQL function's is not)
    RETURN (
        WITH RECURSIVE k(key) AS (
            (SELECT r.lease_lock FROM runledger.runs r
             WHERE r.status = 'running' AND r.lease_lock IS NOT NULL
             ORDER BY r.lease_lock LIMIT 1)
            UNION ALL
            SELECT (SELECT r.lease_lock FROM runledger.runs r
                    WHERE r.status = 'running' AND r.lease_lock > k.key
                    ORDER BY r.lease_lock LIMIT 1)
            FROM k WHERE k.key IS NOT NULL
        ), keys AS (
            SELECT k.key FROM k WHERE k.key IS NOT NULL LIMIT 1024
        )
        SELECT coalesce(array_agg(keys.key), '{}') FROM keys
        -- not the calling session's own key (a session may take a lock it holds again)
        WHERE keys.key IS DISTINCT FROM
                  nullif(pg_catalog.current_setting('runledger.session_lock', true), '')::bigint
          AND pg_catalog.pg_try_advisory_xact_lock(keys.key));
END
$$;

-- The one body of the claim, which claim_runs_v4 and finish_and_claim select their
-- columns from (internal, granted to no one, like every helper). p_read: with each run the worker's per-run read (the journal unless
-- the run is stalled, failover_turn), in the claim statement itself; without it those
-- columns are NULL and nothing more is read.
CREATE FUNCTION runledger._claim(p_worker_id text, p_flows text[], p_lease interval,
                                  p_max_runs int, p_read boolean)
RETURNS TABLE (run_id text, flow text, flow_version text, input jsonb, state jsonb,
               state_version bigint, fencing_token bigint, lease_id uuid,
               lease_expires_at timestamptz, takeover boolean, stalled_claims integer,
               turns json, calls json, failover_turn integer, traceparent text)
LANGUAGE plpgsql
AS $$
#variable_conflict use_column
DECLARE
    v_now timestamptz := runledger.now();
    v_flows record;
    v_claim record;
    v_timeline integer;
    v_floor bigint;
    -- session locks: the claimer's listener-session lock, stamped on each
    -- run it claims; the locks of holder sessions that ended (their runs are taken over
    -- before their leases expire)
    v_lock bigint;
    v_gone bigint[] := '{}';
    -- the planner settings of the claim statement, restored after it
    v_plan_cache_mode text := pg_catalog.current_setting('plan_cache_mode');
    v_jit text := pg_catalog.current_setting('jit');
    v_seqscan text := pg_catalog.current_setting('enable_seqscan');
    v_bitmapscan text := pg_catalog.current_setting('enable_bitmapscan');
    v_set text;
BEGIN
    PERFORM runledger._check_worker_id(p_worker_id);
    PERFORM runledger._check_lease(p_lease);
    IF p_max_runs IS NULL OR p_max_runs < 0 OR p_max_runs > 10000 THEN
        PERFORM runledger._raise('RL006', 'max runs must be 0-10000', NULL, NULL);
    END IF;
    v_flows := runledger._parse_flows(p_flows);
    -- failover: the token floor of this timeline, once it is recorded
    v_timeline := runledger._timeline();
    v_floor := (v_timeline - 1)::bigint << 32;  -- runledger._token_floor()
    IF (SELECT t.timeline FROM runledger.timelines t ORDER BY t.position DESC LIMIT 1)
       IS DISTINCT FROM v_timeline THEN
        PERFORM runledger._note_timeline(p_worker_id, v_now);
    END IF;
    -- session locks
    SELECT w.session_lock INTO v_lock FROM runledger.workers w
    WHERE w.worker_id = p_worker_id AND w.stopped_at IS NULL;
    -- A claimer whose own listener session has ended claims nothing: its process died
    -- (or fenced itself) while this statement was on its way, and the server runs a
    -- statement to its end even when the client is gone. Its lock is free then; a live
    -- listener holds it, and the try fails. (A claim sent on the listener session itself
    -- would take its own lock again: that one is left alone.)
    IF v_lock IS NOT NULL AND p_max_runs > 0
       AND v_lock IS DISTINCT FROM
           nullif(pg_catalog.current_setting('runledger.session_lock', true), '')::bigint
       AND pg_catalog.pg_try_advisory_xact_lock(v_lock) THEN
        RETURN;
    END IF;
    IF p_max_runs > 0 THEN
        -- never the claimer's own key: its listener may end while this statement runs
        -- (the worker was killed after sending it), and its own runs are then no one's
        -- to take but the next worker's
        v_gone := array_remove(runledger._gone_sessions(), v_lock);
    END IF;
    -- end session locks

    -- Two index-ordered scans pick a few more ids than wanted (queued runs per pinned
    -- flow through ix_runs_claimable; expired leases through ix_runs_lease_expiry), so
    -- the cost does not grow with the backlog. The locking SELECT then re-states the
    -- whole condition and skips rows other claimers hold. The statement runs to completion
    -- (it modifies rows) before the loop below logs each claim.
    -- The statement is planned once per session, not at every call. With
    -- its parameters known (the clock, the limits, the gone sessions' keys) the planner's
    -- estimate of a custom plan always beats that of the generic one, so the plan cache
    -- planned it anew each time: ~0.9 ms of planning for ~0.3 ms of work. The generic
    -- plan has the same shape (index-ordered scans, rows fetched by key), so the cost stays
    -- flat with the backlog (bench/claim_scaling.py). Without JIT: not knowing the limits,
    -- the generic plan's estimate passes jit_above_cost from about a million queued runs
    -- on, and compiling it would cost ~70 ms a claim for well under a millisecond of work.
    -- Set for the transaction (the function's own SET clause is the search path alone, as
    -- every contract function's) and put back after the loop; an error undoes it anyway.
    -- And planned without sequential or bitmap scans. A generic plan is
    -- built from the statistics of the moment: a backlog submitted in one burst and
    -- claimed before autovacuum has analyzed runs got a plan that read the candidates
    -- through a bitmap of every claimable row, filtered by id (every queued run read at
    -- each claim, 33 ms at 20,000, until the next analyze). Without those two, the
    -- candidates are fetched by primary key and each scan above through its index,
    -- whatever the statistics say (tests/contract/test_claim_plan.py). For that, the
    -- candidates and the UPDATE state the claimable condition as a CASE on status, which
    -- the planner cannot match to the partial indexes' predicates: an OR of the same
    -- conditions let it read the candidates through a whole partial index (every queued
    -- run) when it took that index for small. Only the primary key is left to them.
    v_set := pg_catalog.set_config('plan_cache_mode', 'force_generic_plan', true);
    v_set := pg_catalog.set_config('jit', 'off', true);
    v_set := pg_catalog.set_config('enable_seqscan', 'off', true);
    v_set := pg_catalog.set_config('enable_bitmapscan', 'off', true);
    FOR v_claim IN
    WITH pinned AS (
        SELECT u.name, u.version FROM unnest(v_flows.names, v_flows.versions) AS u(name, version)
    ), queued AS (
        SELECT q.run_id FROM pinned p CROSS JOIN LATERAL (
            SELECT c.run_id FROM runledger.runs c
            WHERE c.flow = p.name AND c.flow_version = p.version
              AND c.status = 'queued' AND c.available_at <= v_now
            ORDER BY c.priority DESC, c.created_at
            LIMIT p_max_runs * 4 + 32
        ) q
    ), expired AS (
        -- The flow is compared through an expression (c.flow || ''), which
        -- no index has: this scan can only go through ix_runs_lease_expiry (and orphaned
        -- below through ix_runs_lease_lock). With the plain columns, a generic plan built
        -- without statistics (a burst claimed before autovacuum's analyze) went through
        -- ix_runs_claimable by flow and filtered every queued row of the flow for a
        -- running one: 100,000 rows read per claim at 100,000 queued, 1.1 s at a million.
        SELECT c.run_id FROM runledger.runs c
        JOIN pinned p ON p.name = (c.flow || '') AND p.version = (c.flow_version || '')
        WHERE c.status = 'running' AND c.lease_expires_at <= v_now
        ORDER BY c.lease_expires_at
        LIMIT p_max_runs * 4 + 32
    ), orphaned AS (  -- session locks: the holder's session ended
        SELECT c.run_id FROM runledger.runs c
        JOIN pinned p ON p.name = (c.flow || '') AND p.version = (c.flow_version || '')
        WHERE c.status = 'running' AND c.lease_lock = ANY (v_gone)
        LIMIT p_max_runs * 4 + 32
    ), candidates AS (
        SELECT c.run_id, c.status AS old_status, c.lease_owner AS old_owner,
               c.fencing_token AS old_token, c.lease_expires_at AS old_expires_at
        FROM runledger.runs c
        -- an array, so the rows are fetched by primary key, not by a scan of the table
        WHERE c.run_id = ANY (ARRAY(SELECT x.run_id FROM queued x
                                    UNION ALL SELECT y.run_id FROM expired y
                                    UNION ALL SELECT z.run_id FROM orphaned z))
          -- the claimable condition as a CASE: see above
          AND CASE c.status WHEN 'queued' THEN c.available_at <= v_now
                              WHEN 'running' THEN c.lease_expires_at <= v_now
                                                  OR c.lease_lock = ANY (v_gone)
                              ELSE false END
        ORDER BY c.priority DESC, c.created_at, c.run_id
        LIMIT p_max_runs
        FOR NO KEY UPDATE OF c SKIP LOCKED
    ), claimed AS (
        UPDATE runledger.runs r
        SET status = 'running',
            fencing_token = greatest(r.fencing_token + 1, v_floor + 1),  -- failover floor
            lease_id = gen_random_uuid(),
            lease_owner = p_worker_id,
            lease_expires_at = v_now + p_lease,
            claims = r.claims + 1,
            stalled_claims = r.stalled_claims + 1,
            updated_at = v_now,
            lease_lock = v_lock  -- session locks
        FROM candidates c
        WHERE r.run_id = c.run_id
          -- the claimable condition as a CASE: see above
          AND CASE r.status WHEN 'queued' THEN r.available_at <= v_now
                              WHEN 'running' THEN r.lease_expires_at <= v_now
                                                  OR r.lease_lock = ANY (v_gone)
                              ELSE false END
        RETURNING r.run_id, r.flow, r.flow_version, r.input, r.state, r.state_version,
                  r.fencing_token, r.lease_id, r.lease_expires_at,
                  (c.old_status = 'running') AS takeover, c.old_owner, c.old_token,
                  c.old_expires_at, r.stalled_claims, r.traceparent
    )
    -- the worker's per-run read (p_read): the claim writes no
    -- turn, call or failover row, so the statement's own snapshot has them as they are
    SELECT k.run_id, k.flow, k.flow_version, k.input, k.state, k.state_version,
           k.fencing_token, k.lease_id, k.lease_expires_at, k.takeover, k.old_owner, k.old_token,
           k.old_expires_at, k.stalled_claims, k.traceparent,
           CASE WHEN p_read AND k.stalled_claims <= 1 THEN (
               SELECT coalesce(json_agg(json_build_object('turn', t.turn, 'calls', t.calls,
                                                          'record', t.record,
                                                          'output', t.output)
                                        ORDER BY t.turn), '[]'::json)
               FROM runledger.run_turns t WHERE t.run_id = k.run_id) END AS turns,
           CASE WHEN p_read AND k.stalled_claims <= 1 THEN (
               SELECT coalesce(json_agg(c ORDER BY c.turn, c.position), '[]'::json)
               FROM runledger.run_calls c WHERE c.run_id = k.run_id) END AS calls,
           CASE WHEN p_read THEN (SELECT min(f.turn) FROM runledger.failover_runs f
                                  WHERE f.run_id = k.run_id) END AS failover_turn
    FROM claimed k
    LOOP
        IF v_claim.takeover THEN
            -- holder: why the run could be taken, 'expired' or
            -- 'session_ended' (the lease still ran, the holder's session had ended)
            PERFORM runledger._event(v_claim.run_id, 'takeover', p_worker_id,
                v_claim.fencing_token, v_claim.state_version,
                jsonb_build_object('lease_id', v_claim.lease_id,
                                   'lease_expires_at', v_claim.lease_expires_at,
                                   'previous_owner', v_claim.old_owner,
                                   'previous_token', v_claim.old_token,
                                   'holder', CASE WHEN v_claim.old_expires_at <= v_now
                                                  THEN 'expired' ELSE 'session_ended' END,
                                   'previous_lease_expires_at', v_claim.old_expires_at),
                v_now);
        ELSE
            PERFORM runledger._event(v_claim.run_id, 'claimed', p_worker_id,
                v_claim.fencing_token, v_claim.state_version,
                jsonb_build_object('lease_id', v_claim.lease_id,
                                   'lease_expires_at', v_claim.lease_expires_at),
                v_now);
        END IF;
        run_id := v_claim.run_id;
        flow := v_claim.flow;
        flow_version := v_claim.flow_version;
        input := v_claim.input;
        state := v_claim.state;
        state_version := v_claim.state_version;
        fencing_token := v_claim.fencing_token;
        lease_id := v_claim.lease_id;
        lease_expires_at := v_claim.lease_expires_at;
        takeover := v_claim.takeover;
        stalled_claims := v_claim.stalled_claims;
        turns := v_claim.turns;
        calls := v_claim.calls;
        failover_turn := v_claim.failover_turn;
        traceparent := v_claim.traceparent;
        RETURN NEXT;
    END LOOP;
    v_set := pg_catalog.set_config('plan_cache_mode', v_plan_cache_mode, true);
    v_set := pg_catalog.set_config('jit', v_jit, true);
    v_set := pg_catalog.set_config('enable_seqscan', v_seqscan, true);
    v_set := pg_catalog.set_config('enable_bitmapscan', v_bitmapscan, true);
END
$$;

-- claim_runs_v4: the claim. Up to p_max_runs runs of p_flows ('name@version') that are
-- queued and available, or running with an expired lease or a holder session that ended,
-- each leased to p_worker_id for p_lease under a new fencing token. With each claimed run
-- what the worker needs before its first step, so that it reads nothing else: the
-- stalled-claim count and the journal (turns with their record and output, calls with
-- every column); failover_turn, the earliest turn from which a failover
-- (runledger.failover_runs) makes its never-dispatched calls suspect of having been sent
-- on a lost timeline (NULL for a run no failover affected); and traceparent, the
-- submitter's W3C trace context (NULL when it was submitted without one), which the
-- worker continues. A run claimed again without progress (stalled_claims > 1) comes
-- without its journal (turns and calls NULL): a journal that kills the worker while it is
-- decoded must not keep the worker from giving up on the run first (crash_loop), so the
-- worker loads that one itself, after its check. The per-run read is in the claim
-- statement itself (runledger._claim).
CREATE FUNCTION runledger.claim_runs_v4(p_worker_id text, p_flows text[], p_lease interval,
                                        p_max_runs int)
RETURNS TABLE (run_id text, flow text, flow_version text, input jsonb, state jsonb,
               state_version bigint, fencing_token bigint, lease_id uuid,
               lease_expires_at timestamptz, takeover boolean, stalled_claims integer,
               turns json, calls json, failover_turn integer, traceparent text)
LANGUAGE sql SECURITY DEFINER
SET search_path = pg_catalog, runledger, pg_temp
AS $$
    SELECT c.run_id, c.flow, c.flow_version, c.input, c.state, c.state_version, c.fencing_token,
           c.lease_id, c.lease_expires_at, c.takeover, c.stalled_claims, c.turns, c.calls,
           c.failover_turn, c.traceparent
    FROM runledger._claim(p_worker_id, p_flows, p_lease, p_max_runs, true) c
$$;

CREATE FUNCTION runledger.renew_leases(p_worker_id text, p_run_ids text[], p_lease_ids uuid[],
                                       p_lease interval)
RETURNS TABLE (run_id text, lease_expires_at timestamptz)
LANGUAGE plpgsql SECURITY DEFINER
SET search_path = pg_catalog, runledger, pg_temp
AS $$
#variable_conflict use_column
DECLARE
    v_now timestamptz := runledger.now();
    v_row record;
    v_run_id text;
    -- a lease of an earlier timeline is not renewed (its writes are refused)
    v_floor bigint := runledger._token_floor();
BEGIN
    PERFORM runledger._check_worker_id(p_worker_id);
    PERFORM runledger._check_lease(p_lease);
    IF coalesce(cardinality(p_run_ids), 0) <> coalesce(cardinality(p_lease_ids), 0) THEN
        PERFORM runledger._raise('RL006', 'run ids and lease ids must be arrays of one length',
            NULL, NULL);
    END IF;
    IF cardinality(p_run_ids) > runledger._cap('run_ids') THEN
        PERFORM runledger._raise('RL006',
            format('run ids has %s elements, over the cap of %s', cardinality(p_run_ids),
                   runledger._cap('run_ids')), NULL, NULL);
    END IF;
    FOREACH v_run_id IN ARRAY coalesce(p_run_ids, '{}') LOOP
        PERFORM runledger._check_run_id(v_run_id);
    END LOOP;
    -- One statement (one snapshot) finds the renewed leases and the failed ones; it runs
    -- to completion before the loop returns the first and logs the others.
    FOR v_row IN
    WITH wanted AS (
        SELECT u.run_id, u.lease_id FROM unnest(p_run_ids, p_lease_ids) AS u(run_id, lease_id)
    ), locked AS (
        -- lock in a fixed order so two renewals never wait on each other in a cycle.
        -- Every running run asked for, not only those it renews: a lease
        -- that failed gets its renewal_failed event below, and a run's events are appended
        -- under its row lock (runledger._event). All in one pass and one order: two stale
        -- workers whose runs were taken over by each other would wait on each other if the
        -- failed ones were locked one by one in the loop. Each row as it is once locked.
        SELECT l.run_id, l.lease_id, l.lease_owner, l.status
        FROM runledger.runs l JOIN wanted w ON w.run_id = l.run_id
        WHERE l.status = 'running'
        ORDER BY l.run_id
        FOR NO KEY UPDATE OF l
    ), renewed AS (
        UPDATE runledger.runs r
        SET lease_expires_at = v_now + p_lease
        FROM locked k JOIN wanted w ON w.run_id = k.run_id
        WHERE r.run_id = k.run_id AND r.lease_id = w.lease_id AND r.lease_owner = p_worker_id
          AND r.status = 'running' AND r.lease_expires_at > v_now AND r.fencing_token > v_floor
        RETURNING r.run_id, r.lease_expires_at
    )
    SELECT n.run_id, n.lease_expires_at, true AS renewed, NULL::uuid AS lease_id,
           NULL::uuid AS current_lease_id, NULL::text AS current_owner, NULL::text AS status
    FROM renewed n
    UNION ALL
    -- a run that left 'running' (finished, released, cancelled) has its own event: only a
    -- lease that expired or was taken over is a renewal failure (a locked run is running)
    SELECT w.run_id, NULL, false, w.lease_id, k.lease_id, k.lease_owner, k.status
    FROM wanted w JOIN locked k ON k.run_id = w.run_id
    WHERE NOT EXISTS (SELECT 1 FROM renewed n WHERE n.run_id = w.run_id)
    LOOP
        IF v_row.renewed THEN
            run_id := v_row.run_id;
            lease_expires_at := v_row.lease_expires_at;
            RETURN NEXT;
        ELSE
            PERFORM runledger._event(v_row.run_id, 'renewal_failed', p_worker_id, NULL, NULL,
                jsonb_build_object('lease_id', v_row.lease_id,
                                   'current_lease_id', v_row.current_lease_id,
                                   'current_owner', v_row.current_owner, 'status', v_row.status),
                v_now);
        END IF;
    END LOOP;
END
$$;
CREATE FUNCTION runledger.release_lease(p_run_id text, p_lease_id uuid, p_fencing_token bigint)
RETURNS void
LANGUAGE plpgsql SECURITY DEFINER
SET search_path = pg_catalog, runledger, pg_temp
AS $$
DECLARE
    r runledger.runs;
    v_now timestamptz;
BEGIN
    r := runledger._lock_leased_run(p_run_id, p_lease_id, p_fencing_token);
    v_now := runledger.now();  -- after the lock, as the lease check
    -- a run handed back (a draining worker) did not stall: undo its claim's count
    UPDATE runledger.runs
    SET status = 'queued', lease_id = NULL, lease_expires_at = NULL, lease_owner = NULL,
        stalled_claims = greatest(stalled_claims - 1, 0),
        available_at = v_now, updated_at = v_now
    WHERE run_id = p_run_id AND lease_id = p_lease_id AND fencing_token = p_fencing_token;
    PERFORM runledger._event(p_run_id, 'lease_released', r.lease_owner, p_fencing_token,
                             r.state_version, '{}'::jsonb);
    PERFORM runledger._notify_queued(r.flow, r.flow_version);
END
$$;

-- A worker that hit an error of its own (not a lost lease) hands the run back with a
-- reason. Unlike the clean hand-back above, the claim's stalled count stays: a run that
-- keeps hitting a worker bug still ends up as a crash loop.
CREATE FUNCTION runledger.release_lease(p_run_id text, p_lease_id uuid, p_fencing_token bigint,
                                        p_reason text, p_error jsonb)
RETURNS void
LANGUAGE plpgsql SECURITY DEFINER
SET search_path = pg_catalog, runledger, pg_temp
AS $$
DECLARE
    r runledger.runs;
    v_now timestamptz;
BEGIN
    r := runledger._lock_leased_run(p_run_id, p_lease_id, p_fencing_token);
    v_now := runledger.now();  -- after the lock, as the lease check
    PERFORM runledger._check_text('reason', p_reason, 1, runledger._cap('release_reason'));
    PERFORM runledger._check_json_object_or_null('error', p_error);
    UPDATE runledger.runs
    SET status = 'queued', lease_id = NULL, lease_expires_at = NULL, lease_owner = NULL,
        available_at = v_now, updated_at = v_now
    WHERE run_id = p_run_id AND lease_id = p_lease_id AND fencing_token = p_fencing_token;
    PERFORM runledger._event(p_run_id, 'lease_released', r.lease_owner, p_fencing_token,
        r.state_version, jsonb_build_object('reason', p_reason, 'error', p_error));
    PERFORM runledger._notify_queued(r.flow, r.flow_version);
END
$$;

-- A worker whose write was refused records that, in its own transaction, naming itself.
-- The stale token goes in detail; the fencing_token column only carries current tokens.
-- The run must exist. Its row is locked, though the report changes nothing
-- of it: a run's events are appended under its row lock (runledger._event). The message
-- is what the worker was told (str() of the refusal, with DETAIL and HINT): its cap is
-- generous, so that the report of a refusal never fails on the refusal's own text.
CREATE FUNCTION runledger.report_stale_write(p_run_id text, p_worker_id text, p_lease_id uuid,
                                             p_fencing_token bigint, p_operation text,
                                             p_message text)
RETURNS void
LANGUAGE plpgsql SECURITY DEFINER
SET search_path = pg_catalog, runledger, pg_temp
AS $$
DECLARE
    r runledger.runs;
BEGIN
    PERFORM runledger._check_run_id(p_run_id);
    PERFORM runledger._check_worker_id(p_worker_id);
    PERFORM runledger._check_text('operation', p_operation, 1, runledger._cap('operation'));
    PERFORM runledger._check_text('message', p_message, 0, runledger._cap('message'));
    SELECT * INTO r FROM runledger.runs x WHERE x.run_id = p_run_id FOR NO KEY UPDATE;
    IF NOT FOUND THEN
        PERFORM runledger._raise('RL003', format('run %s not found', p_run_id),
            'a stale write is reported only for a run that exists', NULL);
    END IF;
    PERFORM runledger._event(p_run_id, 'stale_write_rejected', p_worker_id, NULL, NULL,
        jsonb_build_object('operation', p_operation, 'stale_lease_id', p_lease_id,
                           'stale_token', p_fencing_token, 'current_token', r.fencing_token,
                           'current_owner', r.lease_owner, 'message', p_message));
END
$$;

-- -- senders of calls in flight -------------------------------------------
--
-- A run may be taken over while its lease still runs: its holder's listener session
-- ended (claim_runs_v4, session locks). A session that ended is no evidence that the process
-- is dead: an operator's pg_terminate_backend, a proxy's failover, a reset connection end
-- the session of a live worker whose call may still be on its way to the provider, where
-- a lookup cannot see it yet. So a call that an earlier holder sent, with no answer
-- journaled, is looked up or sent again only once that sender can no longer be sending
-- it (docs/leases.md):
--   - the sender said that its send ended (release_call, by the sender), or the current
--     holder found the sender's process gone (release_call, by the holder, with the
--     evidence); each is a 'send_released' event of the run;
--   - or the sender's lease has expired by the database clock: the lease the claim that
--     ended it had seen ('previous_lease_expires_at' of that 'takeover' event). A worker
--     sends nothing once its lease's local deadline has passed, and cancels its running
--     async tools there.
-- _sender_until: NULL when one of these holds; else the time until which the sender of
-- attempt p_attempt of call p_key, sent under token p_token, may still be sending it.
CREATE FUNCTION runledger._sender_until(p_run_id text, p_key text, p_token bigint,
                                        p_attempt integer, p_now timestamptz)
RETURNS timestamptz
LANGUAGE plpgsql
AS $$
DECLARE
    v_kind text;
    v_detail jsonb;
    v_until timestamptz;
BEGIN
    IF EXISTS (SELECT 1 FROM runledger.run_events e
               WHERE e.run_id = p_run_id AND e.kind = 'send_released'
                 AND e.detail ->> 'idempotency_key' = p_key
                 AND e.detail ->> 'attempt' = p_attempt::text) THEN
        RETURN NULL;
    END IF;
    -- the claim that ended the sender's lease: the first one with a greater token
    SELECT e.kind, e.detail INTO v_kind, v_detail FROM runledger.run_events e
    WHERE e.run_id = p_run_id AND e.kind IN ('claimed', 'takeover')
      AND e.fencing_token > p_token
    ORDER BY e.event_id LIMIT 1;
    -- 'claimed': the run was queued again by its holder (released, paused) or by an
    -- operator, not taken from a lease that still ran
    IF v_kind IS DISTINCT FROM 'takeover' THEN
        RETURN NULL;
    END IF;
    v_until := (v_detail ->> 'previous_lease_expires_at')::timestamptz;
    IF v_until IS NULL OR v_until <= p_now THEN
        RETURN NULL;
    END IF;
    RETURN v_until;
END
$$;

-- Who sent a call that is in flight, for the run's current holder before it recovers the
-- call: the sender (worker id, token, the attempt), until when it may still be sending
-- (NULL: it can no longer be; see _sender_until), what it said when it released the call
-- (the 'send_released' event's detail, or NULL), and the sender's process as its worker
-- registered it with the time of that registration (workers.process, started_at), for a
-- peer on the same host to check. One row; none for a call that is not dispatched.
CREATE FUNCTION runledger.call_sender(p_run_id text, p_lease_id uuid, p_fencing_token bigint,
                                      p_idempotency_key text)
RETURNS TABLE (sender text, sender_token bigint, attempt integer, dispatched_at timestamptz,
               until timestamptz, released jsonb, process text, registered_at timestamptz,
               now timestamptz)
LANGUAGE plpgsql SECURITY DEFINER
SET search_path = pg_catalog, runledger, pg_temp
AS $$
DECLARE
    v_lock record;
    c runledger.run_calls;
BEGIN
    v_lock := runledger._lock_leased_run_at(p_run_id, p_lease_id, p_fencing_token);
    c := runledger._lock_call(p_run_id, p_idempotency_key);
    IF c.status <> 'dispatched' THEN
        RETURN;
    END IF;
    sender := c.dispatched_by;
    sender_token := c.dispatched_token;
    attempt := c.attempts;
    dispatched_at := c.dispatched_at;
    now := v_lock.at;
    SELECT e.detail INTO released FROM runledger.run_events e
    WHERE e.run_id = p_run_id AND e.kind = 'send_released'
      AND e.detail ->> 'idempotency_key' = p_idempotency_key
      AND e.detail ->> 'attempt' = c.attempts::text
    ORDER BY e.event_id LIMIT 1;
    -- released: no sender is sending it (the release is what _sender_until looks for first)
    IF released IS NULL AND c.dispatched_token < p_fencing_token THEN
        until := runledger._sender_until(p_run_id, p_idempotency_key, c.dispatched_token,
                                         c.attempts, v_lock.at);
    END IF;
    SELECT w.process, w.started_at INTO process, registered_at
    FROM runledger.workers w WHERE w.worker_id = c.dispatched_by;
    RETURN NEXT;
END
$$;

-- The end of a send, said by one of two callers:
--   - its sender: the worker that dispatched the call's current attempt under
--     (p_lease_id, p_fencing_token), whether or not it still holds the run (it was taken
--     over, or it fenced itself), once its tool has returned, raised or been cancelled.
--     The lease is that of the claim that granted the token (its 'claimed' or 'takeover'
--     event). p_detail says how the send ended: 'ended' ('returned', 'raised',
--     'not_applied', 'cancelled'; 'not_sent': dispatched, but the tool never started) and,
--     when it returned, its 'result' and 'receipt'
--     (the next holder journals them instead of asking the provider again);
--   - the run's current holder (its current, unexpired lease), for a call an earlier
--     holder sent, when it has found that sender's process gone: p_detail carries the
--     evidence ('ended': 'process_gone', 'process': what was checked).
-- Writes a 'send_released' event; true. False, writing nothing, when the call is no
-- longer in flight under that attempt, or its release is already written.
-- Refuses: RL006 (bad arguments, p_detail not an object or without 'ended'), RL003 (no
-- such run or call), RL001 (the lease is neither the sender's nor the run's current one).
CREATE FUNCTION runledger.release_call(p_run_id text, p_lease_id uuid, p_fencing_token bigint,
                                       p_idempotency_key text, p_worker_id text,
                                       p_detail jsonb)
RETURNS boolean
LANGUAGE plpgsql SECURITY DEFINER
SET search_path = pg_catalog, runledger, pg_temp
AS $$
DECLARE
    r runledger.runs;
    c runledger.run_calls;
    v_now timestamptz;
    v_by text;
BEGIN
    PERFORM runledger._check_worker_id(p_worker_id);
    PERFORM runledger._check_json_object('detail', p_detail);
    IF NOT (p_detail ? 'ended') OR jsonb_typeof(p_detail -> 'ended') <> 'string'
       OR NOT (p_detail ->> 'ended' = ANY (ARRAY['returned', 'raised', 'not_applied',
                                                 'cancelled', 'not_sent',
                                                 'process_gone'])) THEN
        PERFORM runledger._raise('RL006',
            'detail.ended must be returned, raised, not_applied, cancelled, not_sent or '
            'process_gone',
            format('detail.ended is %s', coalesce(p_detail -> 'ended', 'null'::jsonb)), NULL);
    END IF;
    IF p_lease_id IS NULL OR p_fencing_token IS NULL THEN
        PERFORM runledger._raise('RL006', 'lease id and fencing token must not be null',
                                 NULL, NULL);
    END IF;
    r := runledger._lock_run(p_run_id);
    v_now := runledger.now();
    c := runledger._lock_call(p_run_id, p_idempotency_key);
    IF c.dispatched_token = p_fencing_token THEN
        -- the sender: the lease its token was granted with
        IF NOT EXISTS (SELECT 1 FROM runledger.run_events e
                       WHERE e.run_id = p_run_id AND e.kind IN ('claimed', 'takeover')
                         AND e.fencing_token = p_fencing_token
                         AND e.detail ->> 'lease_id' = p_lease_id::text) THEN
            PERFORM runledger._raise('RL001',
                format('lease %s token %s did not send call %s', p_lease_id, p_fencing_token,
                       p_idempotency_key),
                'no claim of the run granted that lease with that token', NULL);
        END IF;
        IF p_detail ->> 'ended' = 'process_gone' THEN
            PERFORM runledger._raise('RL006', 'a sender cannot say its own process is gone',
                                     NULL, NULL);
        END IF;
        v_by := 'sender';
    ELSE
        -- the current holder, for a call an earlier holder sent
        IF r.status <> 'running' OR r.lease_id IS DISTINCT FROM p_lease_id
           OR r.fencing_token IS DISTINCT FROM p_fencing_token OR r.lease_expires_at <= v_now
           OR NOT (c.dispatched_token < p_fencing_token) THEN
            PERFORM runledger._raise('RL001',
                format('lease %s token %s neither sent call %s nor holds run %s', p_lease_id,
                       p_fencing_token, p_idempotency_key, p_run_id),
                format('the call was last sent under token %s; the run is %s under token %s',
                       coalesce(c.dispatched_token::text, 'none'), r.status, r.fencing_token),
                NULL);
        END IF;
        IF p_detail ->> 'ended' <> 'process_gone' OR NOT (p_detail ? 'process') THEN
            PERFORM runledger._raise('RL006',
                'a holder releases an earlier sender''s call only with ended process_gone '
                'and the process it checked', NULL, NULL);
        END IF;
        v_by := 'holder';
    END IF;
    IF c.status <> 'dispatched' OR EXISTS (
           SELECT 1 FROM runledger.run_events e
           WHERE e.run_id = p_run_id AND e.kind = 'send_released'
             AND e.detail ->> 'idempotency_key' = p_idempotency_key
             AND e.detail ->> 'attempt' = c.attempts::text) THEN
        RETURN false;
    END IF;
    PERFORM runledger._event(p_run_id, 'send_released', p_worker_id,
        CASE WHEN v_by = 'holder' THEN p_fencing_token END, NULL,
        p_detail || jsonb_build_object('idempotency_key', p_idempotency_key,
                                       'attempt', c.attempts,
                                       'sender', c.dispatched_by,
                                       'sender_token', c.dispatched_token, 'by', v_by),
        v_now);
    RETURN true;
END
$$;

-- A worker id belongs to one live worker at a time.
-- - Registered on a session of its own (p_session: the worker's listener connection, to
--   the server itself), it is that session's (pid and backend_start, so a reused pid is
--   not mistaken for it): another session may take it over once that one has ended (its
--   backend is gone from pg_stat_activity), or when it is the same session.
-- - Registered without one (through a pooler, whose server sessions
--   outlive the worker, or are another client's at the next transaction; session_pid
--   NULL), it is the worker's until it has been silent for silent_after (its lease: the
--   worker heartbeats every third of it), measured from heartbeat_at by the database
--   clock. The worker stops claiming before then, counting from when it sent its last
--   heartbeat (docs/leases.md).
-- Either way it may be taken over once the worker stopped cleanly; by the same process
-- (p_incarnation, minted when it started) unless a session of its own still holds a
-- session lock for it and it registers on a session of its own again; and by a worker
-- that found the registered process gone on its own host (p_gone_process equal to
-- workers.process: runledger.worker.liveness). A row with neither a session nor
-- silent_after is taken over at once.
-- backend_start of another role's session is visible to the function's owner only with
-- pg_read_all_stats (a superuser has it): without it the sessions are told apart by pid.
CREATE FUNCTION runledger._register_worker(p_worker_id text, p_hostname text, p_pid int,
                                           p_flows text[], p_session_lock bigint,
                                           p_process text DEFAULT NULL,
                                           p_incarnation uuid DEFAULT NULL,
                                           p_session boolean DEFAULT true,
                                           p_silent_after interval DEFAULT NULL,
                                           p_gone_process text DEFAULT NULL)
RETURNS void
LANGUAGE plpgsql
AS $$
DECLARE
    v_now timestamptz := runledger.now();
    v_session_pid integer;
    v_session_started timestamptz;
    v_held boolean;
    w runledger.workers;
BEGIN
    PERFORM runledger._check_worker_id(p_worker_id);
    PERFORM runledger._check_text('hostname', p_hostname, 0, runledger._cap('hostname'));
    PERFORM runledger._check_text('process', p_process, 0, runledger._cap('hostname'));
    PERFORM runledger._check_text('gone process', p_gone_process, 0, runledger._cap('hostname'));
    PERFORM runledger._parse_flows(p_flows);
    IF p_session IS NULL THEN
        PERFORM runledger._raise('RL006', 'session must be true or false', NULL, NULL);
    END IF;
    IF p_silent_after IS NOT NULL OR NOT p_session THEN
        -- without a session of its own, how long its silence takes is what frees the id
        PERFORM runledger._check_lease(p_silent_after);
    END IF;
    IF p_session THEN
        v_session_pid := pg_backend_pid();
        SELECT a.backend_start INTO v_session_started FROM pg_stat_activity a
        WHERE a.pid = v_session_pid;
    END IF;

    INSERT INTO runledger.workers (worker_id, hostname, pid, flows, started_at, heartbeat_at,
                                   session_pid, session_started_at, session_lock, process,
                                   incarnation, silent_after)
    VALUES (p_worker_id, coalesce(p_hostname, ''), coalesce(p_pid, 0), p_flows, v_now, v_now,
            v_session_pid, v_session_started, p_session_lock, p_process, p_incarnation,
            p_silent_after)
    ON CONFLICT ON CONSTRAINT pk_workers DO NOTHING;
    IF FOUND THEN
        RETURN;
    END IF;

    -- The id is registered (perhaps by a session whose insert we just waited for): lock
    -- the row, so two sessions taking one id over are judged one after the other.
    SELECT * INTO w FROM runledger.workers x WHERE x.worker_id = p_worker_id FOR UPDATE;
    v_held := CASE
        WHEN w.stopped_at IS NOT NULL THEN false
        -- the same process (its listener reconnected), unless a session of its own still
        -- holds a lock for the id and it registers on a session of its own again (it waits
        -- for that one to end); through a pooler the lock was never its own session's
        WHEN w.incarnation = p_incarnation AND (w.session_lock IS NULL OR NOT p_session)
            THEN false
        -- the caller found that process gone on its own host
        WHEN w.process = p_gone_process THEN false
        WHEN w.session_pid IS NOT NULL THEN
            NOT (w.session_pid IS NOT DISTINCT FROM v_session_pid
                 AND w.session_started_at IS NOT DISTINCT FROM v_session_started)
            AND EXISTS (SELECT 1 FROM pg_stat_activity a
                        WHERE a.pid = w.session_pid
                          AND (a.backend_start IS NULL OR w.session_started_at IS NULL
                               OR a.backend_start = w.session_started_at))
        -- no session of its own: held until it has been silent for silent_after
        ELSE w.silent_after IS NOT NULL AND w.heartbeat_at + w.silent_after > v_now
    END;
    IF v_held AND w.session_pid IS NOT NULL THEN
        PERFORM runledger._raise('RL008',
            format('worker id %s is in use by a live worker', p_worker_id),
            format('registered by host %s pid %s since %s (database session pid %s), not stopped',
                   coalesce(nullif(w.hostname, ''), '?'), w.pid, w.started_at, w.session_pid),
            'start this worker with another --worker-id, or stop the other worker first');
    ELSIF v_held THEN
        PERFORM runledger._raise('RL008',
            format('worker id %s is in use by a live worker', p_worker_id),
            format('registered by host %s pid %s since %s without a session of its own '
                   '(through a pooler), last heartbeat %s ago: the id is free once it has '
                   'been silent for %s',
                   coalesce(nullif(w.hostname, ''), '?'), w.pid, w.started_at,
                   date_trunc('second', v_now - w.heartbeat_at), w.silent_after),
            'start this worker with another --worker-id, or stop the other worker first');
    END IF;
    -- session_lock: the caller's own key, or NULL (a worker that takes an id over never
    -- inherits the last holder's key)
    UPDATE runledger.workers
    SET hostname = coalesce(p_hostname, ''), pid = coalesce(p_pid, 0), flows = p_flows,
        started_at = v_now, heartbeat_at = v_now, stopped_at = NULL,
        session_pid = v_session_pid, session_started_at = v_session_started,
        session_lock = p_session_lock, process = p_process, incarnation = p_incarnation,
        silent_after = p_silent_after
    WHERE worker_id = p_worker_id;
END
$$;

-- register_worker_v2: registers p_worker_id (hostname, pid, the flows it runs, as
-- 'name@version'; see _register_worker for who may take an id over). With
-- p_session_lock the calling session takes a session-level advisory lock under a new
-- random key, recorded as workers.session_lock: claims stamp it on the runs of this
-- worker, and a run whose holder's lock is free is taken over before its lease expires
-- (claim_runs_v4). Call it on
-- the worker's long-lived listener session, and only where the database session is the
-- worker's own (not behind a transaction pooler): the worker checks that first. Without
-- p_session_lock the worker has no key (its runs are taken over on expiry only). Returns
-- the key (NULL without one) and the session's backend pid.
-- p_process: the worker's process as its host names it (workers.process).
-- p_incarnation: the worker process's own random id. p_session false:
-- the calling session is not the worker's own (a pooler's), so the id is not tied to it
-- but to the worker's heartbeats (p_silent_after, required then); p_gone_process: the
-- registered process, which the caller found gone on its own host (_register_worker).
CREATE FUNCTION runledger.register_worker_v2(p_worker_id text, p_hostname text, p_pid int,
                                             p_flows text[], p_session_lock boolean,
                                             p_process text DEFAULT NULL,
                                             p_incarnation uuid DEFAULT NULL,
                                             p_session boolean DEFAULT true,
                                             p_silent_after interval DEFAULT NULL,
                                             p_gone_process text DEFAULT NULL)
RETURNS TABLE (session_lock bigint, session_pid integer)
LANGUAGE plpgsql SECURITY DEFINER
SET search_path = pg_catalog, runledger, pg_temp
AS $$
DECLARE
    v_key bigint;
BEGIN
    IF p_session_lock IS NULL THEN
        PERFORM runledger._raise('RL006', 'session lock must be true or false', NULL, NULL);
    END IF;
    IF p_session_lock AND p_session IS NOT TRUE THEN
        PERFORM runledger._raise('RL006', 'a session lock needs a session of its own',
            'register with p_session_lock false through a pooler', NULL);
    END IF;
    IF p_session_lock THEN
        -- a key no live session holds; a session-level lock outlives this transaction (if
        -- the registration is refused, the session keeps a lock no run carries, until the
        -- worker closes it)
        LOOP
            v_key := ('x' || translate(gen_random_uuid()::text, '-', ''))::bit(64)::bigint;
            EXIT WHEN pg_try_advisory_lock(v_key);
        END LOOP;
        -- the session's own key, which _gone_sessions leaves out (a client can only hide
        -- a key from itself with this setting, never make a held one look free)
        PERFORM set_config('runledger.session_lock', v_key::text, false);
    END IF;
    PERFORM runledger._register_worker(p_worker_id, p_hostname, p_pid, p_flows, v_key,
                                       p_process, p_incarnation, p_session, p_silent_after,
                                       p_gone_process);
    session_lock := v_key;
    session_pid := pg_backend_pid();
    RETURN NEXT;
END
$$;

-- The listener's heartbeat, every half second on the worker's listener
-- session: the backend pid answering (a pooler that moved the session shows here), and
-- whether a run of this worker's flows is held by a session that ended (the worker then
-- claims at once). Writes nothing.
CREATE FUNCTION runledger.heartbeat_listener(p_worker_id text)
RETURNS TABLE (session_pid integer, takeover_due boolean)
LANGUAGE plpgsql SECURITY DEFINER
SET search_path = pg_catalog, runledger, pg_temp
AS $$
DECLARE
    v_gone bigint[];
BEGIN
    PERFORM runledger._check_worker_id(p_worker_id);
    v_gone := runledger._gone_sessions();
    session_pid := pg_backend_pid();
    takeover_due := cardinality(v_gone) > 0 AND EXISTS (
        SELECT 1 FROM runledger.runs r JOIN runledger.workers w ON w.worker_id = p_worker_id
        WHERE r.status = 'running' AND r.lease_lock = ANY (v_gone)
          AND (r.flow || '@' || r.flow_version) = ANY (w.flows));
    RETURN NEXT;
END
$$;

-- An unknown worker id is a no-op: the worker may have been registered in another
-- database, or its row removed by hand. With p_incarnation, only the
-- process that holds the registration heartbeats (or says it stopped); another one (the
-- id was taken over while it was silent, or after its process was found gone) is
-- refused with RL008, and stops.
CREATE FUNCTION runledger.heartbeat_worker(p_worker_id text, p_stopped boolean DEFAULT false,
                                           p_incarnation uuid DEFAULT NULL)
RETURNS void
LANGUAGE plpgsql SECURITY DEFINER
SET search_path = pg_catalog, runledger, pg_temp
AS $$
DECLARE
    v_now timestamptz := runledger.now();
    w runledger.workers;
BEGIN
    PERFORM runledger._check_worker_id(p_worker_id);
    UPDATE runledger.workers
    SET heartbeat_at = v_now,
        stopped_at = CASE WHEN p_stopped THEN v_now ELSE stopped_at END
    WHERE worker_id = p_worker_id
      AND (p_incarnation IS NULL OR incarnation IS NOT DISTINCT FROM p_incarnation);
    IF NOT FOUND AND p_incarnation IS NOT NULL THEN
        SELECT * INTO w FROM runledger.workers x WHERE x.worker_id = p_worker_id;
        IF FOUND THEN
            PERFORM runledger._raise('RL008',
                format('worker id %s was taken over by another worker', p_worker_id),
                format('registered by host %s pid %s since %s',
                       coalesce(nullif(w.hostname, ''), '?'), w.pid, w.started_at),
                'this worker stops; start it with another --worker-id to run both');
        END IF;
    END IF;
END
$$;

-- The timeline the schema is installed on (position 1).
SELECT runledger._note_timeline(NULL, runledger.now());

-- file: 04_journal.sql
-- ---------------------------------------------------------------------------------
-- The journal: checkpoints, turns, calls, and the end of a run
-- ---------------------------------------------------------------------------------

CREATE FUNCTION runledger.checkpoint(p_run_id text, p_lease_id uuid, p_fencing_token bigint,
                                     p_expected_version bigint, p_state jsonb)
RETURNS bigint
LANGUAGE plpgsql SECURITY DEFINER
SET search_path = pg_catalog, runledger, pg_temp
AS $$
DECLARE
    v_lock record;
    r runledger.runs;
    v_now timestamptz;
BEGIN
    -- the clock the lease check read after the lock
    v_lock := runledger._lock_leased_run_at(p_run_id, p_lease_id, p_fencing_token);
    r := v_lock.r;
    v_now := v_lock.at;
    PERFORM runledger._check_json_object('state', p_state);
    IF p_expected_version IS DISTINCT FROM r.state_version THEN
        PERFORM runledger._raise('RL002',
            format('state version conflict on run %s', p_run_id),
            format('expected state_version %s, the run is at %s (token %s)',
                   coalesce(p_expected_version::text, 'NULL'), r.state_version, p_fencing_token),
            'reload the run state and decide again');
    END IF;
    UPDATE runledger.runs
    SET state = p_state, state_version = r.state_version + 1, stalled_claims = 0,
        updated_at = v_now
    WHERE run_id = p_run_id AND state_version = r.state_version AND lease_id = p_lease_id;
    PERFORM runledger._event(p_run_id, 'checkpoint', r.lease_owner, p_fencing_token,
                             r.state_version + 1, '{}'::jsonb, v_now);
    RETURN r.state_version + 1;
END
$$;

-- record_turn_v4: a decision, verbatim, with the checkpoint of the turns before it, the
-- dispatch of its first calls and, for the final decision, the end of the run, in one
-- transaction. p_calls: the decision's calls (a JSON array of objects with call_id, tool,
-- args, an optional "provider_id", the model's own id for the call, kept in
-- run_calls.provider_id to map results back and never part of a key, and an optional
-- "approval": true, a JSON boolean, with which the call is stored with approval
-- 'pending' and dispatch_call refuses it until a person approves it). p_record: the
-- provider-native assistant message (a JSON object or NULL, run_turns.record). p_output:
-- the final decision's output (any JSON or NULL, only with no calls: the run's result).
-- p_state (an object, or NULL: no checkpoint) is written with a compare-and-set on
-- p_expected_version, as checkpoint does; p_finish (only with no calls) makes the run
-- succeed with the output as its result. The calls are checked and inserted set-based.
-- p_dispatch (call ids of this decision, or NULL/empty): the dispatch of those calls in
-- the same transaction, as dispatch_call would do right after it: the decision is
-- committed before any of its tools runs, and each of these calls' dispatch before it is
-- sent, in one commit instead of two. The worker passes the calls it sends first (one
-- call, or the calls of one parallel group); a call recorded with "approval": true cannot
-- be among them (RL004, as dispatch_call). The same decision again (a no-op) still
-- dispatches them. Returns the run's state_version after it and the attempt number of
-- each dispatched call, in p_dispatch's order (one row).
CREATE FUNCTION runledger.record_turn_v4(p_run_id text, p_lease_id uuid, p_fencing_token bigint,
                                         p_turn int, p_calls jsonb, p_record jsonb,
                                         p_output jsonb, p_expected_version bigint,
                                         p_state jsonb, p_finish boolean, p_dispatch text[])
RETURNS TABLE (state_version bigint, attempts integer[])
LANGUAGE plpgsql SECURITY DEFINER
SET search_path = pg_catalog, runledger, pg_temp
AS $$
#variable_conflict use_column
DECLARE
    v_lock record;
    r runledger.runs;
    v_now timestamptz;
    v_count integer;
    v_found boolean;
    v_calls jsonb;
    v_record jsonb;
    v_output jsonb;
    v_next integer;
    v_open integer;
    v_run_calls integer;
    v_calls_ok boolean;
    v_repeated boolean;
    v_bad record;
    v_version bigint;
    v_id text;
    v_fast boolean;
    v_dispatched jsonb[];
    v_kinds text[];
BEGIN
    -- the clock the lease check read after the lock (as complete_call_v2)
    v_lock := runledger._lock_leased_run_at(p_run_id, p_lease_id, p_fencing_token);
    r := v_lock.r;
    v_now := v_lock.at;
    PERFORM runledger._check_json_value('calls', p_calls, 2);
    IF jsonb_typeof(p_calls) <> 'array' THEN
        PERFORM runledger._raise('RL006', 'calls must be a JSON array', NULL, NULL);
    END IF;
    IF p_turn IS NULL OR p_turn < 0 THEN
        PERFORM runledger._raise('RL006', 'turn must be a non-negative integer', NULL, NULL);
    END IF;
    IF p_record IS NOT NULL THEN
        PERFORM runledger._check_json_object_or_null('record', p_record);
    END IF;
    IF p_output IS NOT NULL THEN
        PERFORM runledger._check_json_value_or_null('output', p_output);
    END IF;
    v_count := jsonb_array_length(p_calls);
    IF p_output IS NOT NULL AND v_count > 0 THEN
        PERFORM runledger._raise('RL006', 'output is the final decision''s: it needs empty calls',
            format('turn %s has %s call(s)', p_turn, v_count),
            'send the output with the decision that ends the run');
    END IF;
    IF p_state IS NOT NULL THEN
        PERFORM runledger._check_json_object_or_null('state', p_state);
    END IF;
    IF p_finish IS NULL THEN
        PERFORM runledger._raise('RL006', 'finish must not be null', NULL,
            'true ends the run with the final decision, false records the turn only');
    END IF;
    IF p_finish AND v_count > 0 THEN
        PERFORM runledger._raise('RL006', 'only the final decision finishes the run: it needs empty calls',
            format('turn %s has %s call(s)', p_turn, v_count), NULL);
    END IF;
    -- the calls to dispatch: distinct call ids of this decision (checked as calls are below;
    -- an id that is not one of them matches none). One id is distinct
    -- without a count, and a call object with that string id (containment, no query)
    -- settles it; anything else takes the queries.
    IF p_dispatch IS NOT NULL AND cardinality(p_dispatch) > 0 THEN
        v_repeated := array_position(p_dispatch, NULL) IS NOT NULL;
        IF NOT v_repeated AND cardinality(p_dispatch) > 1 THEN
            v_repeated := cardinality(p_dispatch)
                          > (SELECT count(DISTINCT u) FROM unnest(p_dispatch) u);
        END IF;
        IF v_repeated THEN
            PERFORM runledger._raise('RL006', 'dispatch must list distinct call ids, none null',
                format('got %s', left(array_to_string(p_dispatch, ', ', 'NULL'), 300)), NULL);
        END IF;
        IF cardinality(p_dispatch) > 1
           OR NOT p_calls @> jsonb_build_array(jsonb_build_object('call_id', p_dispatch[1])) THEN
            SELECT u INTO v_id FROM unnest(p_dispatch) u
            WHERE NOT EXISTS (SELECT 1 FROM jsonb_array_elements(p_calls) e
                              WHERE jsonb_typeof(e) = 'object' AND e ->> 'call_id' = u)
            LIMIT 1;
            IF FOUND THEN
                PERFORM runledger._raise('RL006',
                    format('call %s to dispatch is not a call of turn %s', left(v_id, 100), p_turn),
                    'dispatch names call ids of the decision it comes with', NULL);
            END IF;
        END IF;
    END IF;

    -- What the checks below read, in one statement: the turn p_turn if it
    -- is recorded, the next turn, the run's open calls and all its calls, and whether
    -- every call passes the checks of the call loop (then the query that finds the first
    -- problem is not run). Each is used in the order of the checks, as before. The patterns
    -- are those of the checks with the length tested apart: a bounded repetition ({0,63})
    -- costs the regex engine several times more than a star.
    SELECT t.turn IS NOT NULL, t.calls, t.record, t.output, n.next, k.open, k.total, v.ok
    INTO v_found, v_calls, v_record, v_output, v_next, v_open, v_run_calls, v_calls_ok
    FROM (SELECT coalesce(max(x.turn) + 1, 0) AS next FROM runledger.run_turns x
          WHERE x.run_id = p_run_id) n
    CROSS JOIN (SELECT count(*) FILTER (WHERE c.status NOT IN ('succeeded', 'failed')) AS open,
                       count(*) AS total
                FROM runledger.run_calls c WHERE c.run_id = p_run_id) k
    CROSS JOIN (SELECT count(*) = 0 OR (bool_and(coalesce(
                    jsonb_typeof(e) = 'object'
                    AND jsonb_typeof(e -> 'call_id') = 'string'
                    AND (e ->> 'call_id') ~ '^[A-Za-z0-9][A-Za-z0-9._-]*$'
                    AND length(e ->> 'call_id') <= 64
                    AND jsonb_typeof(e -> 'tool') = 'string'
                    AND (e ->> 'tool') ~ '^[A-Za-z_][A-Za-z0-9._-]*$'
                    AND length(e ->> 'tool') <= 128
                    AND jsonb_typeof(coalesce(e -> 'args', '{}'::jsonb)) = 'object'
                    AND coalesce(jsonb_typeof(e -> 'provider_id'), 'null') IN ('null', 'string')
                    AND (jsonb_typeof(e -> 'provider_id') IS DISTINCT FROM 'string'
                         OR length(e ->> 'provider_id') BETWEEN 1 AND runledger._cap('provider_id'))
                    AND (NOT e ? 'approval' OR jsonb_typeof(e -> 'approval') = 'boolean'),
                    false))
                    AND count(DISTINCT e ->> 'call_id') = count(*)) AS ok
                FROM jsonb_array_elements(p_calls) e) v
    LEFT JOIN runledger.run_turns t ON t.run_id = p_run_id AND t.turn = p_turn;
    IF v_found THEN
        IF v_calls = p_calls AND v_record IS NOT DISTINCT FROM p_record
           AND v_output IS NOT DISTINCT FROM p_output THEN
            -- the same decision again: nothing of it is written again; its calls to
            -- dispatch are, as dispatch_call would
            state_version := r.state_version;
            attempts := runledger._dispatch_each(r, p_turn, p_dispatch, v_now, r.state_version);
            RETURN NEXT;
            RETURN;
        END IF;
        PERFORM runledger._raise('RL004',
            format('turn %s of run %s is already recorded with another decision', p_turn, p_run_id),
            CASE WHEN v_calls = p_calls THEN 'the calls are the same; the record or the output differ'
                 ELSE 'the calls differ' END,
            'a recorded decision is never replaced: replay it');
    END IF;
    IF p_state IS NOT NULL AND p_expected_version IS DISTINCT FROM r.state_version THEN
        PERFORM runledger._raise('RL002',
            format('state version conflict on run %s', p_run_id),
            format('expected state_version %s, the run is at %s (token %s)',
                   coalesce(p_expected_version::text, 'NULL'), r.state_version, p_fencing_token),
            'reload the run state and decide again');
    END IF;
    IF p_turn <> v_next THEN
        PERFORM runledger._raise('RL004',
            format('turn %s of run %s is out of order', p_turn, p_run_id),
            format('the next turn to record is %s', v_next), NULL);
    END IF;
    IF v_open > 0 THEN
        PERFORM runledger._raise('RL004',
            format('run %s has %s call(s) without a final result', p_run_id, v_open),
            NULL, 'complete every call of the previous turn before recording the next');
    END IF;

    -- One pass over the calls: the first one (in order) with a problem, and its first
    -- problem in the order of the CASE below. A repeated call id is one whose earlier twin
    -- came first; every call before the first bad one is good.
    IF v_calls_ok IS NOT TRUE THEN
        SELECT x.c, x.problem INTO v_bad FROM (
            SELECT e.c, e.pos, CASE
                WHEN jsonb_typeof(e.c) <> 'object' THEN 'object'
                WHEN jsonb_typeof(e.c -> 'call_id') IS DISTINCT FROM 'string'
                     OR (e.c ->> 'call_id') !~ '^[A-Za-z0-9][A-Za-z0-9._-]{0,63}$' THEN 'call_id'
                WHEN e.seen > 1 THEN 'twice'
                WHEN jsonb_typeof(e.c -> 'tool') IS DISTINCT FROM 'string'
                     OR (e.c ->> 'tool') !~ '^[A-Za-z_][A-Za-z0-9._-]{0,127}$' THEN 'tool'
                WHEN jsonb_typeof(coalesce(e.c -> 'args', '{}'::jsonb)) <> 'object' THEN 'args'
                WHEN coalesce(jsonb_typeof(e.c -> 'provider_id'), 'null') NOT IN ('null', 'string')
                     THEN 'provider_type'
                WHEN jsonb_typeof(e.c -> 'provider_id') = 'string'
                     AND length(e.c ->> 'provider_id') NOT BETWEEN 1 AND runledger._cap('provider_id')
                     THEN 'provider_id'
                WHEN e.c ? 'approval' AND jsonb_typeof(e.c -> 'approval') <> 'boolean' THEN 'approval'
            END AS problem
            FROM (SELECT a.c, a.pos,
                         count(*) OVER (PARTITION BY a.c ->> 'call_id' ORDER BY a.pos) AS seen
                  FROM jsonb_array_elements(p_calls) WITH ORDINALITY AS a(c, pos)) e
        ) x
        WHERE x.problem IS NOT NULL
        ORDER BY x.pos
        LIMIT 1;
        IF FOUND THEN
            CASE v_bad.problem
                WHEN 'object' THEN
                    PERFORM runledger._raise('RL006', 'each call must be a JSON object', NULL, NULL);
                WHEN 'call_id' THEN
                    PERFORM runledger._raise('RL006',
                        format('invalid call id %s', coalesce(left(v_bad.c ->> 'call_id', 100), 'NULL')),
                        'a call id is 1-64 characters of [A-Za-z0-9._-]', NULL);
                WHEN 'twice' THEN
                    PERFORM runledger._raise('RL006',
                        format('call id %s appears twice in turn %s', v_bad.c ->> 'call_id', p_turn),
                        NULL, NULL);
                WHEN 'tool' THEN
                    PERFORM runledger._raise('RL006',
                        format('invalid tool name %s', coalesce(left(v_bad.c ->> 'tool', 100), 'NULL')),
                        NULL, NULL);
                WHEN 'args' THEN
                    PERFORM runledger._raise('RL006',
                        format('args of call %s must be a JSON object', v_bad.c ->> 'call_id'),
                        NULL, NULL);
                WHEN 'provider_type' THEN
                    PERFORM runledger._raise('RL006',
                        format('provider id of call %s must be a string or null', v_bad.c ->> 'call_id'),
                        NULL, NULL);
                WHEN 'provider_id' THEN
                    PERFORM runledger._check_text('provider id', v_bad.c ->> 'provider_id', 1,
                                                  runledger._cap('provider_id'));
                ELSE
                    PERFORM runledger._raise('RL006',
                        format('approval of call %s must be true or false', v_bad.c ->> 'call_id'),
                        format('got %s', left((v_bad.c -> 'approval')::text, 100)),
                        'leave "approval" out for a call that needs none');
            END CASE;
        END IF;
    END IF;

    v_version := r.state_version + CASE WHEN p_state IS NULL THEN 0 ELSE 1 END;
    INSERT INTO runledger.run_turns (run_id, turn, calls, fencing_token, created_at, record, output)
    VALUES (p_run_id, p_turn, p_calls, p_fencing_token, v_now, p_record, p_output);
    -- The calls to dispatch are inserted dispatched (attempt 1, this lease),
    -- the row _dispatch would make of them, instead of planned and then updated one by one,
    -- unless a call of the decision awaits approval (_dispatch refuses those: its path
    -- below, with its error) or p_dispatch does not start at 1 (that path reads element 1).
    -- Their call_dispatched details, in p_dispatch's order.
    v_fast := coalesce(cardinality(p_dispatch), 0) > 0 AND array_lower(p_dispatch, 1) = 1
              AND NOT p_calls @> '[{"approval": true}]'::jsonb;
    WITH ins AS (
        INSERT INTO runledger.run_calls (run_id, turn, call_id, position, tool, args,
                                         idempotency_key, status, attempts, provider_id,
                                         approval, dispatched_token, dispatched_by,
                                         dispatched_at)
        SELECT p_run_id, p_turn, a.c ->> 'call_id', a.pos - 1, a.c ->> 'tool',
               coalesce(a.c -> 'args', '{}'::jsonb),
               p_run_id || ':' || p_turn || ':' || (a.c ->> 'call_id'),
               CASE WHEN d.dispatch THEN 'dispatched' ELSE 'planned' END,
               CASE WHEN d.dispatch THEN 1 ELSE 0 END,
               a.c ->> 'provider_id',
               CASE WHEN (a.c -> 'approval') = 'true'::jsonb THEN 'pending' END,
               CASE WHEN d.dispatch THEN r.fencing_token END,
               CASE WHEN d.dispatch THEN r.lease_owner END,
               CASE WHEN d.dispatch THEN v_now END
        FROM jsonb_array_elements(p_calls) WITH ORDINALITY AS a(c, pos)
        CROSS JOIN LATERAL (SELECT v_fast AND (a.c ->> 'call_id') = ANY (p_dispatch)
                                   AS dispatch) d
        RETURNING call_id, tool, idempotency_key, status)
    SELECT array_agg(jsonb_build_object('idempotency_key', ins.idempotency_key,
                                        'tool', ins.tool, 'attempt', 1,
                                        'previous_status', 'planned') ORDER BY w.ord)
    INTO v_dispatched
    FROM ins JOIN unnest(p_dispatch) WITH ORDINALITY AS w(id, ord) ON w.id = ins.call_id
    WHERE ins.status = 'dispatched';
    -- the checkpoint, the progress and, for the final decision, the end: one row version
    UPDATE runledger.runs
    SET state = CASE WHEN p_state IS NULL THEN state ELSE p_state END,
        state_version = v_version,
        stalled_claims = 0,
        status = CASE WHEN p_finish THEN 'succeeded' ELSE status END,
        result = CASE WHEN p_finish
                      THEN coalesce(p_output, jsonb_build_object('turns', p_turn + 1,
                                                                 'calls', v_run_calls))
                      ELSE result END,
        error = CASE WHEN p_finish THEN NULL ELSE error END,
        pause_reason = CASE WHEN p_finish THEN NULL ELSE pause_reason END,
        lease_id = CASE WHEN p_finish THEN NULL ELSE lease_id END,
        lease_expires_at = CASE WHEN p_finish THEN NULL ELSE lease_expires_at END,
        lease_owner = CASE WHEN p_finish THEN NULL ELSE lease_owner END,
        finished_at = CASE WHEN p_finish THEN v_now ELSE finished_at END,
        updated_at = v_now
    WHERE run_id = p_run_id AND lease_id = p_lease_id AND fencing_token = p_fencing_token
      AND state_version = r.state_version;
    -- the checkpoint, the decision, the calls dispatched above (in p_dispatch's order, as
    -- _dispatch writes their events) and the run's end: in one INSERT
    -- (runledger._events), in that order
    v_kinds := CASE WHEN p_state IS NOT NULL THEN ARRAY['checkpoint'] ELSE '{}'::text[] END
               || ARRAY['turn_recorded']
               || array_fill('call_dispatched'::text,
                             ARRAY[coalesce(cardinality(v_dispatched), 0)])
               || CASE WHEN p_finish THEN ARRAY['run_succeeded'] ELSE '{}'::text[] END;
    PERFORM runledger._events(p_run_id, r.lease_owner, p_fencing_token, v_now, v_kinds,
        array_fill(v_version, ARRAY[cardinality(v_kinds)]),
        CASE WHEN p_state IS NOT NULL THEN ARRAY['{}'::jsonb] ELSE '{}'::jsonb[] END
        || jsonb_build_object('turn', p_turn, 'calls', v_count)
        || coalesce(v_dispatched, '{}'::jsonb[])
        || CASE WHEN p_finish THEN ARRAY['{}'::jsonb] ELSE '{}'::jsonb[] END);
    state_version := v_version;
    IF v_fast THEN
        attempts := array_fill(1, ARRAY[cardinality(p_dispatch)]);
    ELSIF cardinality(p_dispatch) = 1 THEN
        -- one call: what _dispatch_each does for it, one call layer less
        attempts := ARRAY[runledger._dispatch(p_run_id, p_run_id || ':' || p_turn || ':' || p_dispatch[1],
                                              r.lease_owner, r.fencing_token, v_version, v_now)];
    ELSE
        attempts := runledger._dispatch_each(r, p_turn, p_dispatch, v_now, v_version);
    END IF;
    RETURN NEXT;
END
$$;


-- finish_and_claim: a run's final decision (record_turn_v4 with no calls
-- and p_finish true: the checkpoint due, the decision, the run's success) and the next
-- claim of the same worker (claim_runs_v4 for p_worker_id, p_flows, p_lease, p_max_runs),
-- in one transaction: a worker with one run in hand claims its next one with the commit
-- that ends it, one statement and one commit less per run than the decision and then the
-- claim. Either both commit or neither (the finish's refusals are record_turn_v4's, the
-- claim's are claim_runs_v4's). The finish comes first: its run is succeeded, never among
-- the claimed. Rows: one per claimed run, each with finished_version (the finished run's
-- state_version) and the run in claim_runs_v4's columns; one row with the claim's columns
-- NULL when nothing was claimed.
CREATE FUNCTION runledger.finish_and_claim(p_run_id text, p_lease_id uuid, p_fencing_token bigint,
                                           p_turn int, p_record jsonb, p_output jsonb,
                                           p_expected_version bigint, p_state jsonb,
                                           p_worker_id text, p_flows text[], p_lease interval,
                                           p_max_runs int)
RETURNS TABLE (finished_version bigint, run_id text, flow text, flow_version text, input jsonb,
               state jsonb, state_version bigint, fencing_token bigint, lease_id uuid,
               lease_expires_at timestamptz, takeover boolean, stalled_claims integer,
               turns json, calls json, failover_turn integer, traceparent text)
LANGUAGE plpgsql SECURITY DEFINER
SET search_path = pg_catalog, runledger, pg_temp
AS $$
DECLARE
    v_version bigint;
BEGIN
    SELECT d.state_version INTO v_version
    FROM runledger.record_turn_v4(p_run_id, p_lease_id, p_fencing_token, p_turn, '[]'::jsonb,
                                  p_record, p_output, p_expected_version, p_state, true,
                                  NULL) AS d;
    RETURN QUERY
    SELECT v_version, c.run_id, c.flow, c.flow_version, c.input, c.state, c.state_version,
           c.fencing_token, c.lease_id, c.lease_expires_at, c.takeover, c.stalled_claims,
           c.turns, c.calls, c.failover_turn, c.traceparent
    FROM runledger._claim(p_worker_id, p_flows, p_lease, p_max_runs, true) AS c;
    IF NOT FOUND THEN
        finished_version := v_version;
        RETURN NEXT;
    END IF;
END
$$;

CREATE FUNCTION runledger.dispatch_call(p_run_id text, p_lease_id uuid, p_fencing_token bigint,
                                        p_idempotency_key text)
RETURNS int
LANGUAGE plpgsql SECURITY DEFINER
SET search_path = pg_catalog, runledger, pg_temp
AS $$
DECLARE
    v_lock record;
BEGIN
    -- the clock the lease check read after the lock
    v_lock := runledger._lock_leased_run_at(p_run_id, p_lease_id, p_fencing_token);
    RETURN runledger._dispatch(p_run_id, p_idempotency_key, (v_lock.r).lease_owner,
                               p_fencing_token, (v_lock.r).state_version, v_lock.at);
END
$$;

CREATE FUNCTION runledger.complete_call(p_run_id text, p_lease_id uuid, p_fencing_token bigint,
                                        p_idempotency_key text, p_outcome text,
                                        p_result jsonb, p_receipt jsonb)
RETURNS void
LANGUAGE plpgsql SECURITY DEFINER
SET search_path = pg_catalog, runledger, pg_temp
AS $$
DECLARE
    v_lock record;
    r runledger.runs;
    c runledger.run_calls;
    v_now timestamptz;
    v_detail jsonb;
    v_tool text;
    v_attempts integer;
BEGIN
    -- the clock the lease check read after the lock
    v_lock := runledger._lock_leased_run_at(p_run_id, p_lease_id, p_fencing_token);
    r := v_lock.r;
    v_now := v_lock.at;
    -- not_applied: the effect certainly did not happen and the call will be sent again
    -- with the same key; it goes back to planned, so no one mistakes it for in flight.
    -- The checks' common cases inline, as complete_call_v2.
    IF p_outcome IS NULL OR p_outcome NOT IN ('succeeded', 'failed', 'unknown', 'not_applied') THEN
        PERFORM runledger._check_word('outcome', p_outcome,
                                      ARRAY['succeeded', 'failed', 'unknown', 'not_applied']);
    END IF;
    IF p_result IS NOT NULL THEN
        PERFORM runledger._check_json_value_or_null('result', p_result);
    END IF;
    IF p_receipt IS NOT NULL THEN
        PERFORM runledger._check_json_object_or_null('receipt', p_receipt);
    END IF;
    -- The call's UPDATE first, one statement instead of SELECT ... FOR
    -- UPDATE and an UPDATE of the same row, as complete_call_v2 (which says why it
    -- is safe); the checks of _lock_call only when no row matched, to refuse.
    UPDATE runledger.run_calls x
    SET status = CASE WHEN p_outcome = 'not_applied' THEN 'planned' ELSE p_outcome END,
        result = CASE WHEN p_outcome = 'succeeded' THEN p_result END,
        receipt = CASE WHEN p_outcome = 'not_applied' THEN NULL ELSE p_receipt END,
        error = CASE WHEN p_outcome = 'succeeded' THEN NULL ELSE p_result END,
        completed_token = CASE WHEN p_outcome = 'not_applied' THEN NULL ELSE p_fencing_token END,
        completed_by = CASE WHEN p_outcome = 'not_applied' THEN NULL ELSE r.lease_owner END,
        completed_at = CASE WHEN p_outcome = 'not_applied' THEN NULL ELSE v_now END
    WHERE x.idempotency_key = p_idempotency_key AND x.run_id IS NOT DISTINCT FROM p_run_id
      AND x.status = 'dispatched'
    RETURNING x.tool, x.attempts INTO v_tool, v_attempts;
    IF NOT FOUND THEN
        c := runledger._lock_call(p_run_id, p_idempotency_key);
        IF c.status <> 'dispatched' THEN
            PERFORM runledger._raise('RL004',
                format('call %s is %s, not dispatched', p_idempotency_key, c.status),
                NULL, 'dispatch_call must be committed before the tool runs');
        END IF;
        UPDATE runledger.run_calls
        SET status = CASE WHEN p_outcome = 'not_applied' THEN 'planned' ELSE p_outcome END,
            result = CASE WHEN p_outcome = 'succeeded' THEN p_result END,
            receipt = CASE WHEN p_outcome = 'not_applied' THEN NULL ELSE p_receipt END,
            error = CASE WHEN p_outcome = 'succeeded' THEN NULL ELSE p_result END,
            completed_token = CASE WHEN p_outcome = 'not_applied' THEN NULL ELSE p_fencing_token END,
            completed_by = CASE WHEN p_outcome = 'not_applied' THEN NULL ELSE r.lease_owner END,
            completed_at = CASE WHEN p_outcome = 'not_applied' THEN NULL ELSE v_now END
        WHERE idempotency_key = p_idempotency_key AND status = 'dispatched';
        v_tool := c.tool;
        v_attempts := c.attempts;
    END IF;
    -- progress: a run claimed again counts claims without it (crash_loop). The row is
    -- written only when there is a count to reset: after the first write
    -- of a lease there never is, and a call's own row carries its times.
    IF r.stalled_claims <> 0 THEN
        UPDATE runledger.runs SET stalled_claims = 0, updated_at = v_now
        WHERE run_id = p_run_id AND lease_id = p_lease_id;
    END IF;
    v_detail := jsonb_build_object('idempotency_key', p_idempotency_key, 'tool', v_tool,
                                   'attempt', v_attempts);
    CASE p_outcome
        WHEN 'succeeded' THEN
            PERFORM runledger._event(p_run_id, 'call_succeeded', r.lease_owner, p_fencing_token,
                                     r.state_version, v_detail, v_now);
        WHEN 'failed' THEN
            PERFORM runledger._event(p_run_id, 'call_failed', r.lease_owner, p_fencing_token,
                                     r.state_version, v_detail, v_now);
        WHEN 'unknown' THEN
            PERFORM runledger._event(p_run_id, 'call_unknown', r.lease_owner, p_fencing_token,
                                     r.state_version, v_detail, v_now);
        WHEN 'not_applied' THEN
            PERFORM runledger._event(p_run_id, 'call_not_applied', r.lease_owner,
                                     p_fencing_token, r.state_version, v_detail, v_now);
    END CASE;
END
$$;

-- complete_call_v2: complete_call, and with p_next_key the dispatch of the
-- next call in the same transaction (what dispatch_call does, with its checks), for calls
-- that run one after another: the result of one is committed before the next is sent, in
-- one commit instead of two. The next call is dispatched only after a final outcome
-- (succeeded or failed). Returns the next call's attempt number, or NULL without one.
CREATE FUNCTION runledger.complete_call_v2(p_run_id text, p_lease_id uuid, p_fencing_token bigint,
                                           p_idempotency_key text, p_outcome text,
                                           p_result jsonb, p_receipt jsonb,
                                           p_next_key text DEFAULT NULL)
RETURNS int
LANGUAGE plpgsql SECURITY DEFINER
SET search_path = pg_catalog, runledger, pg_temp
AS $$
DECLARE
    v_lock record;
    r runledger.runs;
    c runledger.run_calls;
    v_now timestamptz;
    v_detail jsonb;
    v_tool text;
    v_attempts integer;
    v_done boolean := false;
    v_this tid;
    v_that tid;
    v_previous text;
    v_next record;
BEGIN
    -- the clock the lease check read after the lock
    v_lock := runledger._lock_leased_run_at(p_run_id, p_lease_id, p_fencing_token);
    r := v_lock.r;
    v_now := v_lock.at;
    -- the checks' common cases inline: a check helper runs only where it
    -- refuses or has a value to measure, in the same order
    IF p_outcome IS NULL OR p_outcome NOT IN ('succeeded', 'failed', 'unknown', 'not_applied') THEN
        PERFORM runledger._check_word('outcome', p_outcome,
                                      ARRAY['succeeded', 'failed', 'unknown', 'not_applied']);
    END IF;
    IF p_result IS NOT NULL THEN
        PERFORM runledger._check_json_value_or_null('result', p_result);
    END IF;
    IF p_receipt IS NOT NULL THEN
        PERFORM runledger._check_json_object_or_null('receipt', p_receipt);
    END IF;
    -- The call's UPDATE first, one statement instead of SELECT ... FOR
    -- UPDATE and an UPDATE of the same row (the lock was one more heap write and WAL
    -- record), when the next call's arguments are fine. The call is the one _lock_call
    -- would lock: every writer of a run's calls holds the run's row lock first, as
    -- this function does. Only when no row matched (an invalid key, a key of another
    -- run, a call not dispatched) or a next-call refusal is due does the slow path
    -- below run, to refuse with the exact error in the same order. The run is
    -- a filter (IS NOT DISTINCT FROM), as in _dispatch: the row is found by its key.
    -- With the next call, both rows in one UPDATE (one statement's start,
    -- constraint and trigger set-up instead of two), only when both would pass: this call
    -- dispatched, the next one planned or dispatched and not awaiting approval, both of
    -- this run. One read of both rows, each by its key, finds out, with the status the
    -- next call has now (its call_dispatched names it) and where each row is: the UPDATE
    -- goes to them by ctid (a plan that does not depend on the table's size or
    -- statistics) and repeats the conditions. As every writer of the run's calls holds
    -- the run's lock, it writes both. Otherwise nothing is written here and the path
    -- below refuses with the exact error, as before. What the next call's row gets is
    -- what _dispatch writes.
    IF p_next_key IS NOT NULL AND p_outcome IN ('succeeded', 'failed')
       AND p_next_key <> p_idempotency_key THEN
        SELECT c1.ctid, c2.ctid, c2.status INTO v_this, v_that, v_previous
        FROM runledger.run_calls c1, runledger.run_calls c2
        WHERE c1.idempotency_key = p_idempotency_key AND c1.run_id IS NOT DISTINCT FROM p_run_id
          AND c1.status = 'dispatched'
          AND c2.idempotency_key = p_next_key AND c2.run_id IS NOT DISTINCT FROM p_run_id
          AND c2.status IN ('planned', 'dispatched') AND c2.approval IS DISTINCT FROM 'pending'
          -- one an earlier holder sent goes through _dispatch's sender check
          AND (c2.status = 'planned' OR c2.dispatched_token >= p_fencing_token);
    END IF;
    IF v_that IS NOT NULL THEN
        WITH u AS (
            UPDATE runledger.run_calls x
            SET status = CASE WHEN x.idempotency_key = p_idempotency_key THEN p_outcome
                              ELSE 'dispatched' END,
                result = CASE WHEN x.idempotency_key <> p_idempotency_key THEN x.result
                              WHEN p_outcome = 'succeeded' THEN p_result END,
                receipt = CASE WHEN x.idempotency_key = p_idempotency_key THEN p_receipt
                               ELSE x.receipt END,
                error = CASE WHEN x.idempotency_key <> p_idempotency_key THEN x.error
                             WHEN p_outcome = 'failed' THEN p_result END,
                completed_token = CASE WHEN x.idempotency_key = p_idempotency_key
                                       THEN p_fencing_token ELSE x.completed_token END,
                completed_by = CASE WHEN x.idempotency_key = p_idempotency_key
                                    THEN r.lease_owner ELSE x.completed_by END,
                completed_at = CASE WHEN x.idempotency_key = p_idempotency_key
                                    THEN v_now ELSE x.completed_at END,
                attempts = CASE WHEN x.idempotency_key = p_idempotency_key
                                THEN x.attempts ELSE x.attempts + 1 END,
                dispatched_token = CASE WHEN x.idempotency_key = p_idempotency_key
                                        THEN x.dispatched_token ELSE p_fencing_token END,
                dispatched_by = CASE WHEN x.idempotency_key = p_idempotency_key
                                     THEN x.dispatched_by ELSE r.lease_owner END,
                dispatched_at = CASE WHEN x.idempotency_key = p_idempotency_key
                                     THEN x.dispatched_at ELSE v_now END
            WHERE x.ctid = ANY (ARRAY[v_this, v_that])
              AND CASE WHEN x.idempotency_key = p_idempotency_key THEN x.status = 'dispatched'
                       WHEN x.idempotency_key = p_next_key
                       THEN x.status IN ('planned', 'dispatched')
                            AND x.approval IS DISTINCT FROM 'pending' END
            RETURNING x.idempotency_key AS key, x.tool, x.attempts)
        SELECT count(*) AS written,
               max(u.tool) FILTER (WHERE u.key = p_idempotency_key) AS tool,
               max(u.attempts) FILTER (WHERE u.key = p_idempotency_key) AS attempts,
               max(u.tool) FILTER (WHERE u.key = p_next_key) AS next_tool,
               max(u.attempts) FILTER (WHERE u.key = p_next_key) AS next_attempt
        INTO v_next FROM u;
        IF v_next.written <> 2 THEN
            -- not reached while every writer of the run's calls holds the run's lock
            PERFORM runledger._raise('RL004',
                format('calls %s and %s changed while run %s was locked', p_idempotency_key,
                       p_next_key, p_run_id),
                'a write that does not hold the run''s lock changed them', 'send the call again');
        END IF;
        IF r.stalled_claims <> 0 THEN
            UPDATE runledger.runs SET stalled_claims = 0, updated_at = v_now
            WHERE run_id = p_run_id AND lease_id = p_lease_id;
        END IF;
        -- the call's event, then the next call's call_dispatched, as below: both in one
        -- INSERT (runledger._events)
        v_detail := jsonb_build_object('idempotency_key', p_idempotency_key,
                                       'tool', v_next.tool, 'attempt', v_next.attempts);
        PERFORM runledger._events(p_run_id, r.lease_owner, p_fencing_token, v_now,
            CASE WHEN p_outcome = 'succeeded' THEN ARRAY['call_succeeded', 'call_dispatched']
                 ELSE ARRAY['call_failed', 'call_dispatched'] END,
            ARRAY[r.state_version, r.state_version],
            ARRAY[v_detail, jsonb_build_object('idempotency_key', p_next_key,
                                               'tool', v_next.next_tool,
                                               'attempt', v_next.next_attempt,
                                               'previous_status', v_previous)]);
        RETURN v_next.next_attempt;
    END IF;
    IF p_next_key IS NULL THEN
        UPDATE runledger.run_calls x
        SET status = CASE WHEN p_outcome = 'not_applied' THEN 'planned' ELSE p_outcome END,
            result = CASE WHEN p_outcome = 'succeeded' THEN p_result END,
            receipt = CASE WHEN p_outcome = 'not_applied' THEN NULL ELSE p_receipt END,
            error = CASE WHEN p_outcome = 'succeeded' THEN NULL ELSE p_result END,
            completed_token = CASE WHEN p_outcome = 'not_applied' THEN NULL ELSE p_fencing_token END,
            completed_by = CASE WHEN p_outcome = 'not_applied' THEN NULL ELSE r.lease_owner END,
            completed_at = CASE WHEN p_outcome = 'not_applied' THEN NULL ELSE v_now END
        WHERE x.idempotency_key = p_idempotency_key AND x.run_id IS NOT DISTINCT FROM p_run_id
          AND x.status = 'dispatched'
        RETURNING x.tool, x.attempts INTO v_tool, v_attempts;
        v_done := FOUND;
    END IF;
    IF NOT v_done THEN
        c := runledger._lock_call(p_run_id, p_idempotency_key);
        IF c.status <> 'dispatched' THEN
            PERFORM runledger._raise('RL004',
                format('call %s is %s, not dispatched', p_idempotency_key, c.status),
                NULL, 'dispatch_call must be committed before the tool runs');
        END IF;
        IF p_next_key IS NOT NULL THEN
            IF p_outcome NOT IN ('succeeded', 'failed') THEN
                PERFORM runledger._raise('RL006',
                    format('the next call is dispatched only after a final outcome, not %s', p_outcome),
                    format('call %s, next call %s', p_idempotency_key, left(p_next_key, 300)),
                    'complete the call alone; the run pauses or sends it again');
            END IF;
            IF p_next_key = p_idempotency_key THEN
                PERFORM runledger._raise('RL006',
                    format('call %s cannot be its own next call', p_idempotency_key), NULL, NULL);
            END IF;
        END IF;

        UPDATE runledger.run_calls
        SET status = CASE WHEN p_outcome = 'not_applied' THEN 'planned' ELSE p_outcome END,
            result = CASE WHEN p_outcome = 'succeeded' THEN p_result END,
            receipt = CASE WHEN p_outcome = 'not_applied' THEN NULL ELSE p_receipt END,
            error = CASE WHEN p_outcome = 'succeeded' THEN NULL ELSE p_result END,
            completed_token = CASE WHEN p_outcome = 'not_applied' THEN NULL ELSE p_fencing_token END,
            completed_by = CASE WHEN p_outcome = 'not_applied' THEN NULL ELSE r.lease_owner END,
            completed_at = CASE WHEN p_outcome = 'not_applied' THEN NULL ELSE v_now END
        WHERE idempotency_key = p_idempotency_key AND status = 'dispatched';
        v_tool := c.tool;
        v_attempts := c.attempts;
    END IF;
    -- progress: a run claimed again counts claims without it (crash_loop). The row is
    -- written only when there is a count to reset: after the first write
    -- of a lease there never is, and a call's own row carries its times.
    IF r.stalled_claims <> 0 THEN
        UPDATE runledger.runs SET stalled_claims = 0, updated_at = v_now
        WHERE run_id = p_run_id AND lease_id = p_lease_id;
    END IF;
    v_detail := jsonb_build_object('idempotency_key', p_idempotency_key, 'tool', v_tool,
                                   'attempt', v_attempts);
    CASE p_outcome
        WHEN 'succeeded' THEN
            PERFORM runledger._event(p_run_id, 'call_succeeded', r.lease_owner, p_fencing_token,
                                     r.state_version, v_detail, v_now);
        WHEN 'failed' THEN
            PERFORM runledger._event(p_run_id, 'call_failed', r.lease_owner, p_fencing_token,
                                     r.state_version, v_detail, v_now);
        WHEN 'unknown' THEN
            PERFORM runledger._event(p_run_id, 'call_unknown', r.lease_owner, p_fencing_token,
                                     r.state_version, v_detail, v_now);
        WHEN 'not_applied' THEN
            PERFORM runledger._event(p_run_id, 'call_not_applied', r.lease_owner,
                                     p_fencing_token, r.state_version, v_detail, v_now);
    END CASE;
    IF p_next_key IS NULL THEN
        RETURN NULL;
    END IF;
    -- the next call is locked and checked as dispatch_call does, after this one
    RETURN runledger._dispatch(p_run_id, p_next_key, r.lease_owner, p_fencing_token,
                               r.state_version, v_now);
END
$$;

-- complete_calls: the results of several calls of one run in one
-- transaction -- group commit of a parallel group's results that are ready together --
-- and, with p_next_key, the dispatch of the next call, as complete_call_v2 does (then
-- every outcome must be final). p_keys, p_outcomes, p_results and p_receipts are parallel
-- one-dimensional arrays of 1 to 100 calls, each key once. Each call is checked and
-- refused as complete_call_v2 checks its one call, in the arrays' order, and a refusal
-- leaves nothing of the batch written. One run lock, one clock reading, one UPDATE of the
-- calls; each call's event as complete_call writes it, in the arrays' order, then the next
-- call's call_dispatched. Returns the next call's attempt number, or NULL without one.
CREATE FUNCTION runledger.complete_calls(p_run_id text, p_lease_id uuid, p_fencing_token bigint,
                                         p_keys text[], p_outcomes text[], p_results jsonb[],
                                         p_receipts jsonb[], p_next_key text DEFAULT NULL)
RETURNS int
LANGUAGE plpgsql SECURITY DEFINER
SET search_path = pg_catalog, runledger, pg_temp
AS $$
DECLARE
    v_lock record;
    r runledger.runs;
    c runledger.run_calls;
    v_now timestamptz;
    v_n integer := coalesce(cardinality(p_keys), 0);
    v_i integer;
    v_outcome text;
    v_tools text[] := '{}';
    v_attempts integer[] := '{}';
    v_detail jsonb;
BEGIN
    -- the clock the lease check read after the lock
    v_lock := runledger._lock_leased_run_at(p_run_id, p_lease_id, p_fencing_token);
    r := v_lock.r;
    v_now := v_lock.at;
    IF v_n < 1 OR v_n > 100 OR array_ndims(p_keys) <> 1 OR array_lower(p_keys, 1) <> 1 THEN
        PERFORM runledger._raise('RL006', 'complete_calls takes 1 to 100 calls',
            format('got %s key(s) in %s dimension(s)', v_n,
                   coalesce(array_ndims(p_keys)::text, 'no')),
            'pass one-dimensional arrays, one element per call');
    END IF;
    IF array_ndims(p_outcomes) IS DISTINCT FROM 1 OR array_ndims(p_results) IS DISTINCT FROM 1
       OR array_ndims(p_receipts) IS DISTINCT FROM 1
       OR array_lower(p_outcomes, 1) <> 1 OR array_lower(p_results, 1) <> 1
       OR array_lower(p_receipts, 1) <> 1
       OR cardinality(p_outcomes) <> v_n OR cardinality(p_results) <> v_n
       OR cardinality(p_receipts) <> v_n THEN
        PERFORM runledger._raise('RL006',
            'keys, outcomes, results and receipts must be arrays of one length',
            format('%s key(s), %s outcome(s), %s result(s), %s receipt(s)', v_n,
                   coalesce(cardinality(p_outcomes)::text, 'NULL'),
                   coalesce(cardinality(p_results)::text, 'NULL'),
                   coalesce(cardinality(p_receipts)::text, 'NULL')),
            'one element per call; a result or receipt may be a NULL element');
    END IF;
    FOR v_i IN 1 .. v_n LOOP
        v_outcome := p_outcomes[v_i];
        -- not_applied: the call goes back to planned and is sent again with the same key
        IF v_outcome IS NULL
           OR v_outcome NOT IN ('succeeded', 'failed', 'unknown', 'not_applied') THEN
            PERFORM runledger._check_word('outcome', v_outcome,
                                          ARRAY['succeeded', 'failed', 'unknown', 'not_applied']);
        END IF;
        -- as complete_call_v2: a check helper runs only with a value
        IF p_results[v_i] IS NOT NULL THEN
            PERFORM runledger._check_json_value_or_null('result', p_results[v_i]);
        END IF;
        IF p_receipts[v_i] IS NOT NULL THEN
            PERFORM runledger._check_json_object_or_null('receipt', p_receipts[v_i]);
        END IF;
        IF p_keys[v_i] = ANY (p_keys[1:v_i - 1]) THEN
            PERFORM runledger._raise('RL006',
                format('call %s appears twice in one completion', p_keys[v_i]), NULL,
                'complete a call once');
        END IF;
        c := runledger._lock_call(p_run_id, p_keys[v_i]);
        IF c.status <> 'dispatched' THEN
            PERFORM runledger._raise('RL004',
                format('call %s is %s, not dispatched', p_keys[v_i], c.status),
                NULL, 'dispatch_call must be committed before the tool runs');
        END IF;
        IF p_next_key IS NOT NULL AND v_outcome NOT IN ('succeeded', 'failed') THEN
            PERFORM runledger._raise('RL006',
                format('the next call is dispatched only after a final outcome, not %s', v_outcome),
                format('call %s, next call %s', p_keys[v_i], left(p_next_key, 300)),
                'complete the call alone; the run pauses or sends it again');
        END IF;
        IF p_next_key = p_keys[v_i] THEN
            PERFORM runledger._raise('RL006',
                format('call %s cannot be its own next call', p_keys[v_i]), NULL, NULL);
        END IF;
        v_tools := v_tools || c.tool;
        v_attempts := v_attempts || c.attempts;
    END LOOP;

    UPDATE runledger.run_calls x
    SET status = CASE WHEN u.o = 'not_applied' THEN 'planned' ELSE u.o END,
        result = CASE WHEN u.o = 'succeeded' THEN u.res END,
        receipt = CASE WHEN u.o = 'not_applied' THEN NULL ELSE u.rec END,
        error = CASE WHEN u.o = 'succeeded' THEN NULL ELSE u.res END,
        completed_token = CASE WHEN u.o = 'not_applied' THEN NULL ELSE p_fencing_token END,
        completed_by = CASE WHEN u.o = 'not_applied' THEN NULL ELSE r.lease_owner END,
        completed_at = CASE WHEN u.o = 'not_applied' THEN NULL ELSE v_now END
    FROM unnest(p_keys, p_outcomes, p_results, p_receipts) AS u(k, o, res, rec)
    WHERE x.idempotency_key = u.k AND x.status = 'dispatched';
    -- progress, as complete_call_v2: the run row only when there is a count to reset
    IF r.stalled_claims <> 0 THEN
        UPDATE runledger.runs SET stalled_claims = 0, updated_at = v_now
        WHERE run_id = p_run_id AND lease_id = p_lease_id;
    END IF;
    FOR v_i IN 1 .. v_n LOOP
        v_detail := jsonb_build_object('idempotency_key', p_keys[v_i], 'tool', v_tools[v_i],
                                       'attempt', v_attempts[v_i]);
        CASE p_outcomes[v_i]
            WHEN 'succeeded' THEN
                PERFORM runledger._event(p_run_id, 'call_succeeded', r.lease_owner,
                                         p_fencing_token, r.state_version, v_detail, v_now);
            WHEN 'failed' THEN
                PERFORM runledger._event(p_run_id, 'call_failed', r.lease_owner,
                                         p_fencing_token, r.state_version, v_detail, v_now);
            WHEN 'unknown' THEN
                PERFORM runledger._event(p_run_id, 'call_unknown', r.lease_owner,
                                         p_fencing_token, r.state_version, v_detail, v_now);
            WHEN 'not_applied' THEN
                PERFORM runledger._event(p_run_id, 'call_not_applied', r.lease_owner,
                                         p_fencing_token, r.state_version, v_detail, v_now);
        END CASE;
    END LOOP;
    IF p_next_key IS NULL THEN
        RETURN NULL;
    END IF;
    -- the next call is locked and checked as dispatch_call does, after these
    RETURN runledger._dispatch(p_run_id, p_next_key, r.lease_owner, p_fencing_token,
                               r.state_version, v_now);
END
$$;

CREATE FUNCTION runledger.finish_run(p_run_id text, p_lease_id uuid, p_fencing_token bigint,
                                     p_status text, p_result jsonb, p_reason text)
RETURNS void
LANGUAGE plpgsql SECURITY DEFINER
SET search_path = pg_catalog, runledger, pg_temp
AS $$
DECLARE
    v_lock record;
    r runledger.runs;
    v_now timestamptz;
    v_open integer;
    v_detail jsonb;
BEGIN
    -- the clock the lease check read after the lock
    v_lock := runledger._lock_leased_run_at(p_run_id, p_lease_id, p_fencing_token);
    r := v_lock.r;
    v_now := v_lock.at;
    PERFORM runledger._check_word('status', p_status, ARRAY['succeeded', 'failed', 'paused']);
    PERFORM runledger._check_json_value_or_null('result', p_result);
    PERFORM runledger._check_text('reason', p_reason, 0, runledger._cap('reason'));
    IF p_status = 'succeeded' THEN
        SELECT count(*) INTO v_open FROM runledger.run_calls c
        WHERE c.run_id = p_run_id AND c.status NOT IN ('succeeded', 'failed');
        IF v_open > 0 THEN
            PERFORM runledger._raise('RL004',
                format('run %s cannot succeed with %s open call(s)', p_run_id, v_open),
                NULL, 'complete or pause first');
        END IF;
    ELSIF p_status = 'failed' THEN
        -- A call that may have taken effect must stay reconcilable: a failed run could
        -- never be resumed, so its ambiguous calls would stay ambiguous for good.
        SELECT count(*) INTO v_open FROM runledger.run_calls c
        WHERE c.run_id = p_run_id AND c.status IN ('dispatched', 'unknown');
        IF v_open > 0 THEN
            PERFORM runledger._raise('RL004',
                format('run %s cannot fail with %s call(s) in flight or unknown', p_run_id, v_open),
                NULL, 'mark in-flight calls unknown and pause the run for a person instead');
        END IF;
    END IF;
    UPDATE runledger.runs
    SET status = p_status,
        result = CASE WHEN p_status = 'succeeded' THEN p_result END,
        error = CASE WHEN p_status = 'failed'
                     THEN jsonb_build_object('reason', p_reason) || coalesce(
                          CASE WHEN jsonb_typeof(p_result) = 'object' THEN p_result END, '{}')
                END,
        pause_reason = CASE WHEN p_status = 'paused' THEN coalesce(p_reason, 'paused') END,
        lease_id = NULL, lease_expires_at = NULL, lease_owner = NULL,
        finished_at = CASE WHEN p_status = 'paused' THEN NULL ELSE v_now END,
        updated_at = v_now
    WHERE run_id = p_run_id AND lease_id = p_lease_id AND fencing_token = p_fencing_token;
    v_detail := jsonb_strip_nulls(jsonb_build_object('reason', p_reason));
    CASE p_status
        WHEN 'succeeded' THEN
            PERFORM runledger._event(p_run_id, 'run_succeeded', r.lease_owner, p_fencing_token,
                                     r.state_version, v_detail, v_now);
        WHEN 'failed' THEN
            PERFORM runledger._event(p_run_id, 'run_failed', r.lease_owner, p_fencing_token,
                                     r.state_version, v_detail, v_now);
        WHEN 'paused' THEN
            PERFORM runledger._event(p_run_id, 'run_paused', r.lease_owner, p_fencing_token,
                                     r.state_version, v_detail, v_now);
    END CASE;
END
$$;

-- file: 05_operator.sql
-- ---------------------------------------------------------------------------------
-- Operator functions: resolve, approve, deny, cancel, retry; retention
-- ---------------------------------------------------------------------------------

-- A paused run whose last call waiting for a person was settled goes back to the queue:
-- nothing of it is unknown nor awaiting approval any more. r is the run row as locked by
-- the caller; p_after names the caller in the run_requeued event. Returns whether the
-- run was requeued. Like every helper, no SET search_path (02_helpers.sql says why that
-- is safe).
CREATE FUNCTION runledger._requeue_if_settled(r runledger.runs, p_actor text, p_after text,
                                              p_now timestamptz) RETURNS boolean
LANGUAGE plpgsql
AS $$
DECLARE
    v_left integer;
BEGIN
    IF r.status <> 'paused' THEN
        RETURN false;
    END IF;
    SELECT count(*) INTO v_left FROM runledger.run_calls x
    WHERE x.run_id = r.run_id
      AND (x.status = 'unknown' OR (x.status = 'planned' AND x.approval = 'pending'));
    IF v_left > 0 THEN
        RETURN false;
    END IF;
    UPDATE runledger.runs
    SET status = 'queued', pause_reason = NULL, available_at = p_now, updated_at = p_now
    WHERE run_id = r.run_id AND status = 'paused';
    PERFORM runledger._event(r.run_id, 'run_requeued', p_actor, NULL, r.state_version,
                             jsonb_build_object('after', p_after));
    PERFORM runledger._notify_queued(r.flow, r.flow_version);
    RETURN true;
END
$$;

CREATE FUNCTION runledger.resolve_call(p_idempotency_key text, p_resolution text,
                                       p_receipt jsonb, p_actor text, p_note text)
RETURNS void
LANGUAGE plpgsql SECURITY DEFINER
SET search_path = pg_catalog, runledger, pg_temp
AS $$
DECLARE
    v_run_id text;
    r runledger.runs;
    c runledger.run_calls;
    v_now timestamptz := runledger.now();
BEGIN
    PERFORM runledger._check_word('resolution', p_resolution,
                                  ARRAY['applied', 'not_applied', 'abandoned']);
    PERFORM runledger._check_json_object_or_null('receipt', p_receipt);
    PERFORM runledger._check_text('actor', p_actor, 1, runledger._cap('actor'));
    PERFORM runledger._check_text('note', p_note, 0, runledger._cap('note'));
    PERFORM runledger._check_text('idempotency key', p_idempotency_key, 1,
                                  runledger._cap('idempotency_key'));
    SELECT x.run_id INTO v_run_id FROM runledger.run_calls x WHERE x.idempotency_key = p_idempotency_key;
    IF NOT FOUND THEN
        PERFORM runledger._raise('RL003', format('call %s not found', p_idempotency_key), NULL, NULL);
    END IF;
    r := runledger._lock_run(v_run_id);           -- the run row first, then the call
    c := runledger._lock_call(v_run_id, p_idempotency_key);
    -- A running run's holder may still be deciding about the call: resolve only calls
    -- of runs nobody holds (paused, and cancelled or failed ones, for the ledger's sake).
    IF c.status <> 'unknown' OR r.status NOT IN ('paused', 'cancelled', 'failed') THEN
        PERFORM runledger._raise('RL004',
            format('call %s is %s in a %s run; only unknown calls of paused, cancelled or '
                   'failed runs are resolved', p_idempotency_key, c.status, r.status), NULL, NULL);
    END IF;
    UPDATE runledger.run_calls
    SET status = CASE p_resolution WHEN 'applied' THEN 'succeeded'
                                   WHEN 'not_applied' THEN 'planned'
                                   ELSE 'failed' END,
        result = CASE WHEN p_resolution = 'applied' THEN coalesce(p_receipt, '{}'::jsonb) END,
        receipt = CASE WHEN p_resolution = 'applied' THEN p_receipt END,
        -- A call resolved as applied is a succeeded call like any other: no error. The
        -- error reported with the unknown outcome stays in the call_resolved event.
        error = CASE WHEN p_resolution = 'abandoned'
                     THEN jsonb_strip_nulls(jsonb_build_object('reason', 'abandoned', 'note', p_note))
                END,
        resolved_by = p_actor, resolved_at = v_now, resolution_note = p_note
    WHERE idempotency_key = p_idempotency_key AND status = 'unknown';
    PERFORM runledger._event(v_run_id, 'call_resolved', p_actor, NULL, r.state_version,
        jsonb_strip_nulls(jsonb_build_object('idempotency_key', p_idempotency_key,
                                             'resolution', p_resolution, 'note', p_note,
                                             'unknown_error', c.error)));
    PERFORM runledger._requeue_if_settled(r, p_actor, 'resolve_call', v_now);
END
$$;

-- Human approval. A call recorded with "approval": true waits, planned
-- and never dispatched, for a person: approve_call lets it be dispatched as any other
-- call; deny_call fails it, never sent, with the reason the policy then sees. Only calls
-- of runs nobody holds are decided: a holder of a running run may be pausing on the call
-- right now, and an approval it did not see would leave the run paused with nothing to
-- wait for. A paused run with nothing left to wait for is requeued.
-- The call of p_idempotency_key, locked after its run, if it awaits approval in a run
-- nobody holds; RL003 or RL004 otherwise.
CREATE FUNCTION runledger._lock_awaiting_call(p_idempotency_key text) RETURNS runledger.run_calls
LANGUAGE plpgsql
AS $$
DECLARE
    v_run_id text;
    r runledger.runs;
    c runledger.run_calls;
BEGIN
    PERFORM runledger._check_text('idempotency key', p_idempotency_key, 1,
                                  runledger._cap('idempotency_key'));
    SELECT x.run_id INTO v_run_id FROM runledger.run_calls x
    WHERE x.idempotency_key = p_idempotency_key;
    IF NOT FOUND THEN
        PERFORM runledger._raise('RL003', format('call %s not found', p_idempotency_key), NULL, NULL);
    END IF;
    r := runledger._lock_run(v_run_id);           -- the run row first, then the call
    c := runledger._lock_call(v_run_id, p_idempotency_key);
    IF c.status <> 'planned' OR c.approval IS DISTINCT FROM 'pending' THEN
        PERFORM runledger._raise('RL004',
            format('call %s does not await approval: it is %s, approval %s', p_idempotency_key,
                   c.status, coalesce(c.approval, 'not needed')),
            CASE WHEN c.approval IN ('approved', 'denied')
                 THEN format('%s by %s at %s', c.approval, c.approval_by, c.approval_at) END,
            'only a planned call recorded with "approval": true is approved or denied, once');
    END IF;
    IF r.status NOT IN ('queued', 'paused', 'cancelled', 'failed') THEN
        PERFORM runledger._raise('RL004',
            format('call %s is of a %s run; calls of running runs are not decided',
                   p_idempotency_key, r.status),
            format('run %s is held by %s', r.run_id, coalesce(r.lease_owner, 'nobody')),
            format('its worker pauses it on the call: decide once `runledger status %s` '
                   'shows it paused', r.run_id));
    END IF;
    RETURN c;
END
$$;

CREATE FUNCTION runledger.approve_call(p_idempotency_key text, p_actor text, p_note text)
RETURNS void
LANGUAGE plpgsql SECURITY DEFINER
SET search_path = pg_catalog, runledger, pg_temp
AS $$
DECLARE
    r runledger.runs;
    c runledger.run_calls;
    v_now timestamptz;
BEGIN
    PERFORM runledger._check_text('actor', p_actor, 1, runledger._cap('actor'));
    PERFORM runledger._check_text('note', p_note, 0, runledger._cap('note'));
    c := runledger._lock_awaiting_call(p_idempotency_key);
    r := runledger._lock_run(c.run_id);  -- locked already: the row as the check saw it
    v_now := runledger.now();
    UPDATE runledger.run_calls
    SET approval = 'approved', approval_by = p_actor, approval_note = p_note, approval_at = v_now
    WHERE idempotency_key = p_idempotency_key AND status = 'planned' AND approval = 'pending';
    PERFORM runledger._event(r.run_id, 'call_approved', p_actor, NULL, r.state_version,
        jsonb_strip_nulls(jsonb_build_object('idempotency_key', p_idempotency_key,
                                             'tool', c.tool, 'note', p_note)));
    PERFORM runledger._requeue_if_settled(r, p_actor, 'approve_call', v_now);
END
$$;

CREATE FUNCTION runledger.deny_call(p_idempotency_key text, p_actor text, p_reason text)
RETURNS void
LANGUAGE plpgsql SECURITY DEFINER
SET search_path = pg_catalog, runledger, pg_temp
AS $$
DECLARE
    r runledger.runs;
    c runledger.run_calls;
    v_now timestamptz;
BEGIN
    PERFORM runledger._check_text('actor', p_actor, 1, runledger._cap('actor'));
    PERFORM runledger._check_text('reason', p_reason, 1, runledger._cap('reason'));
    c := runledger._lock_awaiting_call(p_idempotency_key);
    r := runledger._lock_run(c.run_id);  -- locked already: the row as the check saw it
    v_now := runledger.now();
    -- failed, never dispatched: the policy sees a failed call whose error says who denied
    -- it and why, and decides the next turn
    UPDATE runledger.run_calls
    SET status = 'failed',
        error = jsonb_build_object('reason', 'denied', 'note', p_reason, 'actor', p_actor),
        approval = 'denied', approval_by = p_actor, approval_note = p_reason, approval_at = v_now
    WHERE idempotency_key = p_idempotency_key AND status = 'planned' AND approval = 'pending';
    PERFORM runledger._event(r.run_id, 'call_denied', p_actor, NULL, r.state_version,
        jsonb_build_object('idempotency_key', p_idempotency_key, 'tool', c.tool,
                           'reason', p_reason));
    PERFORM runledger._requeue_if_settled(r, p_actor, 'deny_call', v_now);
END
$$;

CREATE FUNCTION runledger.cancel_run(p_run_id text, p_actor text, p_reason text)
RETURNS void
LANGUAGE plpgsql SECURITY DEFINER
SET search_path = pg_catalog, runledger, pg_temp
AS $$
DECLARE
    r runledger.runs;
    v_now timestamptz := runledger.now();
BEGIN
    -- a NULL actor is the default 'operator'; an empty one is refused
    PERFORM runledger._check_text('actor', coalesce(p_actor, 'operator'), 1,
                                  runledger._cap('actor'));
    PERFORM runledger._check_text('reason', p_reason, 0, runledger._cap('reason'));
    r := runledger._lock_run(p_run_id);
    IF r.status = 'cancelled' THEN
        RETURN;
    END IF;
    IF r.status IN ('succeeded', 'failed') THEN
        PERFORM runledger._raise('RL004',
            format('run %s already %s', p_run_id, r.status), NULL, NULL);
    END IF;
    UPDATE runledger.runs
    SET status = 'cancelled', lease_id = NULL, lease_expires_at = NULL, lease_owner = NULL,
        error = jsonb_strip_nulls(jsonb_build_object('reason', 'cancelled', 'note', p_reason)),
        finished_at = v_now, updated_at = v_now
    WHERE run_id = p_run_id AND status IN ('queued', 'running', 'paused');
    -- A call in flight may have taken effect: it becomes unknown, for a person to
    -- reconcile (resolve_call works on cancelled runs), instead of dispatched forever.
    UPDATE runledger.run_calls
    SET status = 'unknown',
        error = jsonb_build_object('reason', 'cancelled while in flight'),
        completed_at = v_now
    WHERE run_id = p_run_id AND status = 'dispatched';
    PERFORM runledger._event(p_run_id, 'run_cancelled', coalesce(p_actor, 'operator'), NULL,
        r.state_version, jsonb_strip_nulls(jsonb_build_object(
            'reason', p_reason, 'previous_status', r.status, 'previous_owner', r.lease_owner)));
END
$$;

CREATE FUNCTION runledger.retry_run(p_run_id text, p_actor text)
RETURNS void
LANGUAGE plpgsql SECURITY DEFINER
SET search_path = pg_catalog, runledger, pg_temp
AS $$
DECLARE
    r runledger.runs;
    v_now timestamptz := runledger.now();
    v_unknown integer;
BEGIN
    PERFORM runledger._check_text('actor', coalesce(p_actor, 'operator'), 1,
                                  runledger._cap('actor'));
    r := runledger._lock_run(p_run_id);
    IF r.status NOT IN ('failed', 'paused') THEN
        PERFORM runledger._raise('RL004',
            format('run %s is %s; only failed or paused runs are retried', p_run_id, r.status),
            NULL, NULL);
    END IF;
    SELECT count(*) INTO v_unknown FROM runledger.run_calls x
    WHERE x.run_id = p_run_id AND x.status = 'unknown';
    IF v_unknown > 0 THEN
        PERFORM runledger._raise('RL004',
            format('run %s has %s unknown call(s)', p_run_id, v_unknown),
            NULL, 'resolve them first: runledger resolve KEY applied|not_applied|abandoned');
    END IF;
    UPDATE runledger.runs
    SET status = 'queued', pause_reason = NULL, error = NULL, finished_at = NULL,
        stalled_claims = 0, available_at = v_now, updated_at = v_now
    WHERE run_id = p_run_id AND status IN ('failed', 'paused');
    PERFORM runledger._event(p_run_id, 'run_requeued', coalesce(p_actor, 'operator'), NULL,
        r.state_version, jsonb_build_object('after', 'retry_run', 'previous_status', r.status));
    PERFORM runledger._notify_queued(r.flow, r.flow_version);
END
$$;

-- Retention: the only path allowed to delete events, calls and runs. It authorizes its
-- own deletes with a row for its transaction in runledger.prune_authorizations (which no
-- caller can write) and removes that row before it returns, so no door stays open for
-- the rest of the caller's transaction. Only finished runs are deleted (the guard of
-- runs checks it again). prune_runs_v2's batches in a loop: a run
-- another transaction holds (an operator's retry) is left, as there.
CREATE FUNCTION runledger.prune_runs(p_before timestamptz, p_keep_events boolean)
RETURNS integer
LANGUAGE plpgsql SECURITY DEFINER
SET search_path = pg_catalog, runledger, pg_temp
AS $$
DECLARE
    v_count integer := 0;
    v_batch integer;
BEGIN
    IF p_before IS NULL THEN
        PERFORM runledger._raise('RL006', 'before must not be null', NULL, NULL);
    END IF;
    -- prune_runs_v2's batches, one after the other in this transaction, so
    -- that the deletes (and the record of the chains they delete) are written once
    LOOP
        v_batch := runledger.prune_runs_v2(p_before, coalesce(p_keep_events, false), 10000);
        v_count := v_count + v_batch;
        EXIT WHEN v_batch < 10000;
    END LOOP;
    RETURN v_count;
END
$$;

-- prune_runs_v2: retention in batches. As prune_runs, but at most p_limit
-- runs (1-10000) per call, the oldest finished first (ix_runs_finished_at), each locked
-- with SKIP LOCKED: a run an operator holds is left for the next call, and no worker ever
-- waits on it (a worker holds only queued, running or paused runs, never touched here).
-- One call is one short transaction; `runledger prune` calls it until it returns fewer
-- than p_limit. Safe to repeat: a call whose acknowledgement was lost has deleted its
-- batch, and the next call deletes the next one. Events are kept unless p_keep_events is
-- false. Returns how many runs were deleted.
CREATE FUNCTION runledger.prune_runs_v2(p_before timestamptz, p_keep_events boolean,
                                        p_limit integer)
RETURNS integer
LANGUAGE plpgsql SECURITY DEFINER
SET search_path = pg_catalog, runledger, pg_temp
AS $$
DECLARE
    v_count integer;
    v_txid bigint;
BEGIN
    IF p_before IS NULL THEN
        PERFORM runledger._raise('RL006', 'before must not be null', NULL, NULL);
    END IF;
    IF p_keep_events IS NULL THEN
        PERFORM runledger._raise('RL006', 'keep events must be true or false', NULL, NULL);
    END IF;
    IF p_limit IS NULL OR p_limit < 1 OR p_limit > 10000 THEN
        PERFORM runledger._raise('RL006',
            format('limit must be 1-10000, got %s', coalesce(p_limit::text, 'NULL')), NULL,
            'prune in batches: call again until fewer than the limit are deleted');
    END IF;
    v_txid := txid_current();
    INSERT INTO runledger.prune_authorizations (txid) VALUES (v_txid) ON CONFLICT DO NOTHING;
    WITH batch AS (
        SELECT x.run_id FROM runledger.runs x
        WHERE x.finished_at < p_before AND x.status IN ('succeeded', 'failed', 'cancelled')
        ORDER BY x.finished_at
        LIMIT p_limit
        FOR UPDATE SKIP LOCKED
    ), gone AS (
        DELETE FROM runledger.runs x USING batch b
        WHERE x.run_id = b.run_id
        RETURNING x.run_id
    ), events AS (
        DELETE FROM runledger.run_events e
        WHERE NOT p_keep_events AND e.run_id IN (SELECT g.run_id FROM gone g)
        RETURNING e.run_id, e.event_id, e.hash
    ), chains AS (
        -- each deleted chain, so that audit tells it from a tampered one;
        -- and the database login that deleted it (session_user: this
        -- function runs as its owner, current_user would name the owner)
        INSERT INTO runledger.event_chain_prunes (run_id, last_event_id, last_hash, events,
                                                  pruned_at, pruned_by)
        SELECT DISTINCT ON (d.run_id) d.run_id, d.event_id, d.hash,
               count(*) OVER (PARTITION BY d.run_id), runledger.now(), session_user
        FROM events d ORDER BY d.run_id, d.event_id DESC
    )
    SELECT count(*) INTO v_count FROM gone;
    DELETE FROM runledger.prune_authorizations a WHERE a.txid = v_txid;
    RETURN v_count;
END
$$;

-- A checkpoint of the event chains (docs/audit.md). It records the head
-- (last event and its hash) of every run that has an event after the previous checkpoint,
-- up to a watermark, and chains its digest over the previous checkpoint's. A head that
-- later disagrees with its run's events (a deleted tail, a rehashed chain) is caught by
-- runledger audit, and so is a checkpoint removed or changed.
-- The watermark: the greatest event id read with run_events in SHARE mode, a lock that
-- waits for the transactions writing events to end (an id is drawn inside its INSERT,
-- after the table lock): every event up to it has committed, every later one has a
-- greater id. The lock is taken in a subtransaction that is rolled back at once, so
-- writers wait for it only while the greatest id is read (at most lock_timeout), never
-- while the heads are gathered. At most 500,000 events per checkpoint (a backlog takes
-- several, each a few seconds).
-- Skips (created false, the last checkpoint returned) when the last checkpoint is younger
-- than p_min_age, when another checkpoint is being made, when no event came since, or
-- when the lock was not granted within lock_timeout: the next call makes it. Workers call
-- it every 10 s (p_min_age 10 s), `runledger checkpoint` on demand.
CREATE FUNCTION runledger.checkpoint_events(p_actor text, p_min_age interval)
RETURNS TABLE (checkpoint_id bigint, at timestamptz, through_event_id bigint, runs integer,
               digest text, created boolean)
LANGUAGE plpgsql SECURITY DEFINER
SET search_path = pg_catalog, runledger, pg_temp
SET lock_timeout = '200ms'
AS $$
DECLARE
    v_last runledger.event_checkpoints;
    v_now timestamptz := runledger.now();
    v_through bigint;
    v_made boolean := false;
BEGIN
    PERFORM runledger._check_text('actor', p_actor, 1, runledger._cap('actor'));
    IF p_min_age IS NULL OR p_min_age < interval '0' THEN
        PERFORM runledger._raise('RL006', 'min age must be an interval of 0 or more', NULL,
            NULL);
    END IF;
    -- one checkpointer at a time (key: 'runledger checkpoint'); the others skip
    IF pg_try_advisory_xact_lock(hashtextextended('runledger checkpoint', 0)) THEN
        SELECT * INTO v_last FROM runledger.event_checkpoints k
        ORDER BY k.checkpoint_id DESC LIMIT 1;
        IF v_now - v_last.at >= p_min_age THEN
            BEGIN
                LOCK TABLE runledger.run_events IN SHARE MODE;
                SELECT max(e.event_id) INTO v_through FROM runledger.run_events e
                WHERE e.event_id > v_last.through_event_id;
                -- roll the subtransaction back: the lock goes, the value stays
                RAISE EXCEPTION USING ERRCODE = 'RL0WM';
            EXCEPTION
                WHEN SQLSTATE 'RL0WM' THEN
                    NULL;
                WHEN lock_not_available THEN
                    v_through := NULL;  -- event writers held the table past lock_timeout
            END;
            IF v_through IS NOT NULL THEN
                v_through := least(v_through, v_last.through_event_id + 500000);
                WITH heads AS (
                    SELECT DISTINCT ON (e.run_id) e.run_id, e.event_id,
                           coalesce(e.hash, ''::bytea) AS hash
                    FROM runledger.run_events e
                    WHERE e.event_id > v_last.through_event_id AND e.event_id <= v_through
                    ORDER BY e.run_id, e.event_id DESC
                ), made AS (
                    INSERT INTO runledger.event_checkpoints (checkpoint_id, at, actor,
                        through_event_id, runs, previous_digest, digest)
                    SELECT v_last.checkpoint_id + 1, v_now, p_actor, v_through, count(*),
                           v_last.digest,
                           runledger._checkpoint_digest(v_last.digest,
                               v_last.checkpoint_id + 1, v_through,
                               string_agg(h.run_id || ' ' || h.event_id || ' '
                                          || encode(h.hash, 'hex'), E'\n'
                                          ORDER BY h.run_id COLLATE "C"))
                    FROM heads h
                    RETURNING 1
                )
                INSERT INTO runledger.event_checkpoint_heads (checkpoint_id, run_id,
                                                              event_id, hash)
                SELECT v_last.checkpoint_id + 1, h.run_id, h.event_id, h.hash
                FROM heads h;  -- (made runs too: a WITH that writes always runs)
                v_made := true;
            END IF;
        END IF;
    END IF;
    RETURN QUERY
    SELECT k.checkpoint_id, k.at, k.through_event_id, k.runs, encode(k.digest, 'hex'), v_made
    FROM runledger.event_checkpoints k ORDER BY k.checkpoint_id DESC LIMIT 1;
END
$$;

-- Checkpoint 0: where the chains start. The events up to its through_event_id were
-- written before the chains began and carry no hash (none, on a fresh install).
INSERT INTO runledger.event_checkpoints (checkpoint_id, at, actor, through_event_id, runs,
                                         previous_digest, digest)
SELECT 0, runledger.now(), 'runledger migrate', coalesce(max(e.event_id), 0), 0, NULL,
       runledger._checkpoint_digest(NULL, 0, coalesce(max(e.event_id), 0), NULL)
FROM runledger.run_events e;

-- file: 06_wall.sql
-- ---------------------------------------------------------------------------------
-- The second wall: triggers that hold even for the owner's direct UPDATE
-- ---------------------------------------------------------------------------------
-- The guard functions are SECURITY DEFINER so that a refusal is always RL007 naming the
-- invariant: run as the writer, a role granted UPDATE on a table (a DBA role) would get
-- "permission denied for function _raise" instead, since helpers are not granted.
--
-- A DELETE passes only inside runledger.prune_runs: it writes the id of its transaction to
-- runledger.prune_authorizations (granted to no one) and removes it before returning.
-- No session setting stands in for that row. Who can still get past the wall: the owner
-- of the tables and superusers (they can write the authorization themselves, or disable,
-- drop or replace a trigger); docs/design.md, "The trigger wall", says what catches them.

-- True inside a prune_runs call of the current transaction (the guards' only door).
-- A helper, called by the guards and prune_runs (all pinned): no SET.
CREATE FUNCTION runledger._prune_authorized() RETURNS boolean
LANGUAGE sql STABLE
AS $$
    SELECT EXISTS (SELECT 1 FROM runledger.prune_authorizations a
                   WHERE a.txid = txid_current_if_assigned())
$$;

-- The authorization itself: written only by its owner's code (prune_runs), for the
-- current transaction. SECURITY INVOKER on purpose, to see who writes: a role that was
-- granted INSERT anyway (GRANT ... ON ALL TABLES IN SCHEMA runledger TO a DBA role) is
-- refused, and so is a row for another transaction id. RAISE directly: the writer may not
-- execute _raise.
CREATE FUNCTION runledger._guard_prune_authorizations() RETURNS trigger
LANGUAGE plpgsql
SET search_path = pg_catalog, runledger, pg_temp
AS $$
BEGIN
    IF NOT pg_has_role(current_user,
                       (SELECT c.relowner FROM pg_class c WHERE c.oid = TG_RELID), 'USAGE') THEN
        RAISE EXCEPTION USING ERRCODE = 'RL007',
            MESSAGE = format('prune authorizations are written only by runledger.prune_runs (%s refused for %s)',
                             TG_OP, current_user),
            HINT = 'call runledger.prune_runs(before, keep_events)';
    END IF;
    IF NEW.txid IS DISTINCT FROM txid_current() THEN
        RAISE EXCEPTION USING ERRCODE = 'RL007',
            MESSAGE = format('a prune authorization is for the current transaction only (%s, not %s)',
                             txid_current(), NEW.txid);
    END IF;
    RETURN NEW;
END
$$;
CREATE TRIGGER tg_prune_authorizations_guard BEFORE INSERT OR UPDATE
    ON runledger.prune_authorizations
    FOR EACH ROW EXECUTE FUNCTION runledger._guard_prune_authorizations();
ALTER TABLE runledger.prune_authorizations ENABLE ALWAYS TRIGGER tg_prune_authorizations_guard;

-- The WHEN of each guard trigger that the contract functions' UPDATEs fire
-- (tg_runs_guard, tg_runs_guard_columns, tg_run_calls_guard) calls a PL/pgSQL function of
-- the values it reads, whose body is the condition, as the CHECKs do (01_tables.sql):
-- PostgreSQL reads and prepares a trigger's WHEN again in every statement that fires it,
-- and a function call is a small node to read, its body compiled once per session. The
-- same rows fire the guard, so the same refusals. A WHEN runs with the writer's rights, so
-- these are executable by PUBLIC (a role granted UPDATE on a table meets the guard's
-- RL007, not a permission error), pure functions of their arguments. An inline condition
-- is bound when the trigger is created; a function's body is parsed in the writer's
-- session, with the writer's search path, so every operator in them is schema-qualified.
CREATE FUNCTION runledger._tw_runs_guard(old_token bigint, new_token bigint,
                                         old_version bigint, new_version bigint)
RETURNS boolean LANGUAGE plpgsql IMMUTABLE PARALLEL SAFE
AS $$ BEGIN
    RETURN new_token OPERATOR(pg_catalog.<) old_token
           OR new_version OPERATOR(pg_catalog.<) old_version
           OR new_version OPERATOR(pg_catalog.>) (old_version OPERATOR(pg_catalog.+) 1);
END $$;

-- The columns one by one, not the rows: a whole row would be built (every value stored
-- out of line fetched) for each call. state IS DISTINCT FROM is spelled with pg_catalog's =
-- (IS DISTINCT FROM would look = up in the writer's path); the state is compared only
-- when the version did not move by one, as before.
CREATE FUNCTION runledger._tw_runs_guard_columns(old_run_id text, new_run_id text,
                                                 old_version bigint, new_version bigint,
                                                 old_state jsonb, new_state jsonb,
                                                 old_flow text, new_flow text,
                                                 old_flow_version text, new_flow_version text,
                                                 old_input jsonb, new_input jsonb)
RETURNS boolean LANGUAGE plpgsql IMMUTABLE PARALLEL SAFE
AS $$ BEGIN
    RETURN new_run_id OPERATOR(pg_catalog.<>) old_run_id
           OR (new_version OPERATOR(pg_catalog.<>) (old_version OPERATOR(pg_catalog.+) 1)
               AND CASE WHEN new_state IS NULL OR old_state IS NULL
                        THEN (new_state IS NULL) OPERATOR(pg_catalog.<>) (old_state IS NULL)
                        ELSE NOT (new_state OPERATOR(pg_catalog.=) old_state) END)
           OR new_flow OPERATOR(pg_catalog.<>) old_flow
           OR new_flow_version OPERATOR(pg_catalog.<>) old_flow_version
           OR new_input OPERATOR(pg_catalog.<>) old_input;
END $$;

CREATE FUNCTION runledger._tw_run_calls_guard(old_status text, old_attempts integer,
                                              new_attempts integer, old_approval text,
                                              new_approval text)
RETURNS boolean LANGUAGE plpgsql IMMUTABLE PARALLEL SAFE
AS $$ BEGIN
    RETURN old_status OPERATOR(pg_catalog.=) 'succeeded'
           OR new_attempts OPERATOR(pg_catalog.<) old_attempts
           OR old_approval IS NOT NULL OR new_approval IS NOT NULL;
END $$;

CREATE FUNCTION runledger._guard_runs() RETURNS trigger
LANGUAGE plpgsql SECURITY DEFINER
SET search_path = pg_catalog, runledger, pg_temp
AS $$
BEGIN
    IF TG_OP = 'DELETE' THEN
        IF NOT runledger._prune_authorized() THEN
            PERFORM runledger._raise('RL007',
                format('runs are deleted only by runledger.prune_runs (run %s)', OLD.run_id),
                NULL, 'a session setting does not authorize a delete');
        END IF;
        IF OLD.status NOT IN ('succeeded', 'failed', 'cancelled') THEN
            PERFORM runledger._raise('RL007',
                format('run %s is %s: only finished runs are pruned', OLD.run_id, OLD.status),
                NULL, NULL);
        END IF;
        RETURN OLD;
    END IF;
    IF NEW.run_id <> OLD.run_id THEN
        PERFORM runledger._raise('RL007', format('run id %s cannot change', OLD.run_id), NULL, NULL);
    END IF;
    IF NEW.fencing_token < OLD.fencing_token THEN
        PERFORM runledger._raise('RL007',
            format('fencing_token of run %s cannot decrease', OLD.run_id),
            format('from %s to %s', OLD.fencing_token, NEW.fencing_token), NULL);
    END IF;
    IF NEW.state_version < OLD.state_version THEN
        PERFORM runledger._raise('RL007',
            format('state_version of run %s cannot decrease', OLD.run_id),
            format('from %s to %s', OLD.state_version, NEW.state_version), NULL);
    END IF;
    IF NEW.state_version > OLD.state_version + 1 THEN
        PERFORM runledger._raise('RL007',
            format('state_version of run %s moves by one at a time', OLD.run_id),
            format('from %s to %s', OLD.state_version, NEW.state_version), NULL);
    END IF;
    IF NEW.state IS DISTINCT FROM OLD.state AND NEW.state_version <> OLD.state_version + 1 THEN
        PERFORM runledger._raise('RL007',
            format('a change of state on run %s must bump state_version by exactly one', OLD.run_id),
            format('state_version %s -> %s', OLD.state_version, NEW.state_version), NULL);
    END IF;
    IF NEW.flow <> OLD.flow OR NEW.flow_version <> OLD.flow_version OR NEW.input <> OLD.input THEN
        PERFORM runledger._raise('RL007',
            format('flow, version and input of run %s are pinned', OLD.run_id), NULL, NULL);
    END IF;
    RETURN NEW;
END
$$;
-- The guard is called only for a row it refuses, not for every write. Its
-- refusals are split over the WHEN clauses of two UPDATE triggers (together, every IF of
-- the function: false exactly when those IFs are, NULL included; kept short, since a
-- WHEN is prepared again in every statement), and DELETE has a trigger of its own. Both
-- UPDATE triggers run the whole function, so the refusal (the first failed check, in the
-- function's order) is the same as when it ran for every row.
-- tg_runs_guard_columns watches the columns no contract function writes, and state
-- (checkpoint): UPDATE OF skips it, and its jsonb comparisons, when the statement sets
-- none of them (a column left out of SET keeps its value: no other trigger of the table
-- changes NEW).
CREATE TRIGGER tg_runs_guard BEFORE UPDATE ON runledger.runs
    FOR EACH ROW
    WHEN (runledger._tw_runs_guard(OLD.fencing_token, NEW.fencing_token, OLD.state_version,
                                   NEW.state_version))
    EXECUTE FUNCTION runledger._guard_runs();
ALTER TABLE runledger.runs ENABLE ALWAYS TRIGGER tg_runs_guard;
CREATE TRIGGER tg_runs_guard_columns
    BEFORE UPDATE OF run_id, state, flow, flow_version, input ON runledger.runs
    FOR EACH ROW
    WHEN (runledger._tw_runs_guard_columns(OLD.run_id, NEW.run_id, OLD.state_version,
                                           NEW.state_version, OLD.state, NEW.state, OLD.flow,
                                           NEW.flow, OLD.flow_version, NEW.flow_version,
                                           OLD.input, NEW.input))
    EXECUTE FUNCTION runledger._guard_runs();
ALTER TABLE runledger.runs ENABLE ALWAYS TRIGGER tg_runs_guard_columns;
CREATE TRIGGER tg_runs_guard_delete BEFORE DELETE ON runledger.runs
    FOR EACH ROW EXECUTE FUNCTION runledger._guard_runs();
ALTER TABLE runledger.runs ENABLE ALWAYS TRIGGER tg_runs_guard_delete;

CREATE FUNCTION runledger._guard_run_calls() RETURNS trigger
LANGUAGE plpgsql SECURITY DEFINER
SET search_path = pg_catalog, runledger, pg_temp
AS $$
BEGIN
    IF TG_OP = 'DELETE' THEN
        IF NOT runledger._prune_authorized() THEN
            PERFORM runledger._raise('RL007',
                format('calls are deleted only by runledger.prune_runs (%s)', OLD.idempotency_key),
                NULL, 'a session setting does not authorize a delete');
        END IF;
        RETURN OLD;
    END IF;
    IF NEW.idempotency_key <> OLD.idempotency_key OR NEW.run_id <> OLD.run_id
       OR NEW.turn <> OLD.turn OR NEW.call_id <> OLD.call_id OR NEW.tool <> OLD.tool
       OR NEW.args <> OLD.args OR NEW.provider_id IS DISTINCT FROM OLD.provider_id THEN
        PERFORM runledger._raise('RL007',
            format('call %s: key, tool, args and provider id are immutable', OLD.idempotency_key),
            NULL, NULL);
    END IF;
    IF OLD.status = 'succeeded' AND (NEW.status <> OLD.status
        OR NEW.result IS DISTINCT FROM OLD.result OR NEW.receipt IS DISTINCT FROM OLD.receipt) THEN
        PERFORM runledger._raise('RL007',
            format('call %s succeeded; its result and receipt cannot be overwritten',
                   OLD.idempotency_key),
            format('receipt %s', OLD.receipt), NULL);
    END IF;
    IF NEW.attempts < OLD.attempts THEN
        PERFORM runledger._raise('RL007',
            format('attempts of call %s cannot decrease', OLD.idempotency_key), NULL, NULL);
    END IF;
    -- an approval moves pending -> approved or pending -> denied, once; who
    -- decided, when and why never change afterwards
    IF NEW.approval IS DISTINCT FROM OLD.approval
       AND NOT coalesce(OLD.approval = 'pending' AND NEW.approval IN ('approved', 'denied'),
                        false) THEN
        PERFORM runledger._raise('RL007',
            format('approval of call %s cannot move from %s to %s', OLD.idempotency_key,
                   coalesce(OLD.approval, 'NULL'), coalesce(NEW.approval, 'NULL')),
            NULL, 'a pending approval is decided once, by approve_call or deny_call');
    END IF;
    IF OLD.approval IN ('approved', 'denied')
       AND (NEW.approval_by IS DISTINCT FROM OLD.approval_by
            OR NEW.approval_note IS DISTINCT FROM OLD.approval_note
            OR NEW.approval_at IS DISTINCT FROM OLD.approval_at) THEN
        PERFORM runledger._raise('RL007',
            format('call %s was %s by %s: the decision cannot be rewritten', OLD.idempotency_key,
                   OLD.approval, OLD.approval_by), NULL, NULL);
    END IF;
    RETURN NEW;
END
$$;
-- As the guard of runs, but its WHEN is a short superset of the refusals:
-- a call that succeeded, attempts going down, or any approval (so approve_call, deny_call
-- and the writes of an approved call still run the function, which decides). A trigger's
-- WHEN is read and prepared again in every statement, so the guard's whole condition
-- there cost more than the call it saved. The immutable columns, which no contract
-- function sets, are watched by tg_run_calls_guard_columns.
CREATE TRIGGER tg_run_calls_guard BEFORE UPDATE ON runledger.run_calls
    FOR EACH ROW
    WHEN (runledger._tw_run_calls_guard(OLD.status, OLD.attempts, NEW.attempts, OLD.approval,
                                        NEW.approval))
    EXECUTE FUNCTION runledger._guard_run_calls();
ALTER TABLE runledger.run_calls ENABLE ALWAYS TRIGGER tg_run_calls_guard;
CREATE TRIGGER tg_run_calls_guard_columns
    BEFORE UPDATE OF idempotency_key, run_id, turn, call_id, tool, args, provider_id
    ON runledger.run_calls
    FOR EACH ROW
    WHEN (NEW.idempotency_key <> OLD.idempotency_key OR NEW.run_id <> OLD.run_id
          OR NEW.turn <> OLD.turn OR NEW.call_id <> OLD.call_id OR NEW.tool <> OLD.tool
          OR NEW.args <> OLD.args OR NEW.provider_id IS DISTINCT FROM OLD.provider_id)
    EXECUTE FUNCTION runledger._guard_run_calls();
ALTER TABLE runledger.run_calls ENABLE ALWAYS TRIGGER tg_run_calls_guard_columns;
CREATE TRIGGER tg_run_calls_guard_delete BEFORE DELETE ON runledger.run_calls
    FOR EACH ROW EXECUTE FUNCTION runledger._guard_run_calls();
ALTER TABLE runledger.run_calls ENABLE ALWAYS TRIGGER tg_run_calls_guard_delete;

CREATE FUNCTION runledger._guard_run_turns() RETURNS trigger
LANGUAGE plpgsql SECURITY DEFINER
SET search_path = pg_catalog, runledger, pg_temp
AS $$
BEGIN
    IF TG_OP = 'DELETE' AND runledger._prune_authorized() THEN
        RETURN OLD;
    END IF;
    PERFORM runledger._raise('RL007',
        format('turn %s of run %s is a recorded decision and cannot change', OLD.turn, OLD.run_id),
        NULL, NULL);
    RETURN NULL;
END
$$;
CREATE TRIGGER tg_run_turns_guard BEFORE UPDATE OR DELETE ON runledger.run_turns
    FOR EACH ROW EXECUTE FUNCTION runledger._guard_run_turns();
ALTER TABLE runledger.run_turns ENABLE ALWAYS TRIGGER tg_run_turns_guard;

CREATE FUNCTION runledger._guard_run_events() RETURNS trigger
LANGUAGE plpgsql SECURITY DEFINER
SET search_path = pg_catalog, runledger, pg_temp
AS $$
BEGIN
    IF TG_OP = 'DELETE' AND runledger._prune_authorized() THEN
        RETURN OLD;
    END IF;
    PERFORM runledger._raise('RL007',
        format('run_events is append-only (%s refused)', TG_OP), NULL,
        'events are removed only by runledger.prune_runs');
    RETURN NULL;
END
$$;
CREATE TRIGGER tg_run_events_guard BEFORE UPDATE OR DELETE ON runledger.run_events
    FOR EACH ROW EXECUTE FUNCTION runledger._guard_run_events();
ALTER TABLE runledger.run_events ENABLE ALWAYS TRIGGER tg_run_events_guard;
CREATE TRIGGER tg_run_events_no_truncate BEFORE TRUNCATE ON runledger.run_events
    FOR EACH STATEMENT EXECUTE FUNCTION runledger._guard_run_events();
ALTER TABLE runledger.run_events ENABLE ALWAYS TRIGGER tg_run_events_no_truncate;

-- TRUNCATE fires no row trigger: without these, one statement by the owner would wipe
-- the journal that the DELETE guards above protect.
CREATE FUNCTION runledger._guard_truncate() RETURNS trigger
LANGUAGE plpgsql SECURITY DEFINER
SET search_path = pg_catalog, runledger, pg_temp
AS $$
BEGIN
    PERFORM runledger._raise('RL007',
        format('%s.%s cannot be truncated', TG_TABLE_SCHEMA, TG_TABLE_NAME), NULL,
        'runs, turns and calls are removed only by runledger.prune_runs');
    RETURN NULL;
END
$$;
CREATE TRIGGER tg_runs_no_truncate BEFORE TRUNCATE ON runledger.runs
    FOR EACH STATEMENT EXECUTE FUNCTION runledger._guard_truncate();
ALTER TABLE runledger.runs ENABLE ALWAYS TRIGGER tg_runs_no_truncate;
CREATE TRIGGER tg_run_turns_no_truncate BEFORE TRUNCATE ON runledger.run_turns
    FOR EACH STATEMENT EXECUTE FUNCTION runledger._guard_truncate();
ALTER TABLE runledger.run_turns ENABLE ALWAYS TRIGGER tg_run_turns_no_truncate;
CREATE TRIGGER tg_run_calls_no_truncate BEFORE TRUNCATE ON runledger.run_calls
    FOR EACH STATEMENT EXECUTE FUNCTION runledger._guard_truncate();
ALTER TABLE runledger.run_calls ENABLE ALWAYS TRIGGER tg_run_calls_no_truncate;


-- The record of failovers. runledger.timelines is append-only and
-- runledger.failover_runs too (its rows leave with their run, in prune_runs): without
-- them a failover would be forgotten, and with it the doubt on the calls of its runs. Both
-- are written only by their owner's code (the claim that detects a failover runs as the
-- owner): SECURITY INVOKER, to see who writes, and RAISE directly, as for the pruning
-- authorization (the writer may not execute _raise or _prune_authorized).
CREATE FUNCTION runledger._guard_failover_record() RETURNS trigger
LANGUAGE plpgsql
SET search_path = pg_catalog, runledger, pg_temp
AS $$
BEGIN
    IF NOT pg_has_role(current_user,
                       (SELECT c.relowner FROM pg_class c WHERE c.oid = TG_RELID), 'USAGE') THEN
        RAISE EXCEPTION USING ERRCODE = 'RL007',
            MESSAGE = format('%s is written only by runledger''s claims (%s refused for %s)',
                             TG_TABLE_NAME, TG_OP, current_user);
    END IF;
    IF TG_OP = 'INSERT' THEN
        RETURN NEW;
    END IF;
    IF TG_OP = 'DELETE' AND TG_TABLE_NAME = 'failover_runs' THEN
        IF runledger._prune_authorized() THEN
            RETURN OLD;
        END IF;
    END IF;
    RAISE EXCEPTION USING ERRCODE = 'RL007',
        MESSAGE = format('%s is append-only (%s refused)', TG_TABLE_NAME, TG_OP),
        HINT = 'failover_runs rows are removed with their run, by runledger.prune_runs';
END
$$;
CREATE TRIGGER tg_timelines_guard BEFORE INSERT OR UPDATE OR DELETE ON runledger.timelines
    FOR EACH ROW EXECUTE FUNCTION runledger._guard_failover_record();
ALTER TABLE runledger.timelines ENABLE ALWAYS TRIGGER tg_timelines_guard;
CREATE TRIGGER tg_timelines_no_truncate BEFORE TRUNCATE ON runledger.timelines
    FOR EACH STATEMENT EXECUTE FUNCTION runledger._guard_failover_record();
ALTER TABLE runledger.timelines ENABLE ALWAYS TRIGGER tg_timelines_no_truncate;
CREATE TRIGGER tg_failover_runs_guard BEFORE INSERT OR UPDATE OR DELETE
    ON runledger.failover_runs
    FOR EACH ROW EXECUTE FUNCTION runledger._guard_failover_record();
ALTER TABLE runledger.failover_runs ENABLE ALWAYS TRIGGER tg_failover_runs_guard;
CREATE TRIGGER tg_failover_runs_no_truncate BEFORE TRUNCATE ON runledger.failover_runs
    FOR EACH STATEMENT EXECUTE FUNCTION runledger._guard_failover_record();
ALTER TABLE runledger.failover_runs ENABLE ALWAYS TRIGGER tg_failover_runs_no_truncate;


-- The checkpoints of the event chains are append-only, and the record of
-- pruned chains is written only by prune_runs. No role may write these tables directly;
-- the guards stop their owner too (a superuser who disables them is caught by audit
-- against a digest kept outside the database: docs/audit.md).
CREATE FUNCTION runledger._guard_event_chain() RETURNS trigger
LANGUAGE plpgsql SECURITY DEFINER
SET search_path = pg_catalog, runledger, pg_temp
AS $$
BEGIN
    IF TG_OP = 'INSERT' AND (TG_TABLE_NAME <> 'event_chain_prunes'
                             OR runledger._prune_authorized()) THEN
        RETURN NEW;
    END IF;
    PERFORM runledger._raise('RL007',
        format('%s is append-only (%s refused)', TG_TABLE_NAME, TG_OP), NULL,
        CASE WHEN TG_TABLE_NAME = 'event_chain_prunes'
             THEN 'rows are written by runledger.prune_runs only'
             ELSE 'checkpoints are written by runledger.checkpoint_events only' END);
    RETURN NULL;
END
$$;
CREATE TRIGGER tg_event_checkpoints_guard BEFORE UPDATE OR DELETE
    ON runledger.event_checkpoints
    FOR EACH ROW EXECUTE FUNCTION runledger._guard_event_chain();
ALTER TABLE runledger.event_checkpoints ENABLE ALWAYS TRIGGER tg_event_checkpoints_guard;
CREATE TRIGGER tg_event_checkpoints_no_truncate BEFORE TRUNCATE ON runledger.event_checkpoints
    FOR EACH STATEMENT EXECUTE FUNCTION runledger._guard_event_chain();
ALTER TABLE runledger.event_checkpoints ENABLE ALWAYS TRIGGER tg_event_checkpoints_no_truncate;
CREATE TRIGGER tg_event_checkpoint_heads_guard BEFORE UPDATE OR DELETE
    ON runledger.event_checkpoint_heads
    FOR EACH ROW EXECUTE FUNCTION runledger._guard_event_chain();
ALTER TABLE runledger.event_checkpoint_heads ENABLE ALWAYS TRIGGER tg_event_checkpoint_heads_guard;
CREATE TRIGGER tg_event_checkpoint_heads_no_truncate BEFORE TRUNCATE
    ON runledger.event_checkpoint_heads
    FOR EACH STATEMENT EXECUTE FUNCTION runledger._guard_event_chain();
ALTER TABLE runledger.event_checkpoint_heads
    ENABLE ALWAYS TRIGGER tg_event_checkpoint_heads_no_truncate;
CREATE TRIGGER tg_event_chain_prunes_guard BEFORE INSERT OR UPDATE OR DELETE
    ON runledger.event_chain_prunes
    FOR EACH ROW EXECUTE FUNCTION runledger._guard_event_chain();
ALTER TABLE runledger.event_chain_prunes ENABLE ALWAYS TRIGGER tg_event_chain_prunes_guard;
CREATE TRIGGER tg_event_chain_prunes_no_truncate BEFORE TRUNCATE
    ON runledger.event_chain_prunes
    FOR EACH STATEMENT EXECUTE FUNCTION runledger._guard_event_chain();
ALTER TABLE runledger.event_chain_prunes ENABLE ALWAYS TRIGGER tg_event_chain_prunes_no_truncate;

-- file: 07_views.sql
-- ---------------------------------------------------------------------------------
-- Audit views
-- ---------------------------------------------------------------------------------

CREATE VIEW runledger.run_timeline AS
SELECT e.run_id, e.event_id, e.at, e.kind, e.actor, e.fencing_token, e.state_version, e.detail
FROM runledger.run_events e;

CREATE VIEW runledger.effect_ledger AS
SELECT c.idempotency_key, c.run_id, c.turn, c.call_id, c.tool, c.status, c.attempts,
       c.args, c.result, c.receipt, c.error,
       c.dispatched_by, c.dispatched_token, c.dispatched_at,
       c.completed_by, c.completed_token, c.completed_at,
       c.resolved_by, c.resolved_at, c.resolution_note,
       r.flow, r.flow_version
FROM runledger.run_calls c JOIN runledger.runs r USING (run_id);

CREATE VIEW runledger.lease_history AS
SELECT e.run_id, e.event_id, e.at, e.kind, e.actor AS worker_id, e.fencing_token,
       (e.detail ->> 'lease_id')::uuid AS lease_id,
       (e.detail ->> 'lease_expires_at')::timestamptz AS lease_expires_at,
       e.detail ->> 'previous_owner' AS previous_owner,
       (e.detail ->> 'previous_token')::bigint AS previous_token
FROM runledger.run_events e
WHERE e.kind IN ('claimed', 'takeover', 'lease_released', 'renewal_failed',
                 'stale_write_rejected', 'run_succeeded', 'run_failed', 'run_paused',
                 'run_cancelled');

-- file: 08_roles.sql
-- ---------------------------------------------------------------------------------
-- Privileges and roles
-- ---------------------------------------------------------------------------------

REVOKE ALL ON ALL FUNCTIONS IN SCHEMA runledger FROM PUBLIC;
-- The functions the CHECK constraints call, to anyone who may write the
-- tables (a CHECK's function is executed with the writer's rights). Pure functions of
-- their arguments, every name in them schema-qualified: nothing to gain by calling them.
GRANT EXECUTE ON FUNCTION runledger._ck_runs_run_id(text) TO PUBLIC;
GRANT EXECUTE ON FUNCTION runledger._ck_runs_status(text) TO PUBLIC;
GRANT EXECUTE ON FUNCTION runledger._ck_runs_input_object(jsonb) TO PUBLIC;
GRANT EXECUTE ON FUNCTION runledger._ck_runs_state_object(jsonb) TO PUBLIC;
GRANT EXECUTE ON FUNCTION runledger._ck_runs_lease_complete(uuid, timestamptz) TO PUBLIC;
GRANT EXECUTE ON FUNCTION runledger._ck_runs_running_has_lease(text, uuid) TO PUBLIC;
GRANT EXECUTE ON FUNCTION runledger._ck_runs_finished_at(text, timestamptz) TO PUBLIC;
GRANT EXECUTE ON FUNCTION runledger._ck_runs_traceparent(text) TO PUBLIC;
GRANT EXECUTE ON FUNCTION runledger._ck_run_turns_turn(integer) TO PUBLIC;
GRANT EXECUTE ON FUNCTION runledger._ck_run_turns_calls_array(jsonb) TO PUBLIC;
GRANT EXECUTE ON FUNCTION runledger._ck_run_turns_record_object(jsonb) TO PUBLIC;
GRANT EXECUTE ON FUNCTION runledger._ck_run_turns_output_final(jsonb, jsonb) TO PUBLIC;
GRANT EXECUTE ON FUNCTION runledger._ck_run_calls_status(text) TO PUBLIC;
GRANT EXECUTE ON FUNCTION runledger._ck_run_calls_args_object(jsonb) TO PUBLIC;
GRANT EXECUTE ON FUNCTION runledger._ck_run_calls_attempts(integer) TO PUBLIC;
GRANT EXECUTE ON FUNCTION runledger._ck_run_calls_key(text, text, integer, text) TO PUBLIC;
GRANT EXECUTE ON FUNCTION runledger._ck_run_calls_approval(text) TO PUBLIC;
GRANT EXECUTE ON FUNCTION runledger._ck_run_calls_approval_status(text, text) TO PUBLIC;
GRANT EXECUTE ON FUNCTION runledger._ck_run_calls_approval_decided(text, text, timestamptz, text) TO PUBLIC;
GRANT EXECUTE ON FUNCTION runledger._ck_run_events_hash(bytea) TO PUBLIC;
-- what the guard triggers' WHEN clauses call
GRANT EXECUTE ON FUNCTION runledger._tw_runs_guard(bigint, bigint, bigint, bigint) TO PUBLIC;
GRANT EXECUTE ON FUNCTION runledger._tw_runs_guard_columns(text, text, bigint, bigint, jsonb, jsonb, text, text, text, text, jsonb, jsonb) TO PUBLIC;
GRANT EXECUTE ON FUNCTION runledger._tw_run_calls_guard(text, integer, integer, text, text) TO PUBLIC;
REVOKE ALL ON ALL TABLES IN SCHEMA runledger FROM PUBLIC;

-- runledger.prune_authorizations is granted to no one: it is written by prune_runs and read
-- by the guard triggers, both as the owner (06_wall.sql). The SELECT ON ALL TABLES below
-- would include it, so it is taken back at once.

DO $roles$
DECLARE
    v_role text;
BEGIN
    FOREACH v_role IN ARRAY ARRAY['runledger_worker', 'runledger_operator', 'runledger_auditor'] LOOP
        IF NOT EXISTS (SELECT 1 FROM pg_roles WHERE rolname = v_role) THEN
            BEGIN
                EXECUTE format('CREATE ROLE %I NOLOGIN', v_role);
            EXCEPTION WHEN insufficient_privilege OR duplicate_object THEN
                RAISE WARNING 'runledger: could not create role % (%); create it as an admin and run "runledger migrate" again, or grant privileges by hand',
                    v_role, SQLERRM;
            END;
        END IF;
    END LOOP;

    IF EXISTS (SELECT 1 FROM pg_roles WHERE rolname = 'runledger_auditor') THEN
        GRANT USAGE ON SCHEMA runledger TO runledger_auditor;
        GRANT SELECT ON ALL TABLES IN SCHEMA runledger TO runledger_auditor;
        REVOKE ALL ON runledger.prune_authorizations FROM runledger_auditor;
        -- the clock, which every read of the CLI judges by (read-only)
        GRANT EXECUTE ON FUNCTION runledger.now() TO runledger_auditor;
    END IF;
    IF EXISTS (SELECT 1 FROM pg_roles WHERE rolname = 'runledger_worker') THEN
        -- alembic_version: a worker checks the schema revision when it connects (and
        -- /readyz does); without it a worker logged in in this role cannot start.
        GRANT USAGE ON SCHEMA runledger TO runledger_worker;
        GRANT SELECT ON runledger.runs, runledger.run_turns, runledger.run_calls,
                        runledger.run_events, runledger.workers, runledger.settings,
                        runledger.timelines, runledger.failover_runs,
                        runledger.event_checkpoints, runledger.event_checkpoint_heads,
                        runledger.event_chain_prunes,
                        runledger.run_timeline, runledger.effect_ledger, runledger.lease_history,
                        runledger.alembic_version
            TO runledger_worker;
        GRANT EXECUTE ON FUNCTION
            runledger.now(),
            runledger.submit_run(text, text, text, jsonb, int, timestamptz),
            runledger.submit_run_v2(text, text, text, jsonb, int, timestamptz, text),
            runledger.claim_runs_v4(text, text[], interval, int),
            runledger.renew_leases(text, text[], uuid[], interval),
            runledger.checkpoint(text, uuid, bigint, bigint, jsonb),
            runledger.record_turn_v4(text, uuid, bigint, int, jsonb, jsonb, jsonb, bigint, jsonb,
                                     boolean, text[]),
            runledger.finish_and_claim(text, uuid, bigint, int, jsonb, jsonb, bigint, jsonb, text,
                                       text[], interval, int),
            runledger.dispatch_call(text, uuid, bigint, text),
            runledger.complete_call(text, uuid, bigint, text, text, jsonb, jsonb),
            runledger.complete_call_v2(text, uuid, bigint, text, text, jsonb, jsonb, text),
            runledger.complete_calls(text, uuid, bigint, text[], text[], jsonb[], jsonb[], text),
            runledger.finish_run(text, uuid, bigint, text, jsonb, text),
            runledger.release_lease(text, uuid, bigint),
            runledger.release_lease(text, uuid, bigint, text, jsonb),
            runledger.report_stale_write(text, text, uuid, bigint, text, text),
            runledger.register_worker_v2(text, text, int, text[], boolean, text, uuid, boolean,
                                         interval, text),
            runledger.call_sender(text, uuid, bigint, text),
            runledger.release_call(text, uuid, bigint, text, text, jsonb),
            runledger.heartbeat_listener(text),
            runledger.heartbeat_worker(text, boolean, uuid),
            runledger.checkpoint_events(text, interval)
        TO runledger_worker;
    END IF;
    IF EXISTS (SELECT 1 FROM pg_roles WHERE rolname = 'runledger_operator') THEN
        IF EXISTS (SELECT 1 FROM pg_roles WHERE rolname = 'runledger_worker')
           AND NOT pg_has_role('runledger_operator', 'runledger_worker', 'MEMBER') THEN
            BEGIN
                GRANT runledger_worker TO runledger_operator;
            EXCEPTION WHEN insufficient_privilege THEN
                RAISE WARNING 'runledger: could not make runledger_operator a member of runledger_worker (%); grant it as an admin',
                    SQLERRM;
            END;
        END IF;
        GRANT USAGE ON SCHEMA runledger TO runledger_operator;
        GRANT SELECT ON ALL TABLES IN SCHEMA runledger TO runledger_operator;
        REVOKE ALL ON runledger.prune_authorizations FROM runledger_operator;
        GRANT EXECUTE ON FUNCTION
            runledger.now(),
            runledger.submit_run(text, text, text, jsonb, int, timestamptz),
            runledger.submit_run_v2(text, text, text, jsonb, int, timestamptz, text),
            runledger.resolve_call(text, text, jsonb, text, text),
            runledger.approve_call(text, text, text),
            runledger.deny_call(text, text, text),
            runledger.cancel_run(text, text, text),
            runledger.retry_run(text, text),
            runledger.prune_runs(timestamptz, boolean),
            runledger.prune_runs_v2(timestamptz, boolean, integer)
        TO runledger_operator;
    END IF;
END
$roles$;
