-- runledger 0011 down: back to 0010 exactly. claim_runs and register_worker as they were
-- (without the session locks); the new functions, the helpers, the index and the two
-- columns dropped (their grants go with them).

DROP FUNCTION runledger.heartbeat_listener(text);
DROP FUNCTION runledger.register_worker_v2(text, text, int, text[], boolean);

CREATE OR REPLACE FUNCTION runledger._note_timeline(p_actor text, p_now timestamptz) RETURNS void
LANGUAGE plpgsql
AS $$
DECLARE
    v_timeline integer := runledger._timeline();
    v_last runledger.timelines;
    v_position integer;
    v_runs text[] := '{}';
    v_run record;
BEGIN
    -- one detector at a time; the others find the row it wrote
    LOCK TABLE runledger.timelines IN SHARE ROW EXCLUSIVE MODE;
    SELECT * INTO v_last FROM runledger.timelines t ORDER BY t.position DESC LIMIT 1;
    IF FOUND AND v_last.timeline = v_timeline THEN
        RETURN;
    END IF;
    v_position := coalesce(v_last.position, 0) + 1;
    IF v_last.position IS NOT NULL THEN
        -- the unfinished runs, locked (in a fixed order) until the end of the claim
        SELECT coalesce(array_agg(u.run_id ORDER BY u.run_id), '{}') INTO v_runs
        FROM (SELECT r.run_id FROM runledger.runs r
              WHERE r.status IN ('queued', 'running', 'paused')
              ORDER BY r.run_id FOR NO KEY UPDATE) u;
    END IF;
    -- the table is append-only (the wall): the row is written whole, once
    INSERT INTO runledger.timelines (position, timeline, previous_timeline, seen_at, seen_by,
                                     last_replay_at, last_event_id, max_token, affected_runs)
    VALUES (v_position, v_timeline, v_last.timeline, p_now, p_actor,
            pg_last_xact_replay_timestamp(),
            (SELECT max(e.event_id) FROM runledger.run_events e),
            (SELECT max(r.fencing_token) FROM runledger.runs r), cardinality(v_runs));
    IF v_last.position IS NULL THEN
        RETURN;  -- the first timeline seen: nothing to compare with
    END IF;

    WITH affected AS (
        SELECT r.run_id, r.status, r.lease_owner, r.fencing_token,
               coalesce((SELECT max(t.turn) FROM runledger.run_turns t
                         WHERE t.run_id = r.run_id), 0) AS turn
        FROM runledger.runs r
        WHERE r.run_id = ANY (v_runs)
    ), marked AS (
        UPDATE runledger.run_calls c
        -- an attempt under the run's last surviving token: the dispatch that may be lost
        SET status = 'dispatched', attempts = c.attempts + 1, dispatched_token = a.fencing_token,
            dispatched_by = 'failover', dispatched_at = p_now
        FROM affected a
        WHERE c.run_id = a.run_id AND c.status = 'planned'
          AND c.approval IS DISTINCT FROM 'pending'
        RETURNING c.run_id, c.idempotency_key
    ), ended AS (
        UPDATE runledger.runs r
        SET lease_expires_at = p_now, updated_at = p_now
        FROM affected a
        WHERE r.run_id = a.run_id AND r.status = 'running' AND r.lease_expires_at > p_now
        RETURNING r.run_id
    )
    INSERT INTO runledger.failover_runs (run_id, position, status, lease_owner, fencing_token,
                                         turn, marked_calls)
    SELECT a.run_id, v_position, a.status, a.lease_owner, a.fencing_token, a.turn,
           ARRAY(SELECT m.idempotency_key FROM marked m WHERE m.run_id = a.run_id
                 ORDER BY m.idempotency_key)
    FROM affected a
    -- the lease UPDATE runs with the statement even where nothing reads it
    LEFT JOIN (SELECT count(*) AS n FROM ended) e ON true;

    FOR v_run IN
        SELECT f.run_id, f.status, f.lease_owner, f.fencing_token, f.turn, f.marked_calls,
               r.state_version
        FROM runledger.failover_runs f JOIN runledger.runs r ON r.run_id = f.run_id
        WHERE f.position = v_position
    LOOP
        PERFORM runledger._event(v_run.run_id, 'failover_detected', p_actor, NULL,
            v_run.state_version,
            jsonb_build_object('timeline', v_timeline, 'previous_timeline', v_last.timeline,
                               'status', v_run.status, 'lease_owner', v_run.lease_owner,
                               'fencing_token', v_run.fencing_token,
                               'suspect_from_turn', v_run.turn,
                               'marked_dispatched', to_jsonb(v_run.marked_calls),
                               'last_replay_at', pg_last_xact_replay_timestamp()),
            p_now);
    END LOOP;
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
    v_timeline integer;
    v_floor bigint;
