-- Reference for tests/contract/test_record_turn_v4_same_contract.py: record_turn_v4 as it
-- was before revision 0020, as that revision's downgrade restored it. Vendored verbatim
-- from commit 4b19f01, migrations/versions/0020_hot_turn_claim.down.sql (the file is gone
-- since the baseline "0.1"), with one change only: the function is named
-- record_turn_v4_0018. Installed in the test database by the test; never a migration.

CREATE OR REPLACE FUNCTION runledger.record_turn_v4_0018(p_run_id text, p_lease_id uuid, p_fencing_token bigint,
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
