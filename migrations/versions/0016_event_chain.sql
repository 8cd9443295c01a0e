-- runledger 0016: a tamper-evident event log (issue "Operate and observe", deliverable 2).
-- Every run_events row carries its link in the run's hash chain (run_events.hash, by
-- runledger._event_hash); runledger.checkpoint_events records the chain heads, chained
-- by digest; prune_runs records the chains it deletes (event_chain_prunes); the three new
-- tables are append-only. _event locks the run's last event row before it reads its
-- hash, so one run's events are appended one at a time.
-- The events written before this revision carry no hash: checkpoint 0 says up to which id.
-- Frozen once merged: change things in a new revision (and in the living files).

ALTER TABLE runledger.run_events ADD COLUMN hash bytea,
    ADD CONSTRAINT ck_run_events_hash CHECK (hash IS NULL OR octet_length(hash) = 32);

-- Revision 0016: checkpoints of the event chains. A checkpoint is made with no event
-- write in flight (runledger.checkpoint_events): every event up to through_event_id had
-- committed, and each run with an event after the previous checkpoint's through_event_id
-- has its head (its last event then) in event_checkpoint_heads. digest chains the
-- checkpoints: runledger._checkpoint_digest over the previous digest, this checkpoint's
-- id and through_event_id, and its heads. Checkpoint 0 is written by the schema itself:
-- the events up to its through_event_id were written before 0016 and carry no hash.
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
-- Revision 0016: the chains prune_runs deleted (with keep events false), one row per run:
-- its last event and that event's hash. A checkpoint head of such a run is not missing
-- but pruned. Written only by prune_runs (the pruning authorization); append-only.
CREATE TABLE runledger.event_chain_prunes (
    run_id text NOT NULL,
    last_event_id bigint NOT NULL,
    last_hash bytea,
    events integer NOT NULL,
    pruned_at timestamptz NOT NULL,
    CONSTRAINT pk_event_chain_prunes PRIMARY KEY (run_id, last_event_id)
);

-- Revision 0016: the link of an event in its run's hash chain. sha256 over the previous
-- event's hash (none for a run's first event, or the first after revision 0016) and the
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

-- Revision 0016: a checkpoint's digest, chained over the previous one. heads: the
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

-- The only INSERT into run_events. Callers pass the event kind as a literal, so a grep
-- for it finds the writer. p_at: the function's one reading of the clock when the event
-- belongs to a set-based statement (claims, renewals); otherwise the clock now.
-- PL/pgSQL since revision 0007: a SQL function that is not inlined (an INSERT never is)
-- parses and plans its body at every call site in every transaction; PL/pgSQL plans the
-- INSERT once per session.
-- Revision 0015: an event that changes what an operator sees of a run (not the per-call
-- and per-turn ones) is also sent on NOTIFY channel runledger_events, payload
-- '<event_id> <run_id> <kind>', at commit (a rolled-back event sends nothing). Nor
-- 'claimed': a commit that notifies wakes every listening session of the database (each
-- worker's listener reads the queue in a transaction of its own), and a claim's commit
-- notifies nothing else; a run's end, a pause or an operator's act is what is sent.
-- 'submitted' costs no wake-up: its commit wakes the claimers (runledger_runs) anyway.
-- Revision 0016: the event carries its link in the run's hash chain. One run's events are
-- appended one at a time: the writer locks the run's last event row (FOR UPDATE; event
-- rows never change, so a waiter gets the same row once the holder ends), then reads the
-- last hash again in a new snapshot, which has the holder's event. Not the run's row
-- lock: the writers of renewal_failed and stale_write_rejected do not hold it, and a
-- lock on the run would make a concurrent claim skip it. A row lock takes no slot in the
-- lock table, so a failover that marks a million runs writes their events in one
-- transaction. The event id is drawn inside the INSERT, after its table lock:
-- runledger.checkpoint_events, which takes the table in SHARE mode, never misses an id
-- drawn before it and inserted after it.
CREATE OR REPLACE FUNCTION runledger._event(p_run_id text, p_kind text, p_actor text,
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
    PERFORM e.event_id FROM runledger.run_events e
    WHERE e.run_id = p_run_id ORDER BY e.event_id DESC LIMIT 1 FOR UPDATE;
    SELECT e.hash INTO v_previous FROM runledger.run_events e
    WHERE e.run_id = p_run_id ORDER BY e.event_id DESC LIMIT 1;
    INSERT INTO runledger.run_events (event_id, run_id, at, kind, actor, fencing_token,
                                      state_version, detail, hash)
    SELECT n.id, p_run_id, v_at, p_kind, p_actor, p_fencing_token, p_state_version, v_detail,
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

-- Retention: the only path allowed to delete events, calls and runs. It authorizes its
-- own deletes with a row for its transaction in runledger.prune_authorizations (which no
-- caller can write) and removes that row before it returns, so no door stays open for
-- the rest of the caller's transaction. Only finished runs are deleted (the guard of
-- runs checks it again).
CREATE OR REPLACE FUNCTION runledger.prune_runs(p_before timestamptz, p_keep_events boolean)
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
    -- revision 0016: prune_runs_v2's batches, one after the other in this transaction, so
    -- that the deletes (and the record of the chains they delete) are written once
    LOOP
        v_batch := runledger.prune_runs_v2(p_before, coalesce(p_keep_events, false), 10000);
        v_count := v_count + v_batch;
        EXIT WHEN v_batch < 10000;
    END LOOP;
    RETURN v_count;