BEGIN
    PERFORM runledger._check_worker_id(p_worker_id);
    PERFORM runledger._check_lease(p_lease);
    IF p_max_runs IS NULL OR p_max_runs < 0 OR p_max_runs > 10000 THEN
        PERFORM runledger._raise('RL006', 'max runs must be 0-10000', NULL, NULL);
    END IF;
    v_flows := runledger._parse_flows(p_flows);
    -- failover (revision 0010): the token floor of this timeline, once it is recorded
    v_timeline := runledger._timeline();
    v_floor := (v_timeline - 1)::bigint << 32;  -- runledger._token_floor()
    IF (SELECT t.timeline FROM runledger.timelines t ORDER BY t.position DESC LIMIT 1)
       IS DISTINCT FROM v_timeline THEN
        PERFORM runledger._note_timeline(p_worker_id, v_now);
    END IF;

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
            fencing_token = greatest(r.fencing_token + 1, v_floor + 1),  -- revision 0010
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

CREATE OR REPLACE FUNCTION runledger.register_worker(p_worker_id text, p_hostname text, p_pid int,
                                          p_flows text[])
RETURNS void
LANGUAGE plpgsql SECURITY DEFINER
SET search_path = pg_catalog, runledger, pg_temp
AS $$
DECLARE
    v_now timestamptz := runledger.now();
    v_session_pid integer := pg_backend_pid();
    v_session_started timestamptz;
    w runledger.workers;
BEGIN
    PERFORM runledger._check_worker_id(p_worker_id);
    PERFORM runledger._check_text('hostname', p_hostname, 0, runledger._cap('hostname'));
    PERFORM runledger._parse_flows(p_flows);
    SELECT a.backend_start INTO v_session_started FROM pg_stat_activity a
    WHERE a.pid = v_session_pid;

    INSERT INTO runledger.workers (worker_id, hostname, pid, flows, started_at, heartbeat_at,
                                   session_pid, session_started_at)
    VALUES (p_worker_id, coalesce(p_hostname, ''), coalesce(p_pid, 0), p_flows, v_now, v_now,
            v_session_pid, v_session_started)
    ON CONFLICT ON CONSTRAINT pk_workers DO NOTHING;
    IF FOUND THEN
        RETURN;
    END IF;

    -- The id is registered (perhaps by a session whose insert we just waited for): lock
    -- the row, so two sessions taking one id over are judged one after the other.
    SELECT * INTO w FROM runledger.workers x WHERE x.worker_id = p_worker_id FOR UPDATE;
    IF w.stopped_at IS NULL AND w.session_pid IS NOT NULL
       AND NOT (w.session_pid = v_session_pid
                AND w.session_started_at IS NOT DISTINCT FROM v_session_started)
       AND EXISTS (SELECT 1 FROM pg_stat_activity a
                   WHERE a.pid = w.session_pid
                     AND (a.backend_start IS NULL OR w.session_started_at IS NULL
                          OR a.backend_start = w.session_started_at)) THEN
        PERFORM runledger._raise('RL008',
            format('worker id %s is in use by a live worker', p_worker_id),
            format('registered by host %s pid %s since %s (database session pid %s), not stopped',
                   coalesce(nullif(w.hostname, ''), '?'), w.pid, w.started_at, w.session_pid),
            'start this worker with another --worker-id, or stop the other worker first');
    END IF;
    UPDATE runledger.workers
    SET hostname = coalesce(p_hostname, ''), pid = coalesce(p_pid, 0), flows = p_flows,
        started_at = v_now, heartbeat_at = v_now, stopped_at = NULL,
        session_pid = v_session_pid, session_started_at = v_session_started
    WHERE worker_id = p_worker_id;
END
$$;

DROP FUNCTION runledger._register_worker(text, text, int, text[], bigint);
DROP FUNCTION runledger._gone_sessions();
DROP INDEX runledger.ix_runs_lease_lock;
ALTER TABLE runledger.workers DROP COLUMN session_lock;
ALTER TABLE runledger.runs DROP COLUMN lease_lock;
