-- runledger 0027: every CHECK constraint of runs, run_turns, run_calls and run_events calls
-- a PL/pgSQL function of the columns it reads, whose body is the constraint's expression
-- as before. Same names, same rows accepted, same error (23514 naming the constraint).
-- PostgreSQL 15 deserializes, simplifies and compiles the expression of every CHECK of a
-- table at each INSERT or UPDATE statement; PL/pgSQL compiles a function's body once per
-- session. Each table is scanned once to validate its new constraints.
-- Frozen once merged: change things in a new revision (and in the living files).

CREATE FUNCTION runledger._ck_runs_run_id(run_id text)
RETURNS boolean LANGUAGE plpgsql IMMUTABLE PARALLEL SAFE
AS $$ BEGIN
    RETURN run_id OPERATOR(pg_catalog.~) '^[A-Za-z0-9][A-Za-z0-9._:@-]{0,127}$';
END $$;

CREATE FUNCTION runledger._ck_runs_status(status text)
RETURNS boolean LANGUAGE plpgsql IMMUTABLE PARALLEL SAFE
AS $$ BEGIN
    RETURN status OPERATOR(pg_catalog.=) ANY (ARRAY['queued', 'running', 'paused', 'succeeded', 'failed',
           'cancelled']);
END $$;

CREATE FUNCTION runledger._ck_runs_input_object(input jsonb)
RETURNS boolean LANGUAGE plpgsql IMMUTABLE PARALLEL SAFE
AS $$ BEGIN
    RETURN pg_catalog.jsonb_typeof(input) OPERATOR(pg_catalog.=) 'object';
END $$;

CREATE FUNCTION runledger._ck_runs_state_object(state jsonb)
RETURNS boolean LANGUAGE plpgsql IMMUTABLE PARALLEL SAFE
AS $$ BEGIN
    RETURN state IS NULL OR pg_catalog.jsonb_typeof(state) OPERATOR(pg_catalog.=) 'object';
END $$;

CREATE FUNCTION runledger._ck_runs_lease_complete(lease_id uuid, lease_expires_at timestamptz)
RETURNS boolean LANGUAGE plpgsql IMMUTABLE PARALLEL SAFE
AS $$ BEGIN
    RETURN (lease_id IS NULL) OPERATOR(pg_catalog.=) (lease_expires_at IS NULL);
END $$;

CREATE FUNCTION runledger._ck_runs_running_has_lease(status text, lease_id uuid)
RETURNS boolean LANGUAGE plpgsql IMMUTABLE PARALLEL SAFE
AS $$ BEGIN
    RETURN (status OPERATOR(pg_catalog.=) 'running') OPERATOR(pg_catalog.=) (lease_id IS NOT NULL);
END $$;

CREATE FUNCTION runledger._ck_runs_finished_at(status text, finished_at timestamptz)
RETURNS boolean LANGUAGE plpgsql IMMUTABLE PARALLEL SAFE
AS $$ BEGIN
    RETURN (status OPERATOR(pg_catalog.=) ANY (ARRAY['succeeded', 'failed', 'cancelled']))
           OPERATOR(pg_catalog.=) (finished_at IS NOT NULL);
END $$;

CREATE FUNCTION runledger._ck_runs_traceparent(traceparent text)
RETURNS boolean LANGUAGE plpgsql IMMUTABLE PARALLEL SAFE
AS $$ BEGIN
    RETURN traceparent OPERATOR(pg_catalog.~) '^00-[0-9a-f]{32}-[0-9a-f]{16}-[0-9a-f]{2}$';
END $$;

CREATE FUNCTION runledger._ck_run_turns_turn(turn integer)
RETURNS boolean LANGUAGE plpgsql IMMUTABLE PARALLEL SAFE
AS $$ BEGIN
    RETURN turn OPERATOR(pg_catalog.>=) 0;
END $$;

CREATE FUNCTION runledger._ck_run_turns_calls_array(calls jsonb)
RETURNS boolean LANGUAGE plpgsql IMMUTABLE PARALLEL SAFE
AS $$ BEGIN
    RETURN pg_catalog.jsonb_typeof(calls) OPERATOR(pg_catalog.=) 'array';
END $$;

