-- runledger 0002: the contract moves to its living home (runledger/db/sql).
-- Helpers: one per repeated check (_check_worker_id, _check_lease, _check_flow), four
-- named JSON checks instead of _check_json's two booleans, _notify_queued; _event takes
-- the time of a set-based statement and every event kind is a literal at its writer.
-- New: release_lease(p_run_id, p_lease_id, p_fencing_token, p_reason, p_error), a hand-back
-- after a worker error that keeps the stalled-claim count. No table changes.
-- Frozen once merged: change things in a new revision (and in the living files).


-- Helpers replaced by the ones below (internal: no grant refers to them).
DROP FUNCTION runledger._check_json(text, jsonb, boolean, boolean);
DROP FUNCTION runledger._event(text, text, text, bigint, bigint, jsonb);

-- New functions.

CREATE FUNCTION runledger._check_worker_id(p_worker_id text) RETURNS void
LANGUAGE plpgsql IMMUTABLE
SET search_path = pg_catalog, runledger, pg_temp
AS $$
BEGIN
    IF p_worker_id IS NULL OR length(p_worker_id) NOT BETWEEN 1 AND 200 THEN
        PERFORM runledger._raise('RL006', 'worker id must be 1-200 characters', NULL, NULL);
    END IF;
END
$$;

CREATE FUNCTION runledger._check_lease(p_lease interval) RETURNS void
LANGUAGE plpgsql STABLE
SET search_path = pg_catalog, runledger, pg_temp
AS $$
BEGIN
    IF p_lease IS NULL OR p_lease <= interval '0' OR p_lease > interval '1 day' THEN
        PERFORM runledger._raise('RL006', format('lease %s must be positive and at most a day',
            coalesce(p_lease::text, 'NULL')), NULL, NULL);
    END IF;
END
$$;

CREATE FUNCTION runledger._check_flow(p_flow text, p_flow_version text) RETURNS void
LANGUAGE plpgsql IMMUTABLE
SET search_path = pg_catalog, runledger, pg_temp
AS $$
BEGIN
    IF p_flow IS NULL OR p_flow !~ '^[A-Za-z0-9][A-Za-z0-9._-]{0,127}$' THEN
        PERFORM runledger._raise('RL006', format('invalid flow name %s',
            coalesce(quote_literal(left(p_flow, 200)), 'NULL')),
            'a flow name is 1-128 characters of [A-Za-z0-9._-]', NULL);
    END IF;
    IF p_flow_version IS NULL OR p_flow_version !~ '^[A-Za-z0-9][A-Za-z0-9._+-]{0,63}$' THEN
        PERFORM runledger._raise('RL006', format('invalid flow version %s',
            coalesce(quote_literal(left(p_flow_version, 100)), 'NULL')),
            'a flow version is 1-64 characters of [A-Za-z0-9._+-]', NULL);
    END IF;
END
$$;

CREATE FUNCTION runledger._check_json_value_or_null(p_what text, p_value jsonb) RETURNS void
LANGUAGE plpgsql STABLE
SET search_path = pg_catalog, runledger, pg_temp
AS $$
DECLARE
    v_cap integer;
    v_size integer;
BEGIN
    IF p_value IS NULL THEN
        RETURN;
    END IF;
    SELECT s.max_payload_bytes INTO v_cap FROM runledger.settings s;
    v_size := octet_length(p_value::text);
    IF v_size > coalesce(v_cap, 1048576) THEN
        PERFORM runledger._raise('RL006',
            format('%s is %s bytes, over the cap of %s bytes', p_what, v_size, v_cap),
            NULL, 'the cap is runledger.settings.max_payload_bytes');
    END IF;
END
$$;

CREATE FUNCTION runledger._check_json_value(p_what text, p_value jsonb) RETURNS void
LANGUAGE plpgsql STABLE
SET search_path = pg_catalog, runledger, pg_temp
AS $$
BEGIN
    IF p_value IS NULL THEN
        PERFORM runledger._raise('RL006', format('%s must not be null', p_what), NULL, NULL);
    END IF;
    PERFORM runledger._check_json_value_or_null(p_what, p_value);
END
$$;

