-- runledger 0026: finish_and_claim, a run's final decision and the same worker's next
-- claim in one transaction (record_turn_v4 finishing the run, then claim_runs_v4). A
-- worker with one run in hand sends it instead of the decision and then the claim.
-- Frozen once merged: change things in a new revision (and in the living files).

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


REVOKE ALL ON FUNCTION runledger.finish_and_claim(text, uuid, bigint, int, jsonb, jsonb, bigint,
                                                  jsonb, text, text[], interval, int) FROM PUBLIC;
DO $roles$
BEGIN
    IF EXISTS (SELECT 1 FROM pg_roles WHERE rolname = 'runledger_worker') THEN
        GRANT EXECUTE ON FUNCTION
            runledger.finish_and_claim(text, uuid, bigint, int, jsonb, jsonb, bigint, jsonb, text,
                                       text[], interval, int)
        TO runledger_worker;
    ELSE
        RAISE WARNING 'runledger: role runledger_worker does not exist; grant EXECUTE on runledger.finish_and_claim by hand';
    END IF;
END
$roles$;
