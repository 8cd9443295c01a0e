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
-- the first claim to see it records the new timeline and what it means for every run that
-- was not finished (docs/failover.md). Whether the promotion could lose an acknowledged
-- commit is decided from the last row of runledger.commit_guarantees: how the workers'
-- commits were acknowledged before it.
--   * Lossless (every acknowledged commit was on every synchronous standby, and the HA
--     manager promotes only one of them): nothing is doubted. The leases held end within
--     10 s (their tokens are under the new floor: their writes are refused), and each
--     running run gets a failover_detected event saying so; queued and paused runs are
--     left alone.
--   * Otherwise, for every unfinished run, what may have been lost with the commits of the
--     old timeline:
--     - a lease held then ends (as above);
--     - a planned call (not awaiting approval) may have been dispatched and sent on the
--       lost timeline: it is marked dispatched, so that whoever claims the run next
--       recovers it by its safety class (lookup, same key, or unknown) instead of sending
--       it as new;
--     - the run is listed in runledger.failover_runs with the turn from which its calls
--       are suspect, and gets a failover_detected event.
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
    v_guarantee runledger.commit_guarantees;
    v_lossless boolean;
    v_evidence jsonb;
BEGIN
    -- one detector at a time; the others find the row it wrote
    LOCK TABLE runledger.timelines IN SHARE ROW EXCLUSIVE MODE;
    SELECT * INTO v_last FROM runledger.timelines t ORDER BY t.position DESC LIMIT 1;
    IF FOUND AND v_last.timeline = v_timeline THEN
        RETURN;
    END IF;
    v_position := coalesce(v_last.position, 0) + 1;
    IF v_last.position IS NOT NULL THEN
        -- how the commits before the promotion were acknowledged (the claim that detects
        -- the failover notes the new timeline's guarantee only after this)
        SELECT * INTO v_guarantee FROM runledger.commit_guarantees g
        ORDER BY g.position DESC LIMIT 1;
        v_lossless := coalesce(runledger._synchronous(v_guarantee.synchronous_commit,
                                                      v_guarantee.synchronous_standby_names),
                               false);
        v_evidence := jsonb_build_object('commit_guarantee',
            CASE WHEN v_guarantee.position IS NOT NULL THEN to_jsonb(v_guarantee) END);
        -- the runs it affects, locked (in a fixed order) until the end of the claim: those
        -- holding a lease; after a failover that may have lost commits, every unfinished one
        SELECT coalesce(array_agg(u.run_id ORDER BY u.run_id), '{}') INTO v_runs
        FROM (SELECT r.run_id FROM runledger.runs r
              WHERE r.status = 'running'
                 OR (NOT v_lossless AND r.status IN ('queued', 'paused'))
              ORDER BY r.run_id FOR NO KEY UPDATE) u;
    END IF;
    -- the table is append-only (the wall): the row is written whole, once
    INSERT INTO runledger.timelines (position, timeline, previous_timeline, seen_at, seen_by,
                                     last_replay_at, last_event_id, max_token, affected_runs,
                                     lossless, evidence)
    VALUES (v_position, v_timeline, v_last.timeline, p_now, p_actor,
            pg_last_xact_replay_timestamp(),
            (SELECT max(e.event_id) FROM runledger.run_events e),
            (SELECT max(r.fencing_token) FROM runledger.runs r), cardinality(v_runs),
            v_lossless, v_evidence);
    IF v_last.position IS NULL THEN
        RETURN;  -- the first timeline seen: nothing to compare with
    END IF;

    IF v_lossless THEN
        -- Nothing acknowledged was lost: the runs are as their holders left them. Their
        -- leases end as below (the holders fence themselves; their calls in flight are
        -- released to the next holder or waited for), and nothing is doubted.
        UPDATE runledger.runs r
        SET lease_expires_at = least(r.lease_expires_at, p_now + interval '10 seconds'),
            lease_lock = NULL, updated_at = p_now
        WHERE r.run_id = ANY (v_runs);
    ELSE
        WITH affected AS (
            SELECT r.run_id, r.status, r.lease_owner, r.fencing_token,
                   coalesce((SELECT max(t.turn) FROM runledger.run_turns t
                             WHERE t.run_id = r.run_id), 0) AS turn
            FROM runledger.runs r
            WHERE r.run_id = ANY (v_runs)
        ), marked AS (
            UPDATE runledger.run_calls c
            -- an attempt under the run's last surviving token: the dispatch that may be lost
            SET status = 'dispatched', attempts = c.attempts + 1,
                dispatched_token = a.fencing_token, dispatched_by = 'failover',
                dispatched_at = p_now
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
        INSERT INTO runledger.failover_runs (run_id, position, status, lease_owner,
                                             fencing_token, turn, marked_calls)
        SELECT a.run_id, v_position, a.status, a.lease_owner, a.fencing_token, a.turn,
               ARRAY(SELECT m.idempotency_key FROM marked m WHERE m.run_id = a.run_id
                     ORDER BY m.idempotency_key)
        FROM affected a
        -- the lease UPDATE runs with the statement even where nothing reads it
        LEFT JOIN (SELECT count(*) AS n FROM ended) e ON true;
    END IF;

    -- an event per affected run, as it was (the updates above leave its status, holder
    -- and token); what is doubted of it, when anything is, from its failover_runs row
    FOR v_run IN
        SELECT r.run_id, r.status, r.lease_owner, r.fencing_token, r.state_version, f.turn,
               f.marked_calls
        FROM runledger.runs r
        LEFT JOIN runledger.failover_runs f ON f.run_id = r.run_id AND f.position = v_position
        WHERE r.run_id = ANY (v_runs) ORDER BY r.run_id
    LOOP
        PERFORM runledger._event(v_run.run_id, 'failover_detected', p_actor, NULL,
            v_run.state_version,
            jsonb_build_object('timeline', v_timeline, 'previous_timeline', v_last.timeline,
                               'status', v_run.status, 'lease_owner', v_run.lease_owner,
                               'fencing_token', v_run.fencing_token, 'lossless', v_lossless,
                               'suspect_from_turn', v_run.turn,
                               'marked_dispatched',
                               coalesce(to_jsonb(v_run.marked_calls), '[]'::jsonb),
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
    -- the claimer's process as its worker registered it (workers.process), recorded in
    -- each claim's event: the process that holds the lease, and sends under its token
    -- (call_sender)
    v_process jsonb;
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
    -- how this session's commits are acknowledged, for the next failover to judge by
    PERFORM runledger._note_commit_guarantee(p_worker_id, v_now, v_timeline);
    -- session locks
    SELECT w.session_lock,
           CASE WHEN w.process IS NOT NULL THEN jsonb_build_object('process', w.process)
                ELSE '{}'::jsonb END
    INTO v_lock, v_process FROM runledger.workers w
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
            -- 'session_ended' (the lease still ran, the holder's session had ended);
            -- process (both kinds): the claimer's, when its worker registered one
            PERFORM runledger._event(v_claim.run_id, 'takeover', p_worker_id,
                v_claim.fencing_token, v_claim.state_version,
                jsonb_build_object('lease_id', v_claim.lease_id,
                                   'lease_expires_at', v_claim.lease_expires_at,
                                   'previous_owner', v_claim.old_owner,
                                   'previous_token', v_claim.old_token,
                                   'holder', CASE WHEN v_claim.old_expires_at <= v_now
                                                  THEN 'expired' ELSE 'session_ended' END,
                                   'previous_lease_expires_at', v_claim.old_expires_at)
                || coalesce(v_process, '{}'::jsonb),
                v_now);
        ELSE
            PERFORM runledger._event(v_claim.run_id, 'claimed', p_worker_id,
                v_claim.fencing_token, v_claim.state_version,
                jsonb_build_object('lease_id', v_claim.lease_id,
                                   'lease_expires_at', v_claim.lease_expires_at)
                || coalesce(v_process, '{}'::jsonb),
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

-- A worker that fenced a run whose lease was granted before a failover hands it back once
-- nothing of the run is in flight any more (its tools ended, their sends released): the
-- run is queued at once instead of when the failover's wait on that lease ends
-- (_note_timeline). Only such a lease: its token is at most this timeline's floor, so
-- every write of it is refused, and only its holder (p_worker_id the lease owner) says it
-- is done with it. True when the run was handed back; false, writing nothing, when the
-- lease is not the run's current one, has expired, or was granted on this timeline
-- (release_lease is for that). Like the clean hand-back, the claim's stalled count is
-- undone: a failover is not the run's fault. Refuses: RL006 (a bad worker id), RL003 (no
-- such run).
CREATE FUNCTION runledger.release_stale_lease(p_run_id text, p_lease_id uuid,
                                              p_fencing_token bigint, p_worker_id text)
RETURNS boolean
LANGUAGE plpgsql SECURITY DEFINER
SET search_path = pg_catalog, runledger, pg_temp
AS $$
DECLARE
    r runledger.runs;
    v_now timestamptz;
BEGIN
    PERFORM runledger._check_worker_id(p_worker_id);
    r := runledger._lock_run(p_run_id);
    v_now := runledger.now();  -- after the lock, as the lease check
    IF r.status <> 'running' OR r.lease_id IS DISTINCT FROM p_lease_id
       OR r.fencing_token IS DISTINCT FROM p_fencing_token
       OR r.lease_owner IS DISTINCT FROM p_worker_id OR r.lease_expires_at <= v_now
       OR p_fencing_token > runledger._token_floor() THEN
        RETURN false;
    END IF;
    UPDATE runledger.runs
    SET status = 'queued', lease_id = NULL, lease_expires_at = NULL, lease_owner = NULL,
        stalled_claims = greatest(stalled_claims - 1, 0),
        available_at = v_now, updated_at = v_now
    WHERE run_id = p_run_id;
    PERFORM runledger._event(p_run_id, 'lease_released', p_worker_id, p_fencing_token,
        r.state_version, jsonb_build_object('reason', 'fenced after a failover'), v_now);
    PERFORM runledger._notify_queued(r.flow, r.flow_version);
    RETURN true;
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
-- (the 'send_released' event's detail, or NULL), and the sender's process with the time
-- it was recorded, for a peer on the same host to check. That process is the one that
-- claimed the run under the sender's token (the 'process' of that claim's event, at the
-- claim's time): the lease is that process's, and only it sends under the token, even
-- when its worker id has been registered again since (the worker restarted under its own
-- id). A claim recorded without one (its worker registered no process) leaves the
-- process as the sender's worker registered it, with the time of that registration
-- (workers.process, started_at). One row; none for a call that is not dispatched.
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
    -- the claim that granted the sender's token (a failover's dispatch is no claimer's)
    SELECT e.detail ->> 'process', e.at INTO process, registered_at
    FROM runledger.run_events e
    WHERE e.run_id = p_run_id AND e.kind IN ('claimed', 'takeover')
      AND e.fencing_token = c.dispatched_token AND e.actor = c.dispatched_by
    ORDER BY e.event_id LIMIT 1;
    IF process IS NULL THEN
        SELECT w.process, w.started_at INTO process, registered_at
        FROM runledger.workers w WHERE w.worker_id = c.dispatched_by;
    END IF;
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
-- refused with RL008, and stops. p_clock_offset: how far the worker's host clock is ahead
-- of the database's (negative: behind), as the worker measured it (workers.clock_offset;
-- NULL leaves the last one).
CREATE FUNCTION runledger.heartbeat_worker(p_worker_id text, p_stopped boolean DEFAULT false,
                                           p_incarnation uuid DEFAULT NULL,
                                           p_clock_offset interval DEFAULT NULL)
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
        stopped_at = CASE WHEN p_stopped THEN v_now ELSE stopped_at END,
        clock_offset = coalesce(p_clock_offset, clock_offset)
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