CREATE FUNCTION runledger._ck_run_turns_record_object(record jsonb)
RETURNS boolean LANGUAGE plpgsql IMMUTABLE PARALLEL SAFE
AS $$ BEGIN
    RETURN record IS NULL OR pg_catalog.jsonb_typeof(record) OPERATOR(pg_catalog.=) 'object';
END $$;

CREATE FUNCTION runledger._ck_run_turns_output_final(output jsonb, calls jsonb)
RETURNS boolean LANGUAGE plpgsql IMMUTABLE PARALLEL SAFE
AS $$ BEGIN
    RETURN output IS NULL OR calls OPERATOR(pg_catalog.=) '[]'::pg_catalog.jsonb;
END $$;

CREATE FUNCTION runledger._ck_run_calls_status(status text)
RETURNS boolean LANGUAGE plpgsql IMMUTABLE PARALLEL SAFE
AS $$ BEGIN
    RETURN status OPERATOR(pg_catalog.=) ANY (ARRAY['planned', 'dispatched', 'succeeded', 'failed',
           'unknown']);
END $$;

CREATE FUNCTION runledger._ck_run_calls_args_object(args jsonb)
RETURNS boolean LANGUAGE plpgsql IMMUTABLE PARALLEL SAFE
AS $$ BEGIN
    RETURN pg_catalog.jsonb_typeof(args) OPERATOR(pg_catalog.=) 'object';
END $$;

CREATE FUNCTION runledger._ck_run_calls_attempts(attempts integer)
RETURNS boolean LANGUAGE plpgsql IMMUTABLE PARALLEL SAFE
AS $$ BEGIN
    RETURN attempts OPERATOR(pg_catalog.>=) 0;
END $$;

CREATE FUNCTION runledger._ck_run_calls_key(idempotency_key text, run_id text, turn integer,
                                            call_id text)
RETURNS boolean LANGUAGE plpgsql IMMUTABLE PARALLEL SAFE
AS $$ BEGIN
    RETURN idempotency_key OPERATOR(pg_catalog.=) (run_id OPERATOR(pg_catalog.||) ':'
           OPERATOR(pg_catalog.||) turn::pg_catalog.text OPERATOR(pg_catalog.||) ':'
           OPERATOR(pg_catalog.||) call_id);
END $$;

CREATE FUNCTION runledger._ck_run_calls_approval(approval text)
RETURNS boolean LANGUAGE plpgsql IMMUTABLE PARALLEL SAFE
AS $$ BEGIN
    RETURN approval OPERATOR(pg_catalog.=) ANY (ARRAY['pending', 'approved', 'denied']);
END $$;

CREATE FUNCTION runledger._ck_run_calls_approval_status(approval text, status text)
RETURNS boolean LANGUAGE plpgsql IMMUTABLE PARALLEL SAFE
AS $$ BEGIN
    RETURN CASE WHEN approval OPERATOR(pg_catalog.=) 'pending' THEN status OPERATOR(pg_catalog.=) 'planned'
           WHEN approval OPERATOR(pg_catalog.=) 'denied' THEN status OPERATOR(pg_catalog.=) 'failed'
           ELSE true END;
END $$;

CREATE FUNCTION runledger._ck_run_calls_approval_decided(approval text, approval_by text,
                                                         approval_at timestamptz,
                                                         approval_note text)
RETURNS boolean LANGUAGE plpgsql IMMUTABLE PARALLEL SAFE
AS $$ BEGIN
    RETURN CASE WHEN approval OPERATOR(pg_catalog.=) ANY (ARRAY['approved', 'denied'])
           THEN approval_by IS NOT NULL AND approval_at IS NOT NULL
           ELSE approval_by IS NULL AND approval_at IS NULL AND approval_note IS NULL END;
END $$;

CREATE FUNCTION runledger._ck_run_events_hash(hash bytea)
RETURNS boolean LANGUAGE plpgsql IMMUTABLE PARALLEL SAFE
AS $$ BEGIN
    RETURN hash IS NULL OR pg_catalog.octet_length(hash) OPERATOR(pg_catalog.=) 32;
END $$;

