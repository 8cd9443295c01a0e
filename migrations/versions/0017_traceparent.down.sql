-- runledger 0017 down: back to the previous revision exactly (submit_run in PL/pgSQL as before, no
-- submit_run_v2, no claim_runs_v4, no runs.traceparent).

DROP FUNCTION runledger.claim_runs_v4(text, text[], interval, int);
CREATE OR REPLACE FUNCTION runledger.submit_run(p_run_id text, p_flow text, p_flow_version text,
                                     p_input jsonb, p_priority int DEFAULT 0,
                                     p_available_at timestamptz DEFAULT NULL)
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

    INSERT INTO runledger.runs AS r (run_id, flow, flow_version, status, input, priority,
                                     available_at, created_at, updated_at)
    VALUES (p_run_id, p_flow, p_flow_version, 'queued', p_input, p_priority,
            coalesce(p_available_at, v_now), v_now, v_now)
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

DROP FUNCTION runledger.submit_run_v2(text, text, text, jsonb, int, timestamptz, text);
ALTER TABLE runledger.runs DROP COLUMN traceparent;
