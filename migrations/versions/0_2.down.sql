-- Back to revision 0.1: the functions as 0.1 had them, without the witness.

CREATE OR REPLACE FUNCTION runledger._note_timeline(p_actor text, p_now timestamptz) RETURNS void
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

CREATE OR REPLACE FUNCTION runledger._claim(p_worker_id text, p_flows text[], p_lease interval,
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

DROP FUNCTION runledger.release_stale_lease(text, uuid, bigint, text);
DROP FUNCTION runledger._note_commit_guarantee(text, timestamptz, integer);
DROP FUNCTION runledger._synchronous(text, text);
DROP TABLE runledger.commit_guarantees;
ALTER TABLE runledger.timelines DROP COLUMN lossless, DROP COLUMN evidence;

-- ---------------------------------------------------------------------------------
-- The sender's process of a call in flight: call_sender as 0.1 has it (the process
-- as the sender's worker registered it)
-- ---------------------------------------------------------------------------------

CREATE OR REPLACE FUNCTION runledger.call_sender(p_run_id text, p_lease_id uuid, p_fencing_token bigint,
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


-- ---------------------------------------------------------------------------------
-- One clock: back to 0.1's heartbeat_worker, without workers.clock_offset.

DROP FUNCTION runledger.heartbeat_worker(text, boolean, uuid, interval);
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

REVOKE ALL ON FUNCTION runledger.heartbeat_worker(text, boolean, uuid) FROM PUBLIC;
DO $$
BEGIN
    IF EXISTS (SELECT 1 FROM pg_roles WHERE rolname = 'runledger_worker') THEN
        GRANT EXECUTE ON FUNCTION runledger.heartbeat_worker(text, boolean, uuid)
            TO runledger_worker;
    END IF;
END
$$;
ALTER TABLE runledger.workers DROP COLUMN clock_offset;

-- ---------------------------------------------------------------------------------
-- Back from the retention of the records: without prune_records, its record of pruned
-- checkpoints and its indexes; the guards as 0.1 had them. A database pruned by it keeps
-- a gap in its checkpoints that 0.1's audit reports as missing checkpoints.
-- ---------------------------------------------------------------------------------
DROP FUNCTION runledger.prune_records(timestamptz, boolean, integer);
DROP TABLE runledger.event_checkpoint_prunes;
DROP INDEX runledger.ix_event_chain_prunes_pruned_at;
DROP INDEX runledger.ix_event_checkpoint_heads_run_id;

CREATE OR REPLACE FUNCTION runledger._guard_failover_record() RETURNS trigger
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

CREATE OR REPLACE FUNCTION runledger._guard_event_chain() RETURNS trigger
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
-- end of the retention of the records