CREATE FUNCTION runledger._check_json_object_or_null(p_what text, p_value jsonb) RETURNS void
LANGUAGE plpgsql STABLE
SET search_path = pg_catalog, runledger, pg_temp
AS $$
BEGIN
    IF p_value IS NULL THEN
        RETURN;
    END IF;
    IF jsonb_typeof(p_value) <> 'object' THEN
        PERFORM runledger._raise('RL006',
            format('%s must be a JSON object, got %s', p_what, jsonb_typeof(p_value)), NULL, NULL);
    END IF;
    PERFORM runledger._check_json_value_or_null(p_what, p_value);
END
$$;

CREATE FUNCTION runledger._check_json_object(p_what text, p_value jsonb) RETURNS void
LANGUAGE plpgsql STABLE
SET search_path = pg_catalog, runledger, pg_temp
AS $$
BEGIN
    IF p_value IS NULL THEN
        PERFORM runledger._raise('RL006', format('%s must not be null', p_what), NULL, NULL);
    END IF;
    PERFORM runledger._check_json_object_or_null(p_what, p_value);
END
$$;

CREATE FUNCTION runledger._event(p_run_id text, p_kind text, p_actor text,
                                 p_fencing_token bigint, p_state_version bigint,
                                 p_detail jsonb, p_at timestamptz DEFAULT NULL) RETURNS void
LANGUAGE sql
SET search_path = pg_catalog, runledger, pg_temp
AS $$
    INSERT INTO runledger.run_events (run_id, at, kind, actor, fencing_token, state_version, detail)
    VALUES (p_run_id, coalesce(p_at, runledger.now()), p_kind, p_actor, p_fencing_token,
            p_state_version, coalesce(p_detail, '{}'::jsonb));
$$;

CREATE FUNCTION runledger._notify_queued(p_flow text, p_flow_version text) RETURNS void
LANGUAGE sql
SET search_path = pg_catalog, runledger, pg_temp
AS $$
    SELECT pg_notify('runledger_runs', p_flow || '@' || p_flow_version);
$$;

CREATE FUNCTION runledger.release_lease(p_run_id text, p_lease_id uuid, p_fencing_token bigint,
                                        p_reason text, p_error jsonb)
RETURNS void
LANGUAGE plpgsql SECURITY DEFINER
SET search_path = pg_catalog, runledger, pg_temp
AS $$
DECLARE
    r runledger.runs;
    v_now timestamptz := runledger.now();
BEGIN
    r := runledger._lock_leased_run(p_run_id, p_lease_id, p_fencing_token);
    IF p_reason IS NULL OR length(p_reason) NOT BETWEEN 1 AND 200 THEN
        PERFORM runledger._raise('RL006', 'reason must be 1-200 characters', NULL, NULL);
    END IF;
    PERFORM runledger._check_json_object_or_null('error', p_error);
    UPDATE runledger.runs
    SET status = 'queued', lease_id = NULL, lease_expires_at = NULL, lease_owner = NULL,
        available_at = v_now, updated_at = v_now
    WHERE run_id = p_run_id AND lease_id = p_lease_id AND fencing_token = p_fencing_token;
    PERFORM runledger._event(p_run_id, 'lease_released', r.lease_owner, p_fencing_token,
        r.state_version, jsonb_build_object('reason', p_reason, 'error', p_error));
    PERFORM runledger._notify_queued(r.flow, r.flow_version);
END
$$;

-- Changed bodies (signatures, owners and grants stay).

CREATE OR REPLACE FUNCTION runledger._lock_leased_run(p_run_id text, p_lease_id uuid, p_fencing_token bigint)
RETURNS runledger.runs
LANGUAGE plpgsql
SET search_path = pg_catalog, runledger, pg_temp
AS $$
DECLARE
    r runledger.runs;
    v_now timestamptz := runledger.now();
