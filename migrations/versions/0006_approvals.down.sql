-- runledger 0006 down: back to 0005 exactly. Drops approve_call, deny_call and their
-- helpers, restores record_turn_v2, dispatch_call, resolve_call and _guard_run_calls as
-- 0005 left them, and drops the approval columns of run_calls (and what they held) with
-- their constraints. It refuses (RL004) while a call awaits approval.

-- 0005 has no approvals: a call awaiting one would become a plain planned call, and the
-- next worker would send it unapproved. Refuse while any call awaits a person.
DO $$
DECLARE
    v_waiting bigint;
BEGIN
    SELECT count(*) INTO v_waiting FROM runledger.run_calls WHERE approval = 'pending';
    IF v_waiting > 0 THEN
        RAISE EXCEPTION USING
            ERRCODE = 'RL004',
            MESSAGE = format('%s call(s) await approval: downgrading below 0006 would send '
                             'them unapproved', v_waiting),
            HINT = 'approve or deny each first (runledger approve KEY / runledger deny KEY '
                   '--reason ...); SELECT idempotency_key FROM runledger.run_calls WHERE '
                   'approval = ''pending'' lists them';
    END IF;
END
$$;

DROP FUNCTION runledger.approve_call(text, text, text);
DROP FUNCTION runledger.deny_call(text, text, text);
DROP FUNCTION runledger._lock_awaiting_call(text);

CREATE OR REPLACE FUNCTION runledger.resolve_call(p_idempotency_key text, p_resolution text,
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
    v_left integer;
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
    SELECT count(*) INTO v_left FROM runledger.run_calls x
    WHERE x.run_id = v_run_id AND x.status = 'unknown';
    IF v_left = 0 AND r.status = 'paused' THEN
        UPDATE runledger.runs
        SET status = 'queued', pause_reason = NULL, available_at = v_now, updated_at = v_now
        WHERE run_id = v_run_id AND status = 'paused';
        PERFORM runledger._event(v_run_id, 'run_requeued', p_actor, NULL, r.state_version,
                                 jsonb_build_object('after', 'resolve_call'));
        PERFORM runledger._notify_queued(r.flow, r.flow_version);
    END IF;
END
$$;

DROP FUNCTION runledger._requeue_if_settled(runledger.runs, text, text, timestamptz);

CREATE OR REPLACE FUNCTION runledger.record_turn_v2(p_run_id text, p_lease_id uuid, p_fencing_token bigint,
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
        v_ids := v_ids || (v_call ->> 'call_id');
    END LOOP;

    INSERT INTO runledger.run_turns (run_id, turn, calls, fencing_token, created_at, record, output)
    VALUES (p_run_id, p_turn, p_calls, p_fencing_token, runledger.now(), p_record, p_output);

    FOR v_call IN SELECT e FROM jsonb_array_elements(p_calls) AS e LOOP
        INSERT INTO runledger.run_calls (run_id, turn, call_id, position, tool, args,
                                         idempotency_key, status, attempts, provider_id)
        VALUES (p_run_id, p_turn, v_call ->> 'call_id', v_pos, v_call ->> 'tool',
                coalesce(v_call -> 'args', '{}'::jsonb),
                p_run_id || ':' || p_turn || ':' || (v_call ->> 'call_id'), 'planned', 0,
                v_call ->> 'provider_id');
        v_pos := v_pos + 1;
    END LOOP;

    UPDATE runledger.runs SET stalled_claims = 0, updated_at = runledger.now()
    WHERE run_id = p_run_id AND lease_id = p_lease_id;
    PERFORM runledger._event(p_run_id, 'turn_recorded', r.lease_owner, p_fencing_token,
        r.state_version, jsonb_build_object('turn', p_turn, 'calls', jsonb_array_length(p_calls)));
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
    c runledger.run_calls;
    v_now timestamptz;
BEGIN
    r := runledger._lock_leased_run(p_run_id, p_lease_id, p_fencing_token);
    v_now := runledger.now();  -- after the lock, as the lease check
    c := runledger._lock_call(p_run_id, p_idempotency_key);
    IF c.status NOT IN ('planned', 'dispatched') THEN
        PERFORM runledger._raise('RL004',
            format('call %s is %s and cannot be dispatched', p_idempotency_key, c.status),
            format('attempts %s, last token %s', c.attempts,
                   coalesce(c.completed_token, c.dispatched_token)),
            CASE c.status WHEN 'unknown'
                 THEN 'an operator must resolve it (runledger resolve)'
                 ELSE 'the call already has a final result: reuse it' END);
    END IF;
    UPDATE runledger.run_calls
    SET status = 'dispatched', attempts = c.attempts + 1, dispatched_token = p_fencing_token,
        dispatched_by = r.lease_owner, dispatched_at = v_now
    WHERE idempotency_key = p_idempotency_key AND status IN ('planned', 'dispatched');
    PERFORM runledger._event(p_run_id, 'call_dispatched', r.lease_owner, p_fencing_token,
        r.state_version, jsonb_build_object('idempotency_key', p_idempotency_key,
                                            'tool', c.tool, 'attempt', c.attempts + 1,
                                            'previous_status', c.status));
    RETURN c.attempts + 1;
END
$$;

CREATE OR REPLACE FUNCTION runledger._guard_run_calls() RETURNS trigger
LANGUAGE plpgsql SECURITY DEFINER
SET search_path = pg_catalog, runledger, pg_temp
AS $$
BEGIN
    IF TG_OP = 'DELETE' THEN
        IF NOT runledger._prune_authorized() THEN
            PERFORM runledger._raise('RL007',
                format('calls are deleted only by runledger.prune_runs (%s)', OLD.idempotency_key),
                NULL, 'a session setting does not authorize a delete');
        END IF;
        RETURN OLD;
    END IF;
    IF NEW.idempotency_key <> OLD.idempotency_key OR NEW.run_id <> OLD.run_id
       OR NEW.turn <> OLD.turn OR NEW.call_id <> OLD.call_id OR NEW.tool <> OLD.tool
       OR NEW.args <> OLD.args OR NEW.provider_id IS DISTINCT FROM OLD.provider_id THEN
        PERFORM runledger._raise('RL007',
            format('call %s: key, tool, args and provider id are immutable', OLD.idempotency_key),
            NULL, NULL);
    END IF;
    IF OLD.status = 'succeeded' AND (NEW.status <> OLD.status
        OR NEW.result IS DISTINCT FROM OLD.result OR NEW.receipt IS DISTINCT FROM OLD.receipt) THEN
        PERFORM runledger._raise('RL007',
            format('call %s succeeded; its result and receipt cannot be overwritten',
                   OLD.idempotency_key),
            format('receipt %s', OLD.receipt), NULL);
    END IF;
    IF NEW.attempts < OLD.attempts THEN
        PERFORM runledger._raise('RL007',
            format('attempts of call %s cannot decrease', OLD.idempotency_key), NULL, NULL);
    END IF;
    RETURN NEW;
END
$$;

ALTER TABLE runledger.run_calls DROP CONSTRAINT ck_run_calls_approval_decided;
ALTER TABLE runledger.run_calls DROP CONSTRAINT ck_run_calls_approval_status;
ALTER TABLE runledger.run_calls DROP CONSTRAINT ck_run_calls_approval;
ALTER TABLE runledger.run_calls DROP COLUMN approval_at;
ALTER TABLE runledger.run_calls DROP COLUMN approval_note;
ALTER TABLE runledger.run_calls DROP COLUMN approval_by;
ALTER TABLE runledger.run_calls DROP COLUMN approval;
