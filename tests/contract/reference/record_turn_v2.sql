-- Reference for tests/contract/test_fast_path.py: record_turn_v2 (retired with the
-- baseline "0.1"), the slow twin record_turn_v3 was checked against: its own plpgsql body,
-- a loop that checks and inserts call by call. Vendored verbatim from commit 4b19f01,
-- service/runledger/db/sql/04_journal.sql, with one change only: the function is named
-- record_turn_v2_ref (CREATE OR REPLACE). Installed in the test database by the test;
-- never a migration.

CREATE OR REPLACE FUNCTION runledger.record_turn_v2_ref(p_run_id text, p_lease_id uuid, p_fencing_token bigint,
                                         p_turn int, p_calls jsonb, p_record jsonb,
                                         p_output jsonb DEFAULT NULL)
RETURNS void
LANGUAGE plpgsql SECURITY DEFINER
SET search_path = pg_catalog, runledger, pg_temp
AS $$
DECLARE
    r runledger.runs;
    v_next integer;
    v_existing runledger.run_turns;
    v_call jsonb;
    v_ids text[] := '{}';
    v_pos integer := 0;
    v_open integer;
BEGIN
    r := runledger._lock_leased_run(p_run_id, p_lease_id, p_fencing_token);
    PERFORM runledger._check_json_value('calls', p_calls, 2);
    IF jsonb_typeof(p_calls) <> 'array' THEN
        PERFORM runledger._raise('RL006', 'calls must be a JSON array', NULL, NULL);
    END IF;
    IF p_turn IS NULL OR p_turn < 0 THEN
        PERFORM runledger._raise('RL006', 'turn must be a non-negative integer', NULL, NULL);
    END IF;
    PERFORM runledger._check_json_object_or_null('record', p_record);
    PERFORM runledger._check_json_value_or_null('output', p_output);
    IF p_output IS NOT NULL AND jsonb_array_length(p_calls) > 0 THEN
        PERFORM runledger._raise('RL006', 'output is the final decision''s: it needs empty calls',
            format('turn %s has %s call(s)', p_turn, jsonb_array_length(p_calls)),
            'send the output with the decision that ends the run');
    END IF;

    SELECT t.* INTO v_existing FROM runledger.run_turns t
    WHERE t.run_id = p_run_id AND t.turn = p_turn;
    IF FOUND THEN
        IF v_existing.calls = p_calls AND v_existing.record IS NOT DISTINCT FROM p_record
           AND v_existing.output IS NOT DISTINCT FROM p_output THEN
            RETURN;  -- the same decision again (a retried ambiguous commit): no-op
        END IF;
        PERFORM runledger._raise('RL004',
            format('turn %s of run %s is already recorded with another decision', p_turn, p_run_id),
            CASE WHEN v_existing.calls = p_calls THEN 'the calls are the same; the record or the output differ'
                 ELSE 'the calls differ' END,
            'a recorded decision is never replaced: replay it');
    END IF;

    SELECT coalesce(max(t.turn) + 1, 0) INTO v_next FROM runledger.run_turns t
    WHERE t.run_id = p_run_id;
    IF p_turn <> v_next THEN
        PERFORM runledger._raise('RL004',
            format('turn %s of run %s is out of order', p_turn, p_run_id),
            format('the next turn to record is %s', v_next), NULL);
    END IF;
    SELECT count(*) INTO v_open FROM runledger.run_calls c
    WHERE c.run_id = p_run_id AND c.status NOT IN ('succeeded', 'failed');
    IF v_open > 0 THEN
        PERFORM runledger._raise('RL004',
            format('run %s has %s call(s) without a final result', p_run_id, v_open),
            NULL, 'complete every call of the previous turn before recording the next');
    END IF;

    FOR v_call IN SELECT e FROM jsonb_array_elements(p_calls) AS e LOOP
        IF jsonb_typeof(v_call) <> 'object' THEN
            PERFORM runledger._raise('RL006', 'each call must be a JSON object', NULL, NULL);
        END IF;
        IF jsonb_typeof(v_call -> 'call_id') IS DISTINCT FROM 'string'
           OR (v_call ->> 'call_id') !~ '^[A-Za-z0-9][A-Za-z0-9._-]{0,63}$' THEN
            PERFORM runledger._raise('RL006',
                format('invalid call id %s', coalesce(left(v_call ->> 'call_id', 100), 'NULL')),
                'a call id is 1-64 characters of [A-Za-z0-9._-]', NULL);
        END IF;
        IF (v_call ->> 'call_id') = ANY (v_ids) THEN
            PERFORM runledger._raise('RL006',
                format('call id %s appears twice in turn %s', v_call ->> 'call_id', p_turn),
                NULL, NULL);
        END IF;
        IF jsonb_typeof(v_call -> 'tool') IS DISTINCT FROM 'string'
           OR (v_call ->> 'tool') !~ '^[A-Za-z_][A-Za-z0-9._-]{0,127}$' THEN
            PERFORM runledger._raise('RL006',
                format('invalid tool name %s', coalesce(left(v_call ->> 'tool', 100), 'NULL')),
                NULL, NULL);
        END IF;
        IF jsonb_typeof(coalesce(v_call -> 'args', '{}'::jsonb)) <> 'object' THEN
            PERFORM runledger._raise('RL006',
                format('args of call %s must be a JSON object', v_call ->> 'call_id'), NULL, NULL);
        END IF;
        IF coalesce(jsonb_typeof(v_call -> 'provider_id'), 'null') NOT IN ('null', 'string') THEN
            PERFORM runledger._raise('RL006',
                format('provider id of call %s must be a string or null', v_call ->> 'call_id'),
                NULL, NULL);
        END IF;
        IF jsonb_typeof(v_call -> 'provider_id') = 'string' THEN
            PERFORM runledger._check_text('provider id', v_call ->> 'provider_id', 1,
                                          runledger._cap('provider_id'));
        END IF;
        IF v_call ? 'approval' AND jsonb_typeof(v_call -> 'approval') <> 'boolean' THEN
            PERFORM runledger._raise('RL006',
                format('approval of call %s must be true or false', v_call ->> 'call_id'),
                format('got %s', left((v_call -> 'approval')::text, 100)),
                'leave "approval" out for a call that needs none');
        END IF;
        v_ids := v_ids || (v_call ->> 'call_id');
    END LOOP;

    INSERT INTO runledger.run_turns (run_id, turn, calls, fencing_token, created_at, record, output)
    VALUES (p_run_id, p_turn, p_calls, p_fencing_token, runledger.now(), p_record, p_output);

    FOR v_call IN SELECT e FROM jsonb_array_elements(p_calls) AS e LOOP
        INSERT INTO runledger.run_calls (run_id, turn, call_id, position, tool, args,
                                         idempotency_key, status, attempts, provider_id,
                                         approval)
        VALUES (p_run_id, p_turn, v_call ->> 'call_id', v_pos, v_call ->> 'tool',
                coalesce(v_call -> 'args', '{}'::jsonb),
                p_run_id || ':' || p_turn || ':' || (v_call ->> 'call_id'), 'planned', 0,
                v_call ->> 'provider_id',
                CASE WHEN (v_call -> 'approval') = 'true'::jsonb THEN 'pending' END);
        v_pos := v_pos + 1;
    END LOOP;

    UPDATE runledger.runs SET stalled_claims = 0, updated_at = runledger.now()
    WHERE run_id = p_run_id AND lease_id = p_lease_id;
    PERFORM runledger._event(p_run_id, 'turn_recorded', r.lease_owner, p_fencing_token,
        r.state_version, jsonb_build_object('turn', p_turn, 'calls', jsonb_array_length(p_calls)));
END
$$;