BEGIN
    r := runledger._lock_run(p_run_id);
    IF r.status <> 'running' OR r.lease_id IS DISTINCT FROM p_lease_id
       OR r.fencing_token IS DISTINCT FROM p_fencing_token THEN
        PERFORM runledger._raise('RL001',
            format('lease lost on run %s: token %s is not the current lease', p_run_id,
                   coalesce(p_fencing_token::text, 'NULL')),
            format('run %s is %s; seen lease %s token %s; current lease %s token %s held by %s',
                   p_run_id, r.status, coalesce(p_lease_id::text, 'NULL'),
                   coalesce(p_fencing_token::text, 'NULL'), coalesce(r.lease_id::text, 'none'),
                   r.fencing_token, coalesce(r.lease_owner, 'nobody')),
            'another worker took the run over, or an operator finished it: drop it and do not retry');
    END IF;
    IF r.lease_expires_at <= v_now THEN
        PERFORM runledger._raise('RL001',
            format('lease expired on run %s: token %s', p_run_id, p_fencing_token),
            format('run %s is %s; seen lease %s token %s; current lease %s token %s held by %s '
                   'expired at %s, database clock is %s',
                   p_run_id, r.status, p_lease_id, p_fencing_token, r.lease_id, r.fencing_token,
                   coalesce(r.lease_owner, 'nobody'), r.lease_expires_at, v_now),
            'renew leases more often than the lease length; the run will be claimed again');
    END IF;
    RETURN r;
END
$$;

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

CREATE OR REPLACE FUNCTION runledger.claim_runs(p_worker_id text, p_flows text[], p_lease interval,
                                     p_max_runs int)
RETURNS TABLE (run_id text, flow text, flow_version text, input jsonb, state jsonb,
               state_version bigint, fencing_token bigint, lease_id uuid,
               lease_expires_at timestamptz, takeover boolean)
LANGUAGE plpgsql SECURITY DEFINER
SET search_path = pg_catalog, runledger, pg_temp
AS $$
#variable_conflict use_column
DECLARE
    v_now timestamptz := runledger.now();
    v_flows record;
    v_claim record;
BEGIN
    PERFORM runledger._check_worker_id(p_worker_id);
    PERFORM runledger._check_lease(p_lease);
    IF p_max_runs IS NULL OR p_max_runs < 0 OR p_max_runs > 10000 THEN
        PERFORM runledger._raise('RL006', 'max runs must be 0-10000', NULL, NULL);
    END IF;
    v_flows := runledger._parse_flows(p_flows);

    -- Two index-ordered scans pick a few more ids than wanted (queued runs per pinned
    -- flow through ix_runs_claimable; expired leases through ix_runs_lease_expiry), so
    -- the cost does not grow with the backlog. The locking SELECT then re-states the
    -- whole condition and skips rows other claimers hold. The statement runs to completion
    -- (it modifies rows) before the loop below logs each claim.
    FOR v_claim IN
    WITH pinned AS (
        SELECT u.name, u.version FROM unnest(v_flows.names, v_flows.versions) AS u(name, version)
    ), queued AS (
        SELECT q.run_id FROM pinned p CROSS JOIN LATERAL (
            SELECT c.run_id FROM runledger.runs c
            WHERE c.flow = p.name AND c.flow_version = p.version
              AND c.status = 'queued' AND c.available_at <= v_now
            ORDER BY c.priority DESC, c.created_at
            LIMIT p_max_runs * 4 + 32
        ) q
    ), expired AS (
        SELECT c.run_id FROM runledger.runs c
        JOIN pinned p ON p.name = c.flow AND p.version = c.flow_version
        WHERE c.status = 'running' AND c.lease_expires_at <= v_now
        ORDER BY c.lease_expires_at
        LIMIT p_max_runs * 4 + 32
    ), candidates AS (
        SELECT c.run_id, c.status AS old_status, c.lease_owner AS old_owner,
               c.fencing_token AS old_token
        FROM runledger.runs c
        -- an array, so the rows are fetched by primary key, not by a scan of the table
        WHERE c.run_id = ANY (ARRAY(SELECT x.run_id FROM queued x
                                    UNION ALL SELECT y.run_id FROM expired y))
          AND ((c.status = 'queued' AND c.available_at <= v_now)
               OR (c.status = 'running' AND c.lease_expires_at <= v_now))
        ORDER BY c.priority DESC, c.created_at, c.run_id
        LIMIT p_max_runs
        FOR NO KEY UPDATE OF c SKIP LOCKED
    ), claimed AS (
        UPDATE runledger.runs r
        SET status = 'running',
            fencing_token = r.fencing_token + 1,
            lease_id = gen_random_uuid(),
            lease_owner = p_worker_id,
            lease_expires_at = v_now + p_lease,
            claims = r.claims + 1,
            stalled_claims = r.stalled_claims + 1,
            updated_at = v_now
        FROM candidates c
        WHERE r.run_id = c.run_id
          AND ((r.status = 'queued' AND r.available_at <= v_now)
               OR (r.status = 'running' AND r.lease_expires_at <= v_now))
        RETURNING r.run_id, r.flow, r.flow_version, r.input, r.state, r.state_version,
                  r.fencing_token, r.lease_id, r.lease_expires_at,
                  (c.old_status = 'running') AS takeover, c.old_owner, c.old_token
    )
    SELECT k.run_id, k.flow, k.flow_version, k.input, k.state, k.state_version,
           k.fencing_token, k.lease_id, k.lease_expires_at, k.takeover, k.old_owner, k.old_token
    FROM claimed k
    LOOP
        IF v_claim.takeover THEN
            PERFORM runledger._event(v_claim.run_id, 'takeover', p_worker_id,
                v_claim.fencing_token, v_claim.state_version,
                jsonb_build_object('lease_id', v_claim.lease_id,
                                   'lease_expires_at', v_claim.lease_expires_at,
                                   'previous_owner', v_claim.old_owner,
                                   'previous_token', v_claim.old_token),
                v_now);
        ELSE
            PERFORM runledger._event(v_claim.run_id, 'claimed', p_worker_id,
                v_claim.fencing_token, v_claim.state_version,
                jsonb_build_object('lease_id', v_claim.lease_id,
                                   'lease_expires_at', v_claim.lease_expires_at),
                v_now);
        END IF;
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