END
$$;

-- prune_runs_v2 (revision 0014): retention in batches. As prune_runs, but at most p_limit
-- runs (1-10000) per call, the oldest finished first (ix_runs_finished_at), each locked
-- with SKIP LOCKED: a run an operator holds is left for the next call, and no worker ever
-- waits on it (a worker holds only queued, running or paused runs, never touched here).
-- One call is one short transaction; `runledger prune` calls it until it returns fewer
-- than p_limit. Safe to repeat: a call whose acknowledgement was lost has deleted its
-- batch, and the next call deletes the next one. Events are kept unless p_keep_events is
-- false. Returns how many runs were deleted.
CREATE OR REPLACE FUNCTION runledger.prune_runs_v2(p_before timestamptz, p_keep_events boolean,
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
        -- revision 0016: each deleted chain, so that audit tells it from a tampered one
        INSERT INTO runledger.event_chain_prunes (run_id, last_event_id, last_hash, events,
                                                  pruned_at)
        SELECT DISTINCT ON (d.run_id) d.run_id, d.event_id, d.hash,
               count(*) OVER (PARTITION BY d.run_id), runledger.now()
        FROM events d ORDER BY d.run_id, d.event_id DESC
    )
    SELECT count(*) INTO v_count FROM gone;
    DELETE FROM runledger.prune_authorizations a WHERE a.txid = v_txid;
    RETURN v_count;
END
$$;

-- Revision 0016: a checkpoint of the event chains (docs/audit.md). It records the head
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
-- written before revision 0016 and carry no hash (none, on a schema installed at 0016).
INSERT INTO runledger.event_checkpoints (checkpoint_id, at, actor, through_event_id, runs,
                                         previous_digest, digest)
SELECT 0, runledger.now(), 'runledger migrate', coalesce(max(e.event_id), 0), 0, NULL,
       runledger._checkpoint_digest(NULL, 0, coalesce(max(e.event_id), 0), NULL)
FROM runledger.run_events e;

-- Revision 0016: the checkpoints of the event chains are append-only, and the record of
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

REVOKE ALL ON FUNCTION runledger._event_hash(bytea, bigint, text, timestamptz, text, text,
                                           bigint, bigint, jsonb),
    runledger._checkpoint_digest(bytea, bigint, bigint, text),
    runledger.checkpoint_events(text, interval),
    runledger._guard_event_chain() FROM PUBLIC;
REVOKE ALL ON runledger.event_checkpoints, runledger.event_checkpoint_heads,
    runledger.event_chain_prunes FROM PUBLIC;
DO $roles$
BEGIN
    IF EXISTS (SELECT 1 FROM pg_roles WHERE rolname = 'runledger_auditor') THEN
        GRANT SELECT ON runledger.event_checkpoints, runledger.event_checkpoint_heads,
            runledger.event_chain_prunes TO runledger_auditor;
    END IF;
    IF EXISTS (SELECT 1 FROM pg_roles WHERE rolname = 'runledger_worker') THEN
        GRANT SELECT ON runledger.event_checkpoints, runledger.event_checkpoint_heads,
            runledger.event_chain_prunes TO runledger_worker;
        GRANT EXECUTE ON FUNCTION runledger.checkpoint_events(text, interval)
            TO runledger_worker;
    END IF;
    IF EXISTS (SELECT 1 FROM pg_roles WHERE rolname = 'runledger_operator') THEN
        GRANT SELECT ON runledger.event_checkpoints, runledger.event_checkpoint_heads,
            runledger.event_chain_prunes TO runledger_operator;
    END IF;
END
$roles$;
