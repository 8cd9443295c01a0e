-- runledger 0017: tracing (issue #11, deliverable 5). runs.traceparent holds the
-- submitter's W3C trace context (submit_run_v2); claim_runs_v4 returns it with each claimed
-- run, so that every worker that drives the run continues the same trace. submit_run is
-- now a wrapper of submit_run_v2 (no trace context); claim_runs_v3 is unchanged.
-- Frozen once merged: change things in a new revision (and in the living files).

-- NULL for every run there is: the CHECK's scan finds nothing to refuse.
ALTER TABLE runledger.runs
    ADD COLUMN traceparent text,
    ADD CONSTRAINT ck_runs_traceparent CHECK (
        traceparent ~ '^00-[0-9a-f]{32}-[0-9a-f]{16}-[0-9a-f]{2}$');

-- submit_run_v2 (revision 0017): submit_run, and the W3C trace context of the submitter
-- (p_traceparent, 'version-trace_id-parent_id-flags', version 00, lowercase hex; NULL:
-- none), stored on the run: every worker that drives the run continues that trace
-- (docs/operating.md, Tracing). A malformed one is refused (RL006) before anything is
-- written. A resubmission with another traceparent is still a no-op: the trace context
-- is not part of what identifies the run, and the first one stays.
CREATE FUNCTION runledger.submit_run_v2(p_run_id text, p_flow text, p_flow_version text,
                                        p_input jsonb, p_priority int DEFAULT 0,
                                        p_available_at timestamptz DEFAULT NULL,
                                        p_traceparent text DEFAULT NULL)
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
    IF p_traceparent IS NOT NULL
       AND (p_traceparent !~ '^00-[0-9a-f]{32}-[0-9a-f]{16}-[0-9a-f]{2}$'
            OR substr(p_traceparent, 4, 32) = repeat('0', 32)
            OR substr(p_traceparent, 37, 16) = repeat('0', 16)) THEN
        PERFORM runledger._raise('RL006',
            format('invalid traceparent %s', quote_literal(left(p_traceparent, 100))),
            'a W3C traceparent: 00-<32 hex trace id>-<16 hex parent id>-<2 hex flags>, '
            'lowercase, neither id all zeros',
            'pass NULL when the submitter has no trace context');
    END IF;

    INSERT INTO runledger.runs AS r (run_id, flow, flow_version, status, input, priority,
                                     available_at, created_at, updated_at, traceparent)
    VALUES (p_run_id, p_flow, p_flow_version, 'queued', p_input, p_priority,
            coalesce(p_available_at, v_now), v_now, v_now, p_traceparent)
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

-- submit_run: submit_run_v2 without a trace context (revision 0017: a wrapper of it).
CREATE OR REPLACE FUNCTION runledger.submit_run(p_run_id text, p_flow text, p_flow_version text,
                                     p_input jsonb, p_priority int DEFAULT 0,
                                     p_available_at timestamptz DEFAULT NULL)
RETURNS TABLE (run_id text, created boolean)
LANGUAGE sql SECURITY DEFINER
SET search_path = pg_catalog, runledger, pg_temp
AS $$
    SELECT s.run_id, s.created
    FROM runledger.submit_run_v2(p_run_id, p_flow, p_flow_version, p_input, p_priority,
                                 p_available_at, NULL) s
$$;

-- claim_runs_v4 (revision 0017): claim_runs_v3, and with each run its traceparent (the
-- submitter's W3C trace context, NULL when it was submitted without one): the worker
-- continues the run's trace with no read after the claim. claim_runs_v3's body with one
-- more column in its per-run read. claim_runs_v3 stays for workers of the previous release.
CREATE FUNCTION runledger.claim_runs_v4(p_worker_id text, p_flows text[], p_lease interval,
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

REVOKE ALL ON FUNCTION runledger.submit_run_v2(text, text, text, jsonb, int, timestamptz, text)
    FROM PUBLIC;
REVOKE ALL ON FUNCTION runledger.claim_runs_v4(text, text[], interval, int) FROM PUBLIC;
DO $roles$
BEGIN
    IF EXISTS (SELECT 1 FROM pg_roles WHERE rolname = 'runledger_worker') THEN
        GRANT EXECUTE ON FUNCTION
            runledger.submit_run_v2(text, text, text, jsonb, int, timestamptz, text),
            runledger.claim_runs_v4(text, text[], interval, int)
        TO runledger_worker;
    ELSE
        RAISE WARNING 'runledger: role runledger_worker does not exist; grant EXECUTE on runledger.submit_run_v2 and runledger.claim_runs_v4 by hand';
    END IF;
    IF EXISTS (SELECT 1 FROM pg_roles WHERE rolname = 'runledger_operator') THEN
        GRANT EXECUTE ON FUNCTION
            runledger.submit_run_v2(text, text, text, jsonb, int, timestamptz, text)
        TO runledger_operator;
    ELSE
        RAISE WARNING 'runledger: role runledger_operator does not exist; grant EXECUTE on runledger.submit_run_v2 by hand';
    END IF;
END
$roles$;