CREATE OR REPLACE FUNCTION runledger.renew_leases(p_worker_id text, p_run_ids text[], p_lease_ids uuid[],
                                       p_lease interval)
RETURNS TABLE (run_id text, lease_expires_at timestamptz)
LANGUAGE plpgsql SECURITY DEFINER
SET search_path = pg_catalog, runledger, pg_temp
AS $$
#variable_conflict use_column
DECLARE
    v_now timestamptz := runledger.now();
    v_row record;
BEGIN
    PERFORM runledger._check_lease(p_lease);
    IF coalesce(cardinality(p_run_ids), 0) <> coalesce(cardinality(p_lease_ids), 0) THEN
        PERFORM runledger._raise('RL006', 'run ids and lease ids must be arrays of one length',
            NULL, NULL);
    END IF;
    -- One statement (one snapshot) finds the renewed leases and the failed ones; it runs
    -- to completion before the loop returns the first and logs the others.
    FOR v_row IN
    WITH wanted AS (
        SELECT u.run_id, u.lease_id FROM unnest(p_run_ids, p_lease_ids) AS u(run_id, lease_id)
    ), locked AS (
        -- lock in a fixed order so two renewals never wait on each other in a cycle
        SELECT l.run_id FROM runledger.runs l JOIN wanted w ON w.run_id = l.run_id
        WHERE l.lease_id = w.lease_id AND l.lease_owner = p_worker_id
          AND l.status = 'running' AND l.lease_expires_at > v_now
        ORDER BY l.run_id
        FOR NO KEY UPDATE OF l
    ), renewed AS (
        UPDATE runledger.runs r
        SET lease_expires_at = v_now + p_lease
        FROM locked k JOIN wanted w ON w.run_id = k.run_id
        WHERE r.run_id = k.run_id AND r.lease_id = w.lease_id AND r.lease_owner = p_worker_id
          AND r.status = 'running' AND r.lease_expires_at > v_now
        RETURNING r.run_id, r.lease_expires_at
    )
    SELECT n.run_id, n.lease_expires_at, true AS renewed, NULL::uuid AS lease_id,
           NULL::uuid AS current_lease_id, NULL::text AS current_owner, NULL::text AS status
    FROM renewed n
    UNION ALL
    SELECT w.run_id, NULL, false, w.lease_id, x.lease_id, x.lease_owner, x.status
    FROM wanted w JOIN runledger.runs x ON x.run_id = w.run_id
    WHERE NOT EXISTS (SELECT 1 FROM renewed n WHERE n.run_id = w.run_id)
      -- a run that left 'running' (finished, released, cancelled) has its own event:
      -- only a lease that expired or was taken over is a renewal failure
      AND x.status = 'running'
    LOOP
        IF v_row.renewed THEN
            run_id := v_row.run_id;
            lease_expires_at := v_row.lease_expires_at;
            RETURN NEXT;
        ELSE
            PERFORM runledger._event(v_row.run_id, 'renewal_failed', p_worker_id, NULL, NULL,
                jsonb_build_object('lease_id', v_row.lease_id,
                                   'current_lease_id', v_row.current_lease_id,
                                   'current_owner', v_row.current_owner, 'status', v_row.status),
                v_now);
        END IF;
    END LOOP;
