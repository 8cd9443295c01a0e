-- runledger 0020 down: back to 0019 exactly (claim_runs, claim_runs_v2, v3, v4 and
-- record_turn_v4 as they were; no _claim).

CREATE OR REPLACE FUNCTION runledger.claim_runs(p_worker_id text, p_flows text[], p_lease interval,
                                     p_max_runs int)
RETURNS TABLE (run_id text, flow text, flow_version text, input jsonb, state jsonb,
               state_version bigint, fencing_token bigint, lease_id uuid,
               lease_expires_at timestamptz, takeover boolean)
LANGUAGE plpgsql SECURITY DEFINER
SET search_path = pg_catalog, runledger, pg_temp
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
                  c.old_expires_at
    )
    SELECT k.run_id, k.flow, k.flow_version, k.input, k.state, k.state_version,
           k.fencing_token, k.lease_id, k.lease_expires_at, k.takeover, k.old_owner, k.old_token,
           k.old_expires_at
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
        RETURN NEXT;
    END LOOP;
END
$$;

CREATE OR REPLACE FUNCTION runledger.claim_runs_v4(p_worker_id text, p_flows text[], p_lease interval,
                                        p_max_runs int)
RETURNS TABLE (run_id text, flow text, flow_version text, input jsonb, state jsonb,
               state_version bigint, fencing_token bigint, lease_id uuid,
               lease_expires_at timestamptz, takeover boolean, stalled_claims integer,
               turns json, calls json, failover_turn integer, traceparent text)
LANGUAGE plpgsql SECURITY DEFINER
SET search_path = pg_catalog, runledger, pg_temp
AS $$
#variable_conflict use_column
DECLARE
    v_claim record;
BEGIN
    -- each statement of the loop sees what claim_runs wrote (a later command)
    FOR v_claim IN SELECT * FROM runledger.claim_runs(p_worker_id, p_flows, p_lease, p_max_runs)
    LOOP
        SELECT r.stalled_claims,
               CASE WHEN r.stalled_claims <= 1 THEN (
                   SELECT coalesce(json_agg(json_build_object('turn', t.turn, 'calls', t.calls,
                                                              'record', t.record,
                                                              'output', t.output)
                                            ORDER BY t.turn), '[]'::json)
                   FROM runledger.run_turns t WHERE t.run_id = r.run_id) END,
               CASE WHEN r.stalled_claims <= 1 THEN (
                   SELECT coalesce(json_agg(c ORDER BY c.turn, c.position), '[]'::json)
                   FROM runledger.run_calls c WHERE c.run_id = r.run_id) END,
               (SELECT min(f.turn) FROM runledger.failover_runs f WHERE f.run_id = r.run_id),
               r.traceparent
        INTO stalled_claims, turns, calls, failover_turn, traceparent
        FROM runledger.runs r WHERE r.run_id = v_claim.run_id;
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
        RETURN NEXT;
    END LOOP;
