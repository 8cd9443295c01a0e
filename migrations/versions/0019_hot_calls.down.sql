-- runledger 0019 down: back to 0018 exactly (the bodies of 0018, no _lock_leased_run_at).


CREATE OR REPLACE FUNCTION runledger._lock_leased_run(p_run_id text, p_lease_id uuid, p_fencing_token bigint)
RETURNS runledger.runs
LANGUAGE plpgsql
AS $$
DECLARE
    r runledger.runs;
    v_now timestamptz;
BEGIN
    -- _lock_run, inline (revision 0007): one indexed SELECT ... FOR NO KEY UPDATE
    SELECT * INTO r FROM runledger.runs x WHERE x.run_id = p_run_id FOR NO KEY UPDATE;
    IF NOT FOUND THEN
        PERFORM runledger._check_run_id(p_run_id);
        PERFORM runledger._raise('RL003', format('run %s not found', p_run_id), NULL, NULL);
    END IF;
    -- The clock is read once the row lock is held: a write that waited on the lock past
    -- the lease's expiry is refused. runledger.now() is VOLATILE, so under READ COMMITTED
    -- its query takes a new snapshot and sees a clock_offset committed during the wait.
    v_now := runledger.now();
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
    IF r.lease_expires_at <= v_now THEN
        PERFORM runledger._raise('RL001',
            format('lease expired on run %s: token %s', p_run_id, p_fencing_token),
            format('run %s is %s; seen lease %s token %s; current lease %s token %s held by %s '
                   'expired at %s, database clock is %s',
                   p_run_id, r.status, p_lease_id, p_fencing_token, r.lease_id, r.fencing_token,
                   coalesce(r.lease_owner, 'nobody'), r.lease_expires_at, v_now),
            'renew leases more often than the lease length; the run will be claimed again');
    END IF;
    -- Revision 0010: a lease is good only on the timeline that granted it. After a
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
    RETURN r;
END
$$;

CREATE OR REPLACE FUNCTION runledger._check_json_value_or_null(p_what text, p_value jsonb,
                                                    p_wrap integer DEFAULT 0) RETURNS void
LANGUAGE plpgsql STABLE
AS $$
DECLARE
    v_cap integer;
    v_depth integer;
    v_size integer;
BEGIN
    IF p_value IS NULL THEN
        RETURN;
    END IF;
    SELECT s.max_payload_bytes, s.max_json_depth INTO v_cap, v_depth FROM runledger.settings s;
    v_size := octet_length(p_value::text);
    IF v_size > coalesce(v_cap, 1048576) THEN
        PERFORM runledger._raise('RL006',
            format('%s is %s bytes, over the cap of %s bytes', p_what, v_size, v_cap),
            NULL, 'the cap is runledger.settings.max_payload_bytes');
    END IF;
    v_depth := coalesce(v_depth, 64) + p_wrap;
    -- A value deeper than v_depth has a container at level v_depth inside v_depth others:
    -- at least 2 * (v_depth + 1) characters of brackets. A shorter text cannot be too deep,
    -- so the walk is skipped (revision 0007); the result is the same.
    IF v_size >= 2 * (v_depth + 1) THEN
        PERFORM runledger._check_json_depth(p_what, p_value, v_depth);
    END IF;
END
$$;

CREATE OR REPLACE FUNCTION runledger._dispatch(p_run_id text, p_key text, p_owner text,
                                    p_fencing_token bigint, p_state_version bigint,
                                    p_now timestamptz) RETURNS integer
LANGUAGE plpgsql
AS $$
DECLARE
    c runledger.run_calls;
BEGIN
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
    UPDATE runledger.run_calls
    SET status = 'dispatched', attempts = c.attempts + 1, dispatched_token = p_fencing_token,
        dispatched_by = p_owner, dispatched_at = p_now
    WHERE idempotency_key = p_key AND status IN ('planned', 'dispatched')
      AND approval IS DISTINCT FROM 'pending';
    PERFORM runledger._event(p_run_id, 'call_dispatched', p_owner, p_fencing_token,
        p_state_version, jsonb_build_object('idempotency_key', p_key, 'tool', c.tool,
                                            'attempt', c.attempts + 1,
                                            'previous_status', c.status), p_now);
    RETURN c.attempts + 1;