END
$$;

CREATE OR REPLACE FUNCTION runledger.release_lease(p_run_id text, p_lease_id uuid, p_fencing_token bigint)
RETURNS void
LANGUAGE plpgsql SECURITY DEFINER
SET search_path = pg_catalog, runledger, pg_temp
AS $$
DECLARE
    r runledger.runs;
    v_now timestamptz := runledger.now();
BEGIN
    r := runledger._lock_leased_run(p_run_id, p_lease_id, p_fencing_token);
    -- a run handed back (a draining worker) did not stall: undo its claim's count
    UPDATE runledger.runs
    SET status = 'queued', lease_id = NULL, lease_expires_at = NULL, lease_owner = NULL,
        stalled_claims = greatest(stalled_claims - 1, 0),
        available_at = v_now, updated_at = v_now
    WHERE run_id = p_run_id AND lease_id = p_lease_id AND fencing_token = p_fencing_token;
    PERFORM runledger._event(p_run_id, 'lease_released', r.lease_owner, p_fencing_token,
                             r.state_version, '{}'::jsonb);
    PERFORM runledger._notify_queued(r.flow, r.flow_version);
END
$$;

CREATE OR REPLACE FUNCTION runledger.register_worker(p_worker_id text, p_hostname text, p_pid int,
                                          p_flows text[])
RETURNS void
LANGUAGE plpgsql SECURITY DEFINER
SET search_path = pg_catalog, runledger, pg_temp
AS $$
DECLARE
    v_now timestamptz := runledger.now();
BEGIN
    PERFORM runledger._check_worker_id(p_worker_id);
    PERFORM runledger._parse_flows(p_flows);
    INSERT INTO runledger.workers (worker_id, hostname, pid, flows, started_at, heartbeat_at)
    VALUES (p_worker_id, coalesce(p_hostname, ''), coalesce(p_pid, 0), p_flows, v_now, v_now)
    ON CONFLICT ON CONSTRAINT pk_workers DO UPDATE
    SET hostname = excluded.hostname, pid = excluded.pid, flows = excluded.flows,
        started_at = excluded.started_at, heartbeat_at = excluded.heartbeat_at, stopped_at = NULL;
END
$$;

CREATE OR REPLACE FUNCTION runledger.checkpoint(p_run_id text, p_lease_id uuid, p_fencing_token bigint,
                                     p_expected_version bigint, p_state jsonb)
RETURNS bigint
LANGUAGE plpgsql SECURITY DEFINER
SET search_path = pg_catalog, runledger, pg_temp
AS $$
DECLARE
    r runledger.runs;
BEGIN
    r := runledger._lock_leased_run(p_run_id, p_lease_id, p_fencing_token);
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
        updated_at = runledger.now()
    WHERE run_id = p_run_id AND state_version = r.state_version AND lease_id = p_lease_id;
    PERFORM runledger._event(p_run_id, 'checkpoint', r.lease_owner, p_fencing_token,
                             r.state_version + 1, '{}'::jsonb);
    RETURN r.state_version + 1;
END
$$;

CREATE OR REPLACE FUNCTION runledger.record_turn(p_run_id text, p_lease_id uuid, p_fencing_token bigint,
                                      p_turn int, p_calls jsonb)
RETURNS void
LANGUAGE plpgsql SECURITY DEFINER
SET search_path = pg_catalog, runledger, pg_temp
AS $$
DECLARE
    r runledger.runs;
    v_next integer;
    v_existing jsonb;
    v_call jsonb;
    v_ids text[] := '{}';
    v_pos integer := 0;
    v_open integer;
