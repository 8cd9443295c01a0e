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
-- Append-only (06_wall.sql) but for retention: runledger.prune_records deletes the oldest
-- checkpoints with their heads (never checkpoint 0, nor the newest) and records what it
-- deleted in event_checkpoint_prunes. An auditor who keeps a digest outside the database
-- can tell a rewritten history from the true one (runledger audit --expect).
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
-- the heads of one run (runledger.prune_records: is a head the run's newest, is a
-- pruned chain's record still needed)
CREATE INDEX ix_event_checkpoint_heads_run_id
    ON runledger.event_checkpoint_heads (run_id, event_id);
-- The chains prune_runs deleted (with keep events false), one row per run:
-- its last event and that event's hash. A checkpoint head of such a run is not missing
-- but pruned. Written only by prune_runs (the pruning authorization); deleted only by
-- prune_records, once no checkpoint head of the chain is left and the row is older than
-- its cutoff.
CREATE TABLE runledger.event_chain_prunes (
    run_id text NOT NULL,
    last_event_id bigint NOT NULL,
    last_hash bytea,
    events integer NOT NULL,
    pruned_at timestamptz NOT NULL,
    pruned_by text,  -- the database login (NULL: not recorded)
    CONSTRAINT pk_event_chain_prunes PRIMARY KEY (run_id, last_event_id)
);
CREATE INDEX ix_event_chain_prunes_pruned_at ON runledger.event_chain_prunes (pruned_at);
-- The checkpoints runledger.prune_records deleted, one row per call that deleted some:
-- every checkpoint from 1 through through_checkpoint_id is gone, and digest is that
-- checkpoint's digest, the previous_digest of the oldest checkpoint kept after
-- checkpoint 0 (audit checks the chain from there). through_at: when that checkpoint was
-- made. The heads it deleted that still pinned a chain left in run_events were carried
-- into a new checkpoint, carried_into (NULL: none to carry). Written and deleted only by
-- prune_records (the pruning authorization), which keeps the newest row and those
-- younger than its cutoff.
CREATE TABLE runledger.event_checkpoint_prunes (
    through_checkpoint_id bigint NOT NULL,
    digest bytea NOT NULL,
    through_at timestamptz NOT NULL,
    checkpoints integer NOT NULL,
    heads integer NOT NULL,
    carried integer NOT NULL,
    carried_into bigint,
    pruned_at timestamptz NOT NULL,
    pruned_by text,  -- the database login
    CONSTRAINT pk_event_checkpoint_prunes PRIMARY KEY (through_checkpoint_id)
);

-- One row per worker id (a process's, by default): prune_records deletes those whose last
-- heartbeat is older than its cutoff, unless a running run or a call in flight names them.
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
    -- how far the worker's host clock is ahead of the database's (negative: behind), as
    -- the worker measured it on its round trips and said with its last heartbeat; NULL:
    -- not said. The worker itself judges every time by the database's clock
    clock_offset interval,
    CONSTRAINT pk_workers PRIMARY KEY (worker_id)
);

-- The pruning authorization (see 06_wall.sql): runledger.prune_runs (and prune_records)
-- writes the id of its own transaction here, deletes, and removes the row before it returns; the delete guards
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
-- how many unfinished runs were affected. lossless: whether the commits before the
-- promotion were acknowledged only once every synchronous standby had them, as the last
-- row of commit_guarantees says (evidence: that row); NULL for position 1. A lossless
-- failover ends the leases of the old timeline and doubts nothing. See docs/failover.md.
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
    lossless boolean,
    evidence jsonb,
    CONSTRAINT pk_timelines PRIMARY KEY (position),
    CONSTRAINT ck_timelines_timeline CHECK (timeline >= 1)
);

-- How the commits of the workers' sessions were acknowledged, as their claims saw it: a
-- row each time a claim finds synchronous_commit (the claiming session's) or
-- synchronous_standby_names (the server's) other than the last row says. Read when a
-- failover is detected, and judged then by runledger._synchronous: the evidence of
-- whether it could lose an acknowledged commit (docs/failover.md). Append-only, like
-- timelines, but for retention: prune_records deletes the rows older than its cutoff,
-- never the newest.
CREATE TABLE runledger.commit_guarantees (
    position integer NOT NULL,
    synchronous_commit text NOT NULL,
    synchronous_standby_names text NOT NULL,
    timeline integer NOT NULL,
    seen_at timestamptz NOT NULL,
    seen_by text,
    CONSTRAINT pk_commit_guarantees PRIMARY KEY (position)
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
