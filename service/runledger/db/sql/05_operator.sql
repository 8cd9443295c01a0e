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

-- prune_records: retention of what the runs leave behind, in batches. Through the same
-- authorization as prune_runs_v2 (its own row in prune_authorizations, removed before it
-- returns), in one short transaction:
--   * the checkpoints of the event chains made before p_before, oldest first, with their
--     heads, at most p_limit heads a call (at least one checkpoint): never checkpoint 0
--     (where the chains start: the events up to its through_event_id carry no hash) nor
--     the newest (where the next checkpoint starts). A deleted head that is still the
--     newest head of its run, of a chain no event_chain_prunes row covers, still pins a
--     chain in run_events: with p_keep_events false, a chain whose run is gone (its events
--     kept by an earlier prune) and whose last event is that head and older than p_before
--     is deleted, recorded in event_chain_prunes as prune_runs_v2 does; every other such
--     head is carried: copied into a checkpoint this call makes after the newest one (the
--     same through_event_id, the digest formula of checkpoint_events, actor
--     'runledger prune'), so every chain left stays pinned, and a tampered head stays
--     visible. The deleted range and its last digest (the previous_digest of the oldest
--     checkpoint kept after checkpoint 0) go to event_checkpoint_prunes;
--   * at most p_limit event_checkpoint_prunes rows older than p_before, but the newest
--     (audit reads it);
--   * at most p_limit event_chain_prunes rows older than p_before that no checkpoint head
--     needs any more;
--   * at most p_limit workers whose last heartbeat (and stop) is older than p_before,
--     holding no running run and no call in flight of an unfinished run (a sender's row
--     tells the next holder whether its process is gone);
--   * at most p_limit commit_guarantees rows older than p_before, but the newest: the next
--     failover is judged by it (a timelines row keeps a copy of the row it was judged by).
-- It holds the checkpointer's lock (key 'runledger checkpoint') for the call: a worker's
-- checkpoint_events skips meanwhile, and a checkpoint being made is waited for. timelines
-- and failover_runs are not touched: a timeline is added only by a failover or a restore,
-- and failover_runs rows go with their runs (prune_runs_v2). Returns how many of each were
-- deleted, how many heads were carried, and whether more is left to delete (more: call
-- again). Safe to repeat.
CREATE FUNCTION runledger.prune_records(p_before timestamptz, p_keep_events boolean,
                                        p_limit integer)
RETURNS TABLE (checkpoints integer, heads integer, carried integer, chains integer,
               checkpoint_prunes integer, chain_prunes integer, workers integer,
               commit_guarantees integer, more boolean)