END
$$;

CREATE OR REPLACE FUNCTION runledger.checkpoint(p_run_id text, p_lease_id uuid, p_fencing_token bigint,
                                     p_expected_version bigint, p_state jsonb)
RETURNS bigint
LANGUAGE plpgsql SECURITY DEFINER
SET search_path = pg_catalog, runledger, pg_temp
AS $$
DECLARE
    r runledger.runs;
BEGIN
    r := runledger._lock_leased_run(p_run_id, p_lease_id, p_fencing_token);
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
        updated_at = runledger.now()
    WHERE run_id = p_run_id AND state_version = r.state_version AND lease_id = p_lease_id;
    PERFORM runledger._event(p_run_id, 'checkpoint', r.lease_owner, p_fencing_token,
                             r.state_version + 1, '{}'::jsonb);
    RETURN r.state_version + 1;
END
$$;

CREATE OR REPLACE FUNCTION runledger.dispatch_call(p_run_id text, p_lease_id uuid, p_fencing_token bigint,
                                        p_idempotency_key text)
RETURNS int
LANGUAGE plpgsql SECURITY DEFINER
SET search_path = pg_catalog, runledger, pg_temp
AS $$
DECLARE
    r runledger.runs;
BEGIN
    r := runledger._lock_leased_run(p_run_id, p_lease_id, p_fencing_token);
    -- the clock after the lock, as the lease check
    RETURN runledger._dispatch(p_run_id, p_idempotency_key, r.lease_owner, p_fencing_token,
                               r.state_version, runledger.now());
END
$$;

CREATE OR REPLACE FUNCTION runledger.complete_call(p_run_id text, p_lease_id uuid, p_fencing_token bigint,
                                        p_idempotency_key text, p_outcome text,
                                        p_result jsonb, p_receipt jsonb)
RETURNS void
LANGUAGE plpgsql SECURITY DEFINER
SET search_path = pg_catalog, runledger, pg_temp
AS $$
DECLARE
    r runledger.runs;
    c runledger.run_calls;
    v_now timestamptz;
    v_detail jsonb;
BEGIN
    r := runledger._lock_leased_run(p_run_id, p_lease_id, p_fencing_token);
    v_now := runledger.now();  -- after the lock, as the lease check
    -- not_applied: the effect certainly did not happen and the call will be sent again
    -- with the same key; it goes back to planned, so no one mistakes it for in flight.
    PERFORM runledger._check_word('outcome', p_outcome,
                                  ARRAY['succeeded', 'failed', 'unknown', 'not_applied']);
    PERFORM runledger._check_json_value_or_null('result', p_result);
    PERFORM runledger._check_json_object_or_null('receipt', p_receipt);
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
    -- progress: a run claimed again counts claims without it (crash_loop). The row is
    -- written only when there is a count to reset (revision 0009): after the first write
    -- of a lease there never is, and a call's own row carries its times.
    IF r.stalled_claims <> 0 THEN
        UPDATE runledger.runs SET stalled_claims = 0, updated_at = v_now
        WHERE run_id = p_run_id AND lease_id = p_lease_id;
    END IF;
    v_detail := jsonb_build_object('idempotency_key', p_idempotency_key, 'tool', c.tool,
                                   'attempt', c.attempts);
    CASE p_outcome
        WHEN 'succeeded' THEN
            PERFORM runledger._event(p_run_id, 'call_succeeded', r.lease_owner, p_fencing_token,
                                     r.state_version, v_detail);
        WHEN 'failed' THEN
            PERFORM runledger._event(p_run_id, 'call_failed', r.lease_owner, p_fencing_token,
                                     r.state_version, v_detail);
        WHEN 'unknown' THEN
            PERFORM runledger._event(p_run_id, 'call_unknown', r.lease_owner, p_fencing_token,
                                     r.state_version, v_detail);
        WHEN 'not_applied' THEN
            PERFORM runledger._event(p_run_id, 'call_not_applied', r.lease_owner,
                                     p_fencing_token, r.state_version, v_detail);
    END CASE;
