-- runledger 0027 down: the CHECK constraints with their expressions inline, as in 0026.

ALTER TABLE runledger.runs
    DROP CONSTRAINT ck_runs_run_id,
    ADD CONSTRAINT ck_runs_run_id CHECK (run_id ~ '^[A-Za-z0-9][A-Za-z0-9._:@-]{0,127}$'),
    DROP CONSTRAINT ck_runs_status,
    ADD CONSTRAINT ck_runs_status CHECK (status IN ('queued', 'running', 'paused', 'succeeded', 'failed', 'cancelled')),
    DROP CONSTRAINT ck_runs_input_object,
    ADD CONSTRAINT ck_runs_input_object CHECK (jsonb_typeof(input) = 'object'),
    DROP CONSTRAINT ck_runs_state_object,
    ADD CONSTRAINT ck_runs_state_object CHECK (state IS NULL OR jsonb_typeof(state) = 'object'),
    DROP CONSTRAINT ck_runs_lease_complete,
    ADD CONSTRAINT ck_runs_lease_complete CHECK ((lease_id IS NULL) = (lease_expires_at IS NULL)),
    DROP CONSTRAINT ck_runs_running_has_lease,
    ADD CONSTRAINT ck_runs_running_has_lease CHECK ((status = 'running') = (lease_id IS NOT NULL)),
    DROP CONSTRAINT ck_runs_finished_at,
    ADD CONSTRAINT ck_runs_finished_at CHECK ((status IN ('succeeded', 'failed', 'cancelled')) = (finished_at IS NOT NULL)),
    DROP CONSTRAINT ck_runs_traceparent,
    ADD CONSTRAINT ck_runs_traceparent CHECK (traceparent ~ '^00-[0-9a-f]{32}-[0-9a-f]{16}-[0-9a-f]{2}$');

ALTER TABLE runledger.run_turns
    DROP CONSTRAINT ck_run_turns_turn,
    ADD CONSTRAINT ck_run_turns_turn CHECK (turn >= 0),
    DROP CONSTRAINT ck_run_turns_calls_array,
    ADD CONSTRAINT ck_run_turns_calls_array CHECK (jsonb_typeof(calls) = 'array'),
    DROP CONSTRAINT ck_run_turns_record_object,
    ADD CONSTRAINT ck_run_turns_record_object CHECK (record IS NULL OR jsonb_typeof(record) = 'object'),
    DROP CONSTRAINT ck_run_turns_output_final,
    ADD CONSTRAINT ck_run_turns_output_final CHECK (output IS NULL OR calls = '[]'::jsonb);

ALTER TABLE runledger.run_calls
    DROP CONSTRAINT ck_run_calls_status,
    ADD CONSTRAINT ck_run_calls_status CHECK (status IN ('planned', 'dispatched', 'succeeded', 'failed', 'unknown')),
    DROP CONSTRAINT ck_run_calls_args_object,
    ADD CONSTRAINT ck_run_calls_args_object CHECK (jsonb_typeof(args) = 'object'),
    DROP CONSTRAINT ck_run_calls_attempts,
    ADD CONSTRAINT ck_run_calls_attempts CHECK (attempts >= 0),
    DROP CONSTRAINT ck_run_calls_key,
    ADD CONSTRAINT ck_run_calls_key CHECK (idempotency_key = run_id || ':' || turn || ':' || call_id),
    DROP CONSTRAINT ck_run_calls_approval,
    ADD CONSTRAINT ck_run_calls_approval CHECK (approval IN ('pending', 'approved', 'denied')),
    DROP CONSTRAINT ck_run_calls_approval_status,
    ADD CONSTRAINT ck_run_calls_approval_status CHECK (CASE approval WHEN 'pending' THEN status = 'planned'
                          WHEN 'denied' THEN status = 'failed'
                          ELSE true END),
    DROP CONSTRAINT ck_run_calls_approval_decided,
    ADD CONSTRAINT ck_run_calls_approval_decided CHECK (CASE WHEN approval IN ('approved', 'denied')
                THEN approval_by IS NOT NULL AND approval_at IS NOT NULL
                ELSE approval_by IS NULL AND approval_at IS NULL AND approval_note IS NULL END);

ALTER TABLE runledger.run_events
    DROP CONSTRAINT ck_run_events_hash,
    ADD CONSTRAINT ck_run_events_hash CHECK (hash IS NULL OR octet_length(hash) = 32);

DROP FUNCTION runledger._ck_runs_run_id(text);
DROP FUNCTION runledger._ck_runs_status(text);
DROP FUNCTION runledger._ck_runs_input_object(jsonb);
DROP FUNCTION runledger._ck_runs_state_object(jsonb);
DROP FUNCTION runledger._ck_runs_lease_complete(uuid, timestamptz);
DROP FUNCTION runledger._ck_runs_running_has_lease(text, uuid);
DROP FUNCTION runledger._ck_runs_finished_at(text, timestamptz);
DROP FUNCTION runledger._ck_runs_traceparent(text);
DROP FUNCTION runledger._ck_run_turns_turn(integer);
DROP FUNCTION runledger._ck_run_turns_calls_array(jsonb);
DROP FUNCTION runledger._ck_run_turns_record_object(jsonb);
DROP FUNCTION runledger._ck_run_turns_output_final(jsonb, jsonb);
DROP FUNCTION runledger._ck_run_calls_status(text);
DROP FUNCTION runledger._ck_run_calls_args_object(jsonb);
DROP FUNCTION runledger._ck_run_calls_attempts(integer);
DROP FUNCTION runledger._ck_run_calls_key(text, text, integer, text);
DROP FUNCTION runledger._ck_run_calls_approval(text);
DROP FUNCTION runledger._ck_run_calls_approval_status(text, text);
DROP FUNCTION runledger._ck_run_calls_approval_decided(text, text, timestamptz, text);
DROP FUNCTION runledger._ck_run_events_hash(bytea);