LANGUAGE plpgsql SECURITY DEFINER
SET search_path = pg_catalog, runledger, pg_temp
AS $$
DECLARE
    v_txid bigint;
    v_now timestamptz := runledger.now();
    v_last runledger.event_checkpoints;
    v_through runledger.event_checkpoints;
    v_runs text[];
    v_events bigint[];
    v_hashes bytea[];
    v_gone text[] := '{}';
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
            'prune in batches: call again while more is true');
    END IF;
    checkpoints := 0; heads := 0; carried := 0; chains := 0; checkpoint_prunes := 0;
    chain_prunes := 0; workers := 0; commit_guarantees := 0;
    v_txid := txid_current();
    INSERT INTO runledger.prune_authorizations (txid) VALUES (v_txid) ON CONFLICT DO NOTHING;

    -- the checkpoints: no other checkpoint is made until this transaction ends
    PERFORM pg_advisory_xact_lock(hashtextextended('runledger checkpoint', 0));
    SELECT * INTO v_last FROM runledger.event_checkpoints k
    ORDER BY k.checkpoint_id DESC LIMIT 1;
    -- the batch: the oldest checkpoints after 0 (and before the newest), every one made
    -- before p_before, with at most p_limit heads in all (at least one checkpoint)
    SELECT k.* INTO v_through FROM runledger.event_checkpoints k
    WHERE k.checkpoint_id = (
        SELECT max(b.checkpoint_id) FROM (
            SELECT o.checkpoint_id, bool_and(o.at < p_before) OVER w AS old,
                   sum(o.runs) OVER w AS heads, row_number() OVER w AS n
            FROM (SELECT x.checkpoint_id, x.at, x.runs FROM runledger.event_checkpoints x
                  WHERE x.checkpoint_id > 0 AND x.checkpoint_id < v_last.checkpoint_id
                  ORDER BY x.checkpoint_id LIMIT p_limit) o
            WINDOW w AS (ORDER BY o.checkpoint_id)) b
        WHERE b.old AND (b.heads <= p_limit OR b.n = 1));
    IF v_through.checkpoint_id IS NOT NULL THEN
        -- the heads that still pin a chain: each run's newest in the batch, with no later
        -- head, of a chain no record of a pruned chain covers
        SELECT coalesce(array_agg(n.run_id ORDER BY n.run_id), '{}'),
               coalesce(array_agg(n.event_id ORDER BY n.run_id), '{}'),
               coalesce(array_agg(n.hash ORDER BY n.run_id), '{}')
        INTO v_runs, v_events, v_hashes
        FROM (SELECT DISTINCT ON (h.run_id) h.run_id, h.event_id, h.hash
              FROM runledger.event_checkpoint_heads h
              WHERE h.checkpoint_id > 0 AND h.checkpoint_id <= v_through.checkpoint_id
              ORDER BY h.run_id, h.checkpoint_id DESC) n
        WHERE NOT EXISTS (SELECT 1 FROM runledger.event_checkpoint_heads l
                          WHERE l.run_id = n.run_id
                            AND l.checkpoint_id > v_through.checkpoint_id)
          AND NOT EXISTS (SELECT 1 FROM runledger.event_chain_prunes p
                          WHERE p.run_id = n.run_id AND p.last_event_id >= n.event_id);
        IF NOT p_keep_events THEN
            -- the chains kept without their run, that ended with that head before p_before
            SELECT coalesce(array_agg(c.run_id), '{}') INTO v_gone
            FROM unnest(v_runs, v_events, v_hashes) AS c(run_id, event_id, hash)
            WHERE NOT EXISTS (SELECT 1 FROM runledger.runs r WHERE r.run_id = c.run_id)
              AND EXISTS (SELECT 1 FROM (SELECT e.event_id, e.hash, e.at
                                         FROM runledger.run_events e
                                         WHERE e.run_id = c.run_id
                                         ORDER BY e.event_id DESC LIMIT 1) l
                          WHERE l.event_id = c.event_id AND l.hash = c.hash
                            AND l.at < p_before);
            WITH events AS (
                DELETE FROM runledger.run_events e
                WHERE e.run_id = ANY (v_gone)
                  AND NOT EXISTS (SELECT 1 FROM runledger.runs r WHERE r.run_id = e.run_id)
                RETURNING e.run_id, e.event_id, e.hash
            )
            INSERT INTO runledger.event_chain_prunes (run_id, last_event_id, last_hash, events,
                                                      pruned_at, pruned_by)
            SELECT DISTINCT ON (d.run_id) d.run_id, d.event_id, d.hash,
                   count(*) OVER (PARTITION BY d.run_id), v_now, session_user
            FROM events d ORDER BY d.run_id, d.event_id DESC;
            GET DIAGNOSTICS chains = ROW_COUNT;
        END IF;
        WITH carry AS (
            SELECT c.run_id, c.event_id, c.hash
            FROM unnest(v_runs, v_events, v_hashes) AS c(run_id, event_id, hash)
            WHERE NOT (c.run_id = ANY (v_gone))
        ), made AS (
            INSERT INTO runledger.event_checkpoints (checkpoint_id, at, actor,
                through_event_id, runs, previous_digest, digest)
            SELECT v_last.checkpoint_id + 1, v_now, 'runledger prune',
                   v_last.through_event_id, count(*), v_last.digest,
                   runledger._checkpoint_digest(v_last.digest, v_last.checkpoint_id + 1,
                       v_last.through_event_id,
                       string_agg(c.run_id || ' ' || c.event_id || ' '
                                  || encode(c.hash, 'hex'), E'\n'
                                  ORDER BY c.run_id COLLATE "C"))
            FROM carry c
            HAVING count(*) > 0
            RETURNING 1
        )
        INSERT INTO runledger.event_checkpoint_heads (checkpoint_id, run_id, event_id, hash)
        SELECT v_last.checkpoint_id + 1, c.run_id, c.event_id, c.hash
        FROM carry c;  -- (made runs too: a WITH that writes always runs)
        GET DIAGNOSTICS carried = ROW_COUNT;
        DELETE FROM runledger.event_checkpoint_heads h
        WHERE h.checkpoint_id > 0 AND h.checkpoint_id <= v_through.checkpoint_id;
        GET DIAGNOSTICS heads = ROW_COUNT;
        DELETE FROM runledger.event_checkpoints k
        WHERE k.checkpoint_id > 0 AND k.checkpoint_id <= v_through.checkpoint_id;
        GET DIAGNOSTICS checkpoints = ROW_COUNT;
        -- the database login that pruned (session_user: this function runs as its owner)
        INSERT INTO runledger.event_checkpoint_prunes (through_checkpoint_id, digest,
            through_at, checkpoints, heads, carried, carried_into, pruned_at, pruned_by)
        VALUES (v_through.checkpoint_id, v_through.digest, v_through.at, checkpoints, heads,
                carried, CASE WHEN carried > 0 THEN v_last.checkpoint_id + 1 END, v_now,
                session_user);
    END IF;
    DELETE FROM runledger.event_checkpoint_prunes p
    WHERE p.through_checkpoint_id IN (
        SELECT x.through_checkpoint_id FROM runledger.event_checkpoint_prunes x
        WHERE x.pruned_at < p_before
          AND x.through_checkpoint_id < (SELECT max(y.through_checkpoint_id)
                                         FROM runledger.event_checkpoint_prunes y)
        ORDER BY x.through_checkpoint_id LIMIT p_limit);
    GET DIAGNOSTICS checkpoint_prunes = ROW_COUNT;

    -- the records of pruned chains no head needs: audit passes a head whose event is gone
    -- when such a row covers it (checkpoint_head_changed)
    DELETE FROM runledger.event_chain_prunes p
    USING (SELECT x.run_id, x.last_event_id FROM runledger.event_chain_prunes x
           WHERE x.pruned_at < p_before
             AND NOT EXISTS (SELECT 1 FROM runledger.event_checkpoint_heads h
                             WHERE h.run_id = x.run_id AND h.event_id <= x.last_event_id)
           ORDER BY x.pruned_at LIMIT p_limit) d
    WHERE p.run_id = d.run_id AND p.last_event_id = d.last_event_id;
    GET DIAGNOSTICS chain_prunes = ROW_COUNT;

    -- workers gone since before the cutoff; a worker heartbeating now is skipped
    IF EXISTS (SELECT 1 FROM runledger.workers x
               WHERE x.heartbeat_at < p_before
                 AND (x.stopped_at IS NULL OR x.stopped_at < p_before)) THEN
        WITH busy AS (
            SELECT r.lease_owner AS worker_id FROM runledger.runs r
            WHERE r.status = 'running' AND r.lease_owner IS NOT NULL
            UNION
            SELECT c.dispatched_by FROM runledger.runs r
            JOIN runledger.run_calls c ON c.run_id = r.run_id
            WHERE r.status IN ('queued', 'running', 'paused') AND c.status = 'dispatched'
              AND c.dispatched_by IS NOT NULL
        )
        DELETE FROM runledger.workers w
        USING (SELECT x.worker_id FROM runledger.workers x
               WHERE x.heartbeat_at < p_before
                 AND (x.stopped_at IS NULL OR x.stopped_at < p_before)
                 AND x.worker_id NOT IN (SELECT b.worker_id FROM busy b)
               ORDER BY x.heartbeat_at LIMIT p_limit
               FOR UPDATE SKIP LOCKED) d
        WHERE w.worker_id = d.worker_id;
        GET DIAGNOSTICS workers = ROW_COUNT;
    END IF;

    -- last: a claim that records a new guarantee waits for this transaction's end
    IF EXISTS (SELECT 1 FROM runledger.commit_guarantees x WHERE x.seen_at < p_before
               AND x.position < (SELECT max(y.position) FROM runledger.commit_guarantees y)) THEN
        DELETE FROM runledger.commit_guarantees g
        WHERE g.position IN (
            SELECT x.position FROM runledger.commit_guarantees x
            WHERE x.seen_at < p_before
              AND x.position < (SELECT max(y.position) FROM runledger.commit_guarantees y)
            ORDER BY x.position LIMIT p_limit);
        GET DIAGNOSTICS commit_guarantees = ROW_COUNT;
    END IF;

    -- more: an old checkpoint is left (the oldest after 0, not the newest), or a limit
    -- was reached
    more := EXISTS (SELECT 1 FROM (SELECT x.checkpoint_id, x.at
                                   FROM runledger.event_checkpoints x
                                   WHERE x.checkpoint_id > 0
                                   ORDER BY x.checkpoint_id LIMIT 1) f
                    WHERE f.at < p_before
                      AND f.checkpoint_id < (SELECT max(y.checkpoint_id)
                                             FROM runledger.event_checkpoints y))
            OR greatest(checkpoint_prunes, chain_prunes, workers, commit_guarantees) >= p_limit;
    DELETE FROM runledger.prune_authorizations a WHERE a.txid = v_txid;
    RETURN NEXT;
END
$$;