BEGIN
    r := runledger._lock_leased_run(p_run_id, p_lease_id, p_fencing_token);
    PERFORM runledger._check_json_value('calls', p_calls);
    IF jsonb_typeof(p_calls) <> 'array' THEN
        PERFORM runledger._raise('RL006', 'calls must be a JSON array', NULL, NULL);
    END IF;
    IF p_turn IS NULL OR p_turn < 0 THEN
        PERFORM runledger._raise('RL006', 'turn must be a non-negative integer', NULL, NULL);
    END IF;

    SELECT t.calls INTO v_existing FROM runledger.run_turns t
    WHERE t.run_id = p_run_id AND t.turn = p_turn;
    IF FOUND THEN
        IF v_existing = p_calls THEN
            RETURN;  -- the same decision again (a retried ambiguous commit): no-op
        END IF;
        PERFORM runledger._raise('RL004',
            format('turn %s of run %s is already recorded with other calls', p_turn, p_run_id),
            NULL, 'a recorded decision is never replaced: replay it');
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
        v_ids := v_ids || (v_call ->> 'call_id');
    END LOOP;

    INSERT INTO runledger.run_turns (run_id, turn, calls, fencing_token, created_at)
    VALUES (p_run_id, p_turn, p_calls, p_fencing_token, runledger.now());

    FOR v_call IN SELECT e FROM jsonb_array_elements(p_calls) AS e LOOP
        INSERT INTO runledger.run_calls (run_id, turn, call_id, position, tool, args,
                                         idempotency_key, status, attempts)
        VALUES (p_run_id, p_turn, v_call ->> 'call_id', v_pos, v_call ->> 'tool',
                coalesce(v_call -> 'args', '{}'::jsonb),
                p_run_id || ':' || p_turn || ':' || (v_call ->> 'call_id'), 'planned', 0);
        v_pos := v_pos + 1;
    END LOOP;

    UPDATE runledger.runs SET stalled_claims = 0, updated_at = runledger.now()
    WHERE run_id = p_run_id AND lease_id = p_lease_id;
    PERFORM runledger._event(p_run_id, 'turn_recorded', r.lease_owner, p_fencing_token,
        r.state_version, jsonb_build_object('turn', p_turn, 'calls', jsonb_array_length(p_calls)));
END
$$;

CREATE OR REPLACE FUNCTION runledger.complete_call(p_run_id text, p_lease_id uuid, p_fencing_token bigint,
                                        p_idempotency_key text, p_outcome text,
                                        p_result jsonb, p_receipt jsonb)
RETURNS void
LANGUAGE plpgsql SECURITY DEFINER
SET search_path = pg_catalog, runledger, pg_temp
AS $$
DECLARE
    r runledger.runs;
    c runledger.run_calls;
    v_now timestamptz := runledger.now();
    v_detail jsonb;
BEGIN
    r := runledger._lock_leased_run(p_run_id, p_lease_id, p_fencing_token);
    -- not_applied: the effect certainly did not happen and the call will be sent again
    -- with the same key; it goes back to planned, so no one mistakes it for in flight.
    PERFORM runledger._check_word('outcome', p_outcome,
                                  ARRAY['succeeded', 'failed', 'unknown', 'not_applied']);
    PERFORM runledger._check_json_value_or_null('result', p_result);
    PERFORM runledger._check_json_object_or_null('receipt', p_receipt);
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
    UPDATE runledger.runs SET stalled_claims = 0, updated_at = v_now
    WHERE run_id = p_run_id AND lease_id = p_lease_id;
    v_detail := jsonb_build_object('idempotency_key', p_idempotency_key, 'tool', c.tool,
                                   'attempt', c.attempts);
    CASE p_outcome
        WHEN 'succeeded' THEN
            PERFORM runledger._event(p_run_id, 'call_succeeded', r.lease_owner, p_fencing_token,
                                     r.state_version, v_detail);
        WHEN 'failed' THEN
            PERFORM runledger._event(p_run_id, 'call_failed', r.lease_owner, p_fencing_token,
                                     r.state_version, v_detail);
        WHEN 'unknown' THEN
            PERFORM runledger._event(p_run_id, 'call_unknown', r.lease_owner, p_fencing_token,
                                     r.state_version, v_detail);
        WHEN 'not_applied' THEN
            PERFORM runledger._event(p_run_id, 'call_not_applied', r.lease_owner,
                                     p_fencing_token, r.state_version, v_detail);
    END CASE;
END
$$;

CREATE OR REPLACE FUNCTION runledger.finish_run(p_run_id text, p_lease_id uuid, p_fencing_token bigint,
                                     p_status text, p_result jsonb, p_reason text)