-- explicit privileges, as 08_roles.sql leaves them: EXECUTE for PUBLIC (a CHECK's function
-- runs with the writer's rights)
REVOKE ALL ON FUNCTION runledger._ck_runs_run_id(text) FROM PUBLIC;
REVOKE ALL ON FUNCTION runledger._ck_runs_status(text) FROM PUBLIC;
REVOKE ALL ON FUNCTION runledger._ck_runs_input_object(jsonb) FROM PUBLIC;
REVOKE ALL ON FUNCTION runledger._ck_runs_state_object(jsonb) FROM PUBLIC;
REVOKE ALL ON FUNCTION runledger._ck_runs_lease_complete(uuid, timestamptz) FROM PUBLIC;
REVOKE ALL ON FUNCTION runledger._ck_runs_running_has_lease(text, uuid) FROM PUBLIC;
REVOKE ALL ON FUNCTION runledger._ck_runs_finished_at(text, timestamptz) FROM PUBLIC;
REVOKE ALL ON FUNCTION runledger._ck_runs_traceparent(text) FROM PUBLIC;
REVOKE ALL ON FUNCTION runledger._ck_run_turns_turn(integer) FROM PUBLIC;
REVOKE ALL ON FUNCTION runledger._ck_run_turns_calls_array(jsonb) FROM PUBLIC;
REVOKE ALL ON FUNCTION runledger._ck_run_turns_record_object(jsonb) FROM PUBLIC;
REVOKE ALL ON FUNCTION runledger._ck_run_turns_output_final(jsonb, jsonb) FROM PUBLIC;
REVOKE ALL ON FUNCTION runledger._ck_run_calls_status(text) FROM PUBLIC;
REVOKE ALL ON FUNCTION runledger._ck_run_calls_args_object(jsonb) FROM PUBLIC;
REVOKE ALL ON FUNCTION runledger._ck_run_calls_attempts(integer) FROM PUBLIC;
REVOKE ALL ON FUNCTION runledger._ck_run_calls_key(text, text, integer, text) FROM PUBLIC;
REVOKE ALL ON FUNCTION runledger._ck_run_calls_approval(text) FROM PUBLIC;
REVOKE ALL ON FUNCTION runledger._ck_run_calls_approval_status(text, text) FROM PUBLIC;
REVOKE ALL ON FUNCTION runledger._ck_run_calls_approval_decided(text, text, timestamptz, text) FROM PUBLIC;
REVOKE ALL ON FUNCTION runledger._ck_run_events_hash(bytea) FROM PUBLIC;
GRANT EXECUTE ON FUNCTION runledger._ck_runs_run_id(text) TO PUBLIC;
GRANT EXECUTE ON FUNCTION runledger._ck_runs_status(text) TO PUBLIC;
GRANT EXECUTE ON FUNCTION runledger._ck_runs_input_object(jsonb) TO PUBLIC;
GRANT EXECUTE ON FUNCTION runledger._ck_runs_state_object(jsonb) TO PUBLIC;
GRANT EXECUTE ON FUNCTION runledger._ck_runs_lease_complete(uuid, timestamptz) TO PUBLIC;
GRANT EXECUTE ON FUNCTION runledger._ck_runs_running_has_lease(text, uuid) TO PUBLIC;
GRANT EXECUTE ON FUNCTION runledger._ck_runs_finished_at(text, timestamptz) TO PUBLIC;
GRANT EXECUTE ON FUNCTION runledger._ck_runs_traceparent(text) TO PUBLIC;
GRANT EXECUTE ON FUNCTION runledger._ck_run_turns_turn(integer) TO PUBLIC;
GRANT EXECUTE ON FUNCTION runledger._ck_run_turns_calls_array(jsonb) TO PUBLIC;
GRANT EXECUTE ON FUNCTION runledger._ck_run_turns_record_object(jsonb) TO PUBLIC;
GRANT EXECUTE ON FUNCTION runledger._ck_run_turns_output_final(jsonb, jsonb) TO PUBLIC;
GRANT EXECUTE ON FUNCTION runledger._ck_run_calls_status(text) TO PUBLIC;
GRANT EXECUTE ON FUNCTION runledger._ck_run_calls_args_object(jsonb) TO PUBLIC;
GRANT EXECUTE ON FUNCTION runledger._ck_run_calls_attempts(integer) TO PUBLIC;
GRANT EXECUTE ON FUNCTION runledger._ck_run_calls_key(text, text, integer, text) TO PUBLIC;
GRANT EXECUTE ON FUNCTION runledger._ck_run_calls_approval(text) TO PUBLIC;
GRANT EXECUTE ON FUNCTION runledger._ck_run_calls_approval_status(text, text) TO PUBLIC;
GRANT EXECUTE ON FUNCTION runledger._ck_run_calls_approval_decided(text, text, timestamptz, text) TO PUBLIC;
GRANT EXECUTE ON FUNCTION runledger._ck_run_events_hash(bytea) TO PUBLIC;

ALTER TABLE runledger.runs
    DROP CONSTRAINT ck_runs_run_id,
    ADD CONSTRAINT ck_runs_run_id CHECK (runledger._ck_runs_run_id(run_id)),
    DROP CONSTRAINT ck_runs_status,
    ADD CONSTRAINT ck_runs_status CHECK (runledger._ck_runs_status(status)),
    DROP CONSTRAINT ck_runs_input_object,
    ADD CONSTRAINT ck_runs_input_object CHECK (runledger._ck_runs_input_object(input)),
    DROP CONSTRAINT ck_runs_state_object,
    ADD CONSTRAINT ck_runs_state_object CHECK (runledger._ck_runs_state_object(state)),
    DROP CONSTRAINT ck_runs_lease_complete,
    ADD CONSTRAINT ck_runs_lease_complete CHECK (
        runledger._ck_runs_lease_complete(lease_id, lease_expires_at)),
    DROP CONSTRAINT ck_runs_running_has_lease,
    ADD CONSTRAINT ck_runs_running_has_lease CHECK (
        runledger._ck_runs_running_has_lease(status, lease_id)),
    DROP CONSTRAINT ck_runs_finished_at,
    ADD CONSTRAINT ck_runs_finished_at CHECK (runledger._ck_runs_finished_at(status, finished_at)),
    DROP CONSTRAINT ck_runs_traceparent,
    ADD CONSTRAINT ck_runs_traceparent CHECK (runledger._ck_runs_traceparent(traceparent));

ALTER TABLE runledger.run_turns
    DROP CONSTRAINT ck_run_turns_turn,
    ADD CONSTRAINT ck_run_turns_turn CHECK (runledger._ck_run_turns_turn(turn)),
    DROP CONSTRAINT ck_run_turns_calls_array,
    ADD CONSTRAINT ck_run_turns_calls_array CHECK (runledger._ck_run_turns_calls_array(calls)),
    DROP CONSTRAINT ck_run_turns_record_object,
    ADD CONSTRAINT ck_run_turns_record_object CHECK (runledger._ck_run_turns_record_object(record)),
    DROP CONSTRAINT ck_run_turns_output_final,
    ADD CONSTRAINT ck_run_turns_output_final CHECK (
        runledger._ck_run_turns_output_final(output, calls));

ALTER TABLE runledger.run_calls
    DROP CONSTRAINT ck_run_calls_status,
    ADD CONSTRAINT ck_run_calls_status CHECK (runledger._ck_run_calls_status(status)),
    DROP CONSTRAINT ck_run_calls_args_object,
    ADD CONSTRAINT ck_run_calls_args_object CHECK (runledger._ck_run_calls_args_object(args)),
    DROP CONSTRAINT ck_run_calls_attempts,
    ADD CONSTRAINT ck_run_calls_attempts CHECK (runledger._ck_run_calls_attempts(attempts)),
    DROP CONSTRAINT ck_run_calls_key,
    ADD CONSTRAINT ck_run_calls_key CHECK (
        runledger._ck_run_calls_key(idempotency_key, run_id, turn, call_id)),
    DROP CONSTRAINT ck_run_calls_approval,
    ADD CONSTRAINT ck_run_calls_approval CHECK (runledger._ck_run_calls_approval(approval)),
    DROP CONSTRAINT ck_run_calls_approval_status,
    ADD CONSTRAINT ck_run_calls_approval_status CHECK (
        runledger._ck_run_calls_approval_status(approval, status)),
    DROP CONSTRAINT ck_run_calls_approval_decided,
    ADD CONSTRAINT ck_run_calls_approval_decided CHECK (
        runledger._ck_run_calls_approval_decided(approval, approval_by, approval_at, approval_note));

ALTER TABLE runledger.run_events
    DROP CONSTRAINT ck_run_events_hash,
    ADD CONSTRAINT ck_run_events_hash CHECK (runledger._ck_run_events_hash(hash));