END
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
    v_existing runledger.run_turns;
    v_count integer;
    v_next integer;
    v_open integer;
    v_run_calls integer;
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
    PERFORM runledger._check_json_object_or_null('record', p_record);
    PERFORM runledger._check_json_value_or_null('output', p_output);
    v_count := jsonb_array_length(p_calls);
    IF p_output IS NOT NULL AND v_count > 0 THEN
        PERFORM runledger._raise('RL006', 'output is the final decision''s: it needs empty calls',
            format('turn %s has %s call(s)', p_turn, v_count),
            'send the output with the decision that ends the run');
    END IF;
    PERFORM runledger._check_json_object_or_null('state', p_state);
    IF p_finish IS NULL THEN
        PERFORM runledger._raise('RL006', 'finish must not be null', NULL,
            'true ends the run with the final decision, false records the turn only');
    END IF;
    IF p_finish AND v_count > 0 THEN
        PERFORM runledger._raise('RL006', 'only the final decision finishes the run: it needs empty calls',
            format('turn %s has %s call(s)', p_turn, v_count), NULL);
    END IF;
    -- the calls to dispatch: distinct call ids of this decision (checked as calls are below;
    -- an id that is not one of them matches none)
    IF p_dispatch IS NOT NULL AND cardinality(p_dispatch) > 0 THEN
        IF array_position(p_dispatch, NULL) IS NOT NULL
           OR cardinality(p_dispatch) > (SELECT count(DISTINCT u) FROM unnest(p_dispatch) u) THEN
            PERFORM runledger._raise('RL006', 'dispatch must list distinct call ids, none null',
                format('got %s', left(array_to_string(p_dispatch, ', ', 'NULL'), 300)), NULL);
        END IF;
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

    SELECT t.* INTO v_existing FROM runledger.run_turns t
    WHERE t.run_id = p_run_id AND t.turn = p_turn;
    IF FOUND THEN
        IF v_existing.calls = p_calls AND v_existing.record IS NOT DISTINCT FROM p_record
           AND v_existing.output IS NOT DISTINCT FROM p_output THEN
            -- the same decision again: nothing of it is written again; its calls to
            -- dispatch are, as dispatch_call would
            state_version := r.state_version;
            attempts := runledger._dispatch_each(r, p_turn, p_dispatch, v_now, r.state_version);
            RETURN NEXT;
            RETURN;
        END IF;
        PERFORM runledger._raise('RL004',
            format('turn %s of run %s is already recorded with another decision', p_turn, p_run_id),
            CASE WHEN v_existing.calls = p_calls THEN 'the calls are the same; the record or the output differ'
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

    SELECT coalesce(max(t.turn) + 1, 0) INTO v_next FROM runledger.run_turns t
    WHERE t.run_id = p_run_id;
    IF p_turn <> v_next THEN
        PERFORM runledger._raise('RL004',
            format('turn %s of run %s is out of order', p_turn, p_run_id),
            format('the next turn to record is %s', v_next), NULL);
    END IF;
    SELECT count(*) FILTER (WHERE c.status NOT IN ('succeeded', 'failed')), count(*)
    INTO v_open, v_run_calls
    FROM runledger.run_calls c WHERE c.run_id = p_run_id;
    IF v_open > 0 THEN
        PERFORM runledger._raise('RL004',
            format('run %s has %s call(s) without a final result', p_run_id, v_open),
            NULL, 'complete every call of the previous turn before recording the next');
    END IF;

    -- One pass over the calls: the first one (in order) with a problem, and its first
    -- problem in record_turn_v2's order. A repeated call id is one whose earlier twin came
    -- first; every call before the first bad one is good, as in the loop.
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
    attempts := runledger._dispatch_each(r, p_turn, p_dispatch, v_now, v_version);
    RETURN NEXT;
END
$$;

-- claim_runs_v2 and v3 as they were (before their bodies became selections of _claim)
CREATE OR REPLACE FUNCTION runledger.claim_runs_v2(p_worker_id text, p_flows text[], p_lease interval,
                                        p_max_runs int)
RETURNS TABLE (run_id text, flow text, flow_version text, input jsonb, state jsonb,
               state_version bigint, fencing_token bigint, lease_id uuid,
               lease_expires_at timestamptz, takeover boolean, stalled_claims integer,
               turns json, calls json)
LANGUAGE plpgsql SECURITY DEFINER
SET search_path = pg_catalog, runledger, pg_temp
AS $$
#variable_conflict use_column
DECLARE
    v_claim record;
BEGIN
    -- each statement of the loop sees what claim_runs wrote (a later command)
    FOR v_claim IN SELECT * FROM runledger.claim_runs(p_worker_id, p_flows, p_lease, p_max_runs)
    LOOP
        SELECT r.stalled_claims,
               CASE WHEN r.stalled_claims <= 1 THEN (
                   SELECT coalesce(json_agg(json_build_object('turn', t.turn, 'calls', t.calls,
                                                              'record', t.record,
                                                              'output', t.output)
                                            ORDER BY t.turn), '[]'::json)
                   FROM runledger.run_turns t WHERE t.run_id = r.run_id) END,
               CASE WHEN r.stalled_claims <= 1 THEN (
                   SELECT coalesce(json_agg(c ORDER BY c.turn, c.position), '[]'::json)
                   FROM runledger.run_calls c WHERE c.run_id = r.run_id) END
        INTO stalled_claims, turns, calls
        FROM runledger.runs r WHERE r.run_id = v_claim.run_id;
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
        RETURN NEXT;
    END LOOP;
END
$$;

CREATE OR REPLACE FUNCTION runledger.claim_runs_v3(p_worker_id text, p_flows text[], p_lease interval,
                                        p_max_runs int)
RETURNS TABLE (run_id text, flow text, flow_version text, input jsonb, state jsonb,
               state_version bigint, fencing_token bigint, lease_id uuid,
               lease_expires_at timestamptz, takeover boolean, stalled_claims integer,
               turns json, calls json, failover_turn integer)
LANGUAGE plpgsql SECURITY DEFINER
SET search_path = pg_catalog, runledger, pg_temp
AS $$
#variable_conflict use_column
DECLARE
    v_claim record;
BEGIN
    -- each statement of the loop sees what claim_runs wrote (a later command)
    FOR v_claim IN SELECT * FROM runledger.claim_runs(p_worker_id, p_flows, p_lease, p_max_runs)
    LOOP
        SELECT r.stalled_claims,
               CASE WHEN r.stalled_claims <= 1 THEN (
                   SELECT coalesce(json_agg(json_build_object('turn', t.turn, 'calls', t.calls,
                                                              'record', t.record,
                                                              'output', t.output)
                                            ORDER BY t.turn), '[]'::json)
                   FROM runledger.run_turns t WHERE t.run_id = r.run_id) END,
               CASE WHEN r.stalled_claims <= 1 THEN (
                   SELECT coalesce(json_agg(c ORDER BY c.turn, c.position), '[]'::json)
                   FROM runledger.run_calls c WHERE c.run_id = r.run_id) END,
               (SELECT min(f.turn) FROM runledger.failover_runs f WHERE f.run_id = r.run_id)
        INTO stalled_claims, turns, calls, failover_turn
        FROM runledger.runs r WHERE r.run_id = v_claim.run_id;
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
        RETURN NEXT;
    END LOOP;
END
$$;

DROP FUNCTION runledger._claim(text, text[], interval, integer, boolean);
