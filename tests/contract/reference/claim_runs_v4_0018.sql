-- Reference for tests/contract/test_claim_runs_v4_same_contract.py: claim_runs_v4 as it
-- was before revision 0020 (a loop over claim_runs with a read per claimed run), and the
-- claim_runs (v1, retired with the baseline "0.1") that the loop calls.
--
-- claim_runs_v4_0018: vendored verbatim from commit 4b19f01,
-- migrations/versions/0020_hot_turn_claim.down.sql (gone since the baseline), renamed, its
-- call of runledger.claim_runs rewritten to runledger.claim_runs_v1_ref.
-- claim_runs_v1_ref: claim_runs as the loop called it when the test last ran against the
-- live claim_runs (commit 4b19f01, service/runledger/db/sql/03_leases.sql): the claim of
-- runledger._claim without the per-run read; renamed, CREATE OR REPLACE.
-- (0020's downgrade also restored 0019's standalone claim_runs body; that one returns the
-- claimed runs in the order of its UPDATE, not by priority, so it is not the oracle.)
--
-- Installed in the test database by the test; never a migration.

CREATE OR REPLACE FUNCTION runledger.claim_runs_v1_ref(p_worker_id text, p_flows text[], p_lease interval,
                                     p_max_runs int)
RETURNS TABLE (run_id text, flow text, flow_version text, input jsonb, state jsonb,
               state_version bigint, fencing_token bigint, lease_id uuid,
               lease_expires_at timestamptz, takeover boolean)
LANGUAGE sql SECURITY DEFINER
SET search_path = pg_catalog, runledger, pg_temp
AS $$
    SELECT c.run_id, c.flow, c.flow_version, c.input, c.state, c.state_version, c.fencing_token,
           c.lease_id, c.lease_expires_at, c.takeover
    FROM runledger._claim(p_worker_id, p_flows, p_lease, p_max_runs, false) c
$$;

CREATE OR REPLACE FUNCTION runledger.claim_runs_v4_0018(p_worker_id text, p_flows text[], p_lease interval,
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
    FOR v_claim IN SELECT * FROM runledger.claim_runs_v1_ref(p_worker_id, p_flows, p_lease, p_max_runs)
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