RETURNS void
LANGUAGE plpgsql SECURITY DEFINER
SET search_path = pg_catalog, runledger, pg_temp
AS $$
DECLARE
    r runledger.runs;
    v_now timestamptz := runledger.now();
    v_open integer;
    v_detail jsonb;
BEGIN
    r := runledger._lock_leased_run(p_run_id, p_lease_id, p_fencing_token);
    PERFORM runledger._check_word('status', p_status, ARRAY['succeeded', 'failed', 'paused']);
    PERFORM runledger._check_json_value_or_null('result', p_result);
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
                                     r.state_version, v_detail);
        WHEN 'failed' THEN
            PERFORM runledger._event(p_run_id, 'run_failed', r.lease_owner, p_fencing_token,
                                     r.state_version, v_detail);
        WHEN 'paused' THEN
            PERFORM runledger._event(p_run_id, 'run_paused', r.lease_owner, p_fencing_token,
                                     r.state_version, v_detail);
    END CASE;
END
$$;

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
    IF p_actor IS NULL OR length(p_actor) NOT BETWEEN 1 AND 200 THEN
        PERFORM runledger._raise('RL006', 'actor must be 1-200 characters', NULL, NULL);
    END IF;
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

CREATE OR REPLACE FUNCTION runledger.retry_run(p_run_id text, p_actor text)
RETURNS void
LANGUAGE plpgsql SECURITY DEFINER
SET search_path = pg_catalog, runledger, pg_temp
AS $$
DECLARE
    r runledger.runs;
    v_now timestamptz := runledger.now();
    v_unknown integer;
BEGIN
    r := runledger._lock_run(p_run_id);
    IF r.status NOT IN ('failed', 'paused') THEN
        PERFORM runledger._raise('RL004',
            format('run %s is %s; only failed or paused runs are retried', p_run_id, r.status),
            NULL, NULL);
    END IF;
    SELECT count(*) INTO v_unknown FROM runledger.run_calls x
    WHERE x.run_id = p_run_id AND x.status = 'unknown';
    IF v_unknown > 0 THEN
        PERFORM runledger._raise('RL004',
            format('run %s has %s unknown call(s)', p_run_id, v_unknown),
            NULL, 'resolve them first: runledger resolve KEY applied|not_applied|abandoned');
    END IF;
    UPDATE runledger.runs
    SET status = 'queued', pause_reason = NULL, error = NULL, finished_at = NULL,
        stalled_claims = 0, available_at = v_now, updated_at = v_now
    WHERE run_id = p_run_id AND status IN ('failed', 'paused');
    PERFORM runledger._event(p_run_id, 'run_requeued', coalesce(p_actor, 'operator'), NULL,
        r.state_version, jsonb_build_object('after', 'retry_run', 'previous_status', r.status));
    PERFORM runledger._notify_queued(r.flow, r.flow_version);
END
$$;

-- Privileges of the new functions, as 0001 set them for its own.
REVOKE ALL ON FUNCTION runledger._check_worker_id(text) FROM PUBLIC;
REVOKE ALL ON FUNCTION runledger._check_lease(interval) FROM PUBLIC;
REVOKE ALL ON FUNCTION runledger._check_flow(text, text) FROM PUBLIC;
REVOKE ALL ON FUNCTION runledger._check_json_value_or_null(text, jsonb) FROM PUBLIC;
REVOKE ALL ON FUNCTION runledger._check_json_value(text, jsonb) FROM PUBLIC;
REVOKE ALL ON FUNCTION runledger._check_json_object_or_null(text, jsonb) FROM PUBLIC;
REVOKE ALL ON FUNCTION runledger._check_json_object(text, jsonb) FROM PUBLIC;
REVOKE ALL ON FUNCTION runledger._event(text, text, text, bigint, bigint, jsonb, timestamptz) FROM PUBLIC;
REVOKE ALL ON FUNCTION runledger._notify_queued(text, text) FROM PUBLIC;
REVOKE ALL ON FUNCTION runledger.release_lease(text, uuid, bigint, text, jsonb) FROM PUBLIC;

DO $roles$
BEGIN
    IF EXISTS (SELECT 1 FROM pg_roles WHERE rolname = 'runledger_worker') THEN
        GRANT EXECUTE ON FUNCTION runledger.release_lease(text, uuid, bigint, text, jsonb)
        TO runledger_worker;
    END IF;
END
$roles$;
