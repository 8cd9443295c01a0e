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