END
$$;

CREATE OR REPLACE FUNCTION runledger.complete_call_v2(p_run_id text, p_lease_id uuid, p_fencing_token bigint,
                                           p_idempotency_key text, p_outcome text,
                                           p_result jsonb, p_receipt jsonb,
                                           p_next_key text DEFAULT NULL)
RETURNS int
LANGUAGE plpgsql SECURITY DEFINER
SET search_path = pg_catalog, runledger, pg_temp
AS $$
DECLARE
    r runledger.runs;
    c runledger.run_calls;
    v_now timestamptz;
    v_detail jsonb;
BEGIN
    r := runledger._lock_leased_run(p_run_id, p_lease_id, p_fencing_token);
    v_now := runledger.now();  -- after the lock, as the lease check
    PERFORM runledger._check_word('outcome', p_outcome,
                                  ARRAY['succeeded', 'failed', 'unknown', 'not_applied']);
    PERFORM runledger._check_json_value_or_null('result', p_result);
    PERFORM runledger._check_json_object_or_null('receipt', p_receipt);
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
    -- progress: a run claimed again counts claims without it (crash_loop). The row is
    -- written only when there is a count to reset (revision 0009): after the first write
    -- of a lease there never is, and a call's own row carries its times.
    IF r.stalled_claims <> 0 THEN
        UPDATE runledger.runs SET stalled_claims = 0, updated_at = v_now
        WHERE run_id = p_run_id AND lease_id = p_lease_id;
    END IF;
    v_detail := jsonb_build_object('idempotency_key', p_idempotency_key, 'tool', c.tool,
                                   'attempt', c.attempts);
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

CREATE OR REPLACE FUNCTION runledger.complete_calls(p_run_id text, p_lease_id uuid, p_fencing_token bigint,
                                         p_keys text[], p_outcomes text[], p_results jsonb[],
                                         p_receipts jsonb[], p_next_key text DEFAULT NULL)
RETURNS int
LANGUAGE plpgsql SECURITY DEFINER
SET search_path = pg_catalog, runledger, pg_temp
AS $$
DECLARE
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
    r := runledger._lock_leased_run(p_run_id, p_lease_id, p_fencing_token);
    v_now := runledger.now();  -- after the lock, as the lease check
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
        PERFORM runledger._check_json_value_or_null('result', p_results[v_i]);
        PERFORM runledger._check_json_object_or_null('receipt', p_receipts[v_i]);
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

CREATE OR REPLACE FUNCTION runledger.finish_run(p_run_id text, p_lease_id uuid, p_fencing_token bigint,
                                     p_status text, p_result jsonb, p_reason text)
RETURNS void
LANGUAGE plpgsql SECURITY DEFINER
SET search_path = pg_catalog, runledger, pg_temp
AS $$
DECLARE
    r runledger.runs;
    v_now timestamptz;
    v_open integer;
    v_detail jsonb;
BEGIN
    r := runledger._lock_leased_run(p_run_id, p_lease_id, p_fencing_token);
    v_now := runledger.now();  -- after the lock, as the lease check
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
                                     r.state_version, v_detail);
        WHEN 'failed' THEN
            PERFORM runledger._event(p_run_id, 'run_failed', r.lease_owner, p_fencing_token,
                                     r.state_version, v_detail);
        WHEN 'paused' THEN
            PERFORM runledger._event(p_run_id, 'run_paused', r.lease_owner, p_fencing_token,
                                     r.state_version, v_detail);
    END CASE;
END
$$;

DROP FUNCTION runledger._lock_leased_run_at(text, uuid, bigint);
