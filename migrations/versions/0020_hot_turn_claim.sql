-- runledger 0020: the hot path's SQL, cheaper in server CPU (issue "The hot path"), with
-- the contract unchanged. The claim has one body, runledger._claim, with the worker's
-- per-run read in its claim statement; claim_runs and claim_runs_v2, v3 and v4 select its
-- columns. It plans its claim statement once per session instead of at every call; record_turn_v4
-- (and so record_turn_v3) reads what its checks need in one statement, skips the query
-- that finds the first bad call when every call is good, and checks one call to dispatch
-- without a query.
-- Frozen once merged: change things in a new revision (and in the living files).

-- The one body of the claim; claim_runs and claim_runs_v2, v3 and v4 select its columns.
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
    -- session locks (revision 0011): the claimer's listener-session lock, stamped on each
    -- run it claims; the locks of holder sessions that ended (their runs are taken over
    -- before their leases expire)
    v_lock bigint;
    v_gone bigint[] := '{}';
    -- revision 0020: the planner settings of the claim statement, restored after it
    v_plan_cache_mode text := pg_catalog.current_setting('plan_cache_mode');
    v_jit text := pg_catalog.current_setting('jit');
    v_set text;
BEGIN
    PERFORM runledger._check_worker_id(p_worker_id);
    PERFORM runledger._check_lease(p_lease);
    IF p_max_runs IS NULL OR p_max_runs < 0 OR p_max_runs > 10000 THEN
        PERFORM runledger._raise('RL006', 'max runs must be 0-10000', NULL, NULL);
    END IF;
    v_flows := runledger._parse_flows(p_flows);
    -- failover (revision 0010): the token floor of this timeline, once it is recorded
    v_timeline := runledger._timeline();
    v_floor := (v_timeline - 1)::bigint << 32;  -- runledger._token_floor()
    IF (SELECT t.timeline FROM runledger.timelines t ORDER BY t.position DESC LIMIT 1)
       IS DISTINCT FROM v_timeline THEN
        PERFORM runledger._note_timeline(p_worker_id, v_now);
    END IF;
    -- session locks (revision 0011)
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
    -- Revision 0020: the statement is planned once per session, not at every call. With
    -- its parameters known (the clock, the limits, the gone sessions' keys) the planner's
    -- estimate of a custom plan always beats that of the generic one, so the plan cache
    -- planned it anew each time: ~0.9 ms of planning for ~0.3 ms of work. The generic
    -- plan has the same shape (index-ordered scans, rows fetched by key), so the cost stays
    -- flat with the backlog (bench/claim_scaling.py). Without JIT: not knowing the limits,
    -- the generic plan's estimate passes jit_above_cost from about a million queued runs
    -- on, and compiling it would cost ~70 ms a claim for well under a millisecond of work.
    -- Set for the transaction (the function's own SET clause is the search path alone, as
    -- every contract function's) and put back after the loop; an error undoes it anyway.
    v_set := pg_catalog.set_config('plan_cache_mode', 'force_generic_plan', true);
    v_set := pg_catalog.set_config('jit', 'off', true);
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
        SELECT c.run_id FROM runledger.runs c
        JOIN pinned p ON p.name = c.flow AND p.version = c.flow_version
        WHERE c.status = 'running' AND c.lease_expires_at <= v_now
        ORDER BY c.lease_expires_at
        LIMIT p_max_runs * 4 + 32
    ), orphaned AS (  -- session locks (revision 0011): the holder's session ended
        SELECT c.run_id FROM runledger.runs c
        JOIN pinned p ON p.name = c.flow AND p.version = c.flow_version
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
          AND ((c.status = 'queued' AND c.available_at <= v_now)
               OR (c.status = 'running' AND c.lease_expires_at <= v_now)
               OR (c.status = 'running' AND c.lease_lock = ANY (v_gone)))
        ORDER BY c.priority DESC, c.created_at, c.run_id
        LIMIT p_max_runs
        FOR NO KEY UPDATE OF c SKIP LOCKED
    ), claimed AS (
        UPDATE runledger.runs r
        SET status = 'running',
            fencing_token = greatest(r.fencing_token + 1, v_floor + 1),  -- revision 0010
            lease_id = gen_random_uuid(),
            lease_owner = p_worker_id,
            lease_expires_at = v_now + p_lease,
            claims = r.claims + 1,
            stalled_claims = r.stalled_claims + 1,
            updated_at = v_now,
            lease_lock = v_lock  -- session locks (revision 0011)
        FROM candidates c
        WHERE r.run_id = c.run_id
          AND ((r.status = 'queued' AND r.available_at <= v_now)
               OR (r.status = 'running' AND r.lease_expires_at <= v_now)
               OR (r.status = 'running' AND r.lease_lock = ANY (v_gone)))
        RETURNING r.run_id, r.flow, r.flow_version, r.input, r.state, r.state_version,
                  r.fencing_token, r.lease_id, r.lease_expires_at,
                  (c.old_status = 'running') AS takeover, c.old_owner, c.old_token,
                  c.old_expires_at, r.stalled_claims, r.traceparent
    )
    -- what claim_runs_v2, v3 and v4 read per run after claim_runs: the claim writes no
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
            -- holder: why the run could be taken, 'expired' or (revision 0011)
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
END
$$;
REVOKE ALL ON FUNCTION runledger._claim(text, text[], interval, integer, boolean) FROM PUBLIC;

CREATE OR REPLACE FUNCTION runledger.claim_runs(p_worker_id text, p_flows text[], p_lease interval,
                                     p_max_runs int)
RETURNS TABLE (run_id text, flow text, flow_version text, input jsonb, state jsonb,
               state_version bigint, fencing_token bigint, lease_id uuid,
               lease_expires_at timestamptz, takeover boolean)
LANGUAGE sql SECURITY DEFINER
SET search_path = pg_catalog, runledger, pg_temp
AS $$
    SELECT c.run_id, c.flow, c.flow_version, c.input, c.state, c.state_version, c.fencing_token,
           c.lease_id, c.lease_expires_at, c.takeover
    FROM runledger._claim(p_worker_id, p_flows, p_lease, p_max_runs, false) c
$$;

CREATE OR REPLACE FUNCTION runledger.claim_runs_v2(p_worker_id text, p_flows text[], p_lease interval,
                                        p_max_runs int)
RETURNS TABLE (run_id text, flow text, flow_version text, input jsonb, state jsonb,
               state_version bigint, fencing_token bigint, lease_id uuid,
               lease_expires_at timestamptz, takeover boolean, stalled_claims integer,
               turns json, calls json)
LANGUAGE sql SECURITY DEFINER
SET search_path = pg_catalog, runledger, pg_temp
AS $$
    SELECT c.run_id, c.flow, c.flow_version, c.input, c.state, c.state_version, c.fencing_token,
           c.lease_id, c.lease_expires_at, c.takeover, c.stalled_claims, c.turns, c.calls
    FROM runledger._claim(p_worker_id, p_flows, p_lease, p_max_runs, true) c
$$;

CREATE OR REPLACE FUNCTION runledger.claim_runs_v3(p_worker_id text, p_flows text[], p_lease interval,
                                        p_max_runs int)
RETURNS TABLE (run_id text, flow text, flow_version text, input jsonb, state jsonb,
               state_version bigint, fencing_token bigint, lease_id uuid,
               lease_expires_at timestamptz, takeover boolean, stalled_claims integer,
               turns json, calls json, failover_turn integer)
LANGUAGE sql SECURITY DEFINER
SET search_path = pg_catalog, runledger, pg_temp
AS $$
    SELECT c.run_id, c.flow, c.flow_version, c.input, c.state, c.state_version, c.fencing_token,
           c.lease_id, c.lease_expires_at, c.takeover, c.stalled_claims, c.turns, c.calls,
           c.failover_turn
    FROM runledger._claim(p_worker_id, p_flows, p_lease, p_max_runs, true) c
$$;

CREATE OR REPLACE FUNCTION runledger.claim_runs_v4(p_worker_id text, p_flows text[], p_lease interval,
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

CREATE OR REPLACE FUNCTION runledger.record_turn_v4(p_run_id text, p_lease_id uuid, p_fencing_token bigint,
                                         p_turn int, p_calls jsonb, p_record jsonb,
                                         p_output jsonb, p_expected_version bigint,
                                         p_state jsonb, p_finish boolean, p_dispatch text[])
RETURNS TABLE (state_version bigint, attempts integer[])
LANGUAGE plpgsql SECURITY DEFINER
SET search_path = pg_catalog, runledger, pg_temp
AS $$
#variable_conflict use_column
DECLARE
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
BEGIN
    r := runledger._lock_leased_run(p_run_id, p_lease_id, p_fencing_token);
    v_now := runledger.now();  -- after the lock, as the lease check
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
    -- an id that is not one of them matches none). Revision 0020: one id is distinct
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

    -- Revision 0020: what the checks below read, in one statement: the turn p_turn if it
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
    -- problem in record_turn_v2's order. A repeated call id is one whose earlier twin came
    -- first; every call before the first bad one is good, as in the loop.
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
    INSERT INTO runledger.run_calls (run_id, turn, call_id, position, tool, args,
                                     idempotency_key, status, attempts, provider_id, approval)
    SELECT p_run_id, p_turn, a.c ->> 'call_id', a.pos - 1, a.c ->> 'tool',
           coalesce(a.c -> 'args', '{}'::jsonb),
           p_run_id || ':' || p_turn || ':' || (a.c ->> 'call_id'), 'planned', 0,
           a.c ->> 'provider_id',
           CASE WHEN (a.c -> 'approval') = 'true'::jsonb THEN 'pending' END
    FROM jsonb_array_elements(p_calls) WITH ORDINALITY AS a(c, pos);
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
    IF p_state IS NOT NULL THEN
        PERFORM runledger._event(p_run_id, 'checkpoint', r.lease_owner, p_fencing_token,
                                 v_version, '{}'::jsonb, v_now);
    END IF;
    PERFORM runledger._event(p_run_id, 'turn_recorded', r.lease_owner, p_fencing_token,
        v_version, jsonb_build_object('turn', p_turn, 'calls', v_count), v_now);
    IF p_finish THEN
        PERFORM runledger._event(p_run_id, 'run_succeeded', r.lease_owner, p_fencing_token,
                                 v_version, '{}'::jsonb, v_now);
    END IF;
    state_version := v_version;
    IF cardinality(p_dispatch) = 1 THEN
        -- one call (revision 0020): what _dispatch_each does for it, one call layer less
        attempts := ARRAY[runledger._dispatch(p_run_id, p_run_id || ':' || p_turn || ':' || p_dispatch[1],
                                              r.lease_owner, r.fencing_token, v_version, v_now)];
    ELSE
        attempts := runledger._dispatch_each(r, p_turn, p_dispatch, v_now, v_version);
    END IF;
    RETURN NEXT;
END
$$;
