-- runledger 0011: session locks (issue "Leases across real failures"): a dead worker's
-- runs are taken over before their leases expire. A worker holds a session-level advisory
-- lock on its listener connection under a key minted for that session
-- (workers.session_lock, register_worker_v2); each claim stamps the claimer's key on the
-- run (runs.lease_lock); a claim also takes a running run whose holder's lock is free
-- (claim_runs, through _gone_sessions; the takeover event says holder 'session_ended').
-- heartbeat_listener is the listener's heartbeat and tells a worker that such a run waits.
-- register_worker's body moves to _register_worker, shared with register_worker_v2; it
-- clears the key (a worker of the previous release has none). claim_runs and
-- register_worker keep their signatures. docs/leases.md has the argument.
-- Frozen once merged: change things in a new revision (and in the living files).

ALTER TABLE runledger.runs ADD COLUMN lease_lock bigint;
ALTER TABLE runledger.workers ADD COLUMN session_lock bigint;
CREATE INDEX ix_runs_lease_lock ON runledger.runs (lease_lock)
    WHERE status = 'running' AND lease_lock IS NOT NULL;

-- Session locks (revision 0011). A worker holds a session-level advisory lock on its
-- listener connection, under a random key minted for that session (workers.session_lock),
-- and each claim stamps the claimer's key on the run (runs.lease_lock). When the session
-- ends (the process died and the kernel closed its socket, or the server dropped the
-- session), the server frees the lock at once. The keys of running runs whose lock is
-- free: one index descent per distinct key (ix_runs_lease_lock), one try per key. The
-- try takes the free lock for the rest of the caller's transaction, so a key stays free
-- until the caller commits. Keys of live sessions are held: the try fails, nothing kept.
-- The calling session's own key is left out: its try would succeed (it holds the lock).
-- See docs/leases.md for why this is safe (the worker fences itself first).
CREATE FUNCTION runledger._gone_sessions()
RETURNS bigint[]
LANGUAGE plpgsql VOLATILE
AS $$
BEGIN
    -- PL/pgSQL, not SQL: its plan is cached for the session (a SQL function's is not)
    RETURN (
        WITH RECURSIVE k(key) AS (
            (SELECT r.lease_lock FROM runledger.runs r
             WHERE r.status = 'running' AND r.lease_lock IS NOT NULL
             ORDER BY r.lease_lock LIMIT 1)
            UNION ALL
            SELECT (SELECT r.lease_lock FROM runledger.runs r
                    WHERE r.status = 'running' AND r.lease_lock > k.key
                    ORDER BY r.lease_lock LIMIT 1)
            FROM k WHERE k.key IS NOT NULL
        ), keys AS (
            SELECT k.key FROM k WHERE k.key IS NOT NULL LIMIT 1024
        )
        SELECT coalesce(array_agg(keys.key), '{}') FROM keys
        -- not the calling session's own key (a session may take a lock it holds again)
        WHERE keys.key IS DISTINCT FROM
                  nullif(pg_catalog.current_setting('runledger.session_lock', true), '')::bigint
          AND pg_catalog.pg_try_advisory_xact_lock(keys.key));
END
$$;

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
        -- Revision 0011: not taken over at once. The holder, cut off with the old primary,
        -- may still have a call in flight at a provider; it fences itself within its
        -- listener's budget (5 s), so the run waits 10 s before anyone claims it, and a
        -- lookup by the next holder then sees that call's effect. Its session lock is
        -- cleared: that session never existed here, and its key would look free at once.
        UPDATE runledger.runs r
        SET lease_expires_at = p_now + interval '10 seconds', lease_lock = NULL,
            updated_at = p_now
        FROM affected a
        WHERE r.run_id = a.run_id AND r.status = 'running'
        RETURNING r.run_id
    ), delayed AS (
        -- a queued run may have been claimed on the lost timeline: the same wait
        UPDATE runledger.runs r
        SET available_at = greatest(r.available_at, p_now + interval '10 seconds'),
            updated_at = p_now
        FROM affected a
        WHERE r.run_id = a.run_id AND r.status = 'queued'
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
    -- session locks (revision 0011): the claimer's listener-session lock, stamped on each
    -- run it claims; the locks of holder sessions that ended (their runs are taken over
    -- before their leases expire)
    v_lock bigint;
    v_gone bigint[] := '{}';
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
    -- session locks (revision 0011)
    SELECT w.session_lock INTO v_lock FROM runledger.workers w
    WHERE w.worker_id = p_worker_id AND w.stopped_at IS NULL;
    -- A claimer whose own listener session has ended claims nothing: its process died
    -- (or fenced itself) while this statement was on its way, and the server runs a
    -- statement to its end even when the client is gone. Its lock is free then; a live
    -- listener holds it, and the try fails. (A claim sent on the listener session itself
    -- would take its own lock again: that one is left alone.)
    IF v_lock IS NOT NULL AND p_max_runs > 0
       AND v_lock IS DISTINCT FROM
           nullif(pg_catalog.current_setting('runledger.session_lock', true), '')::bigint
       AND pg_catalog.pg_try_advisory_xact_lock(v_lock) THEN
        RETURN;
    END IF;
    IF p_max_runs > 0 THEN
        -- never the claimer's own key: its listener may end while this statement runs
        -- (the worker was killed after sending it), and its own runs are then no one's
        -- to take but the next worker's
        v_gone := array_remove(runledger._gone_sessions(), v_lock);
    END IF;
    -- end session locks

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
    ), orphaned AS (  -- session locks (revision 0011): the holder's session ended
        SELECT c.run_id FROM runledger.runs c
        JOIN pinned p ON p.name = c.flow AND p.version = c.flow_version
        WHERE c.status = 'running' AND c.lease_lock = ANY (v_gone)
        LIMIT p_max_runs * 4 + 32
    ), candidates AS (
        SELECT c.run_id, c.status AS old_status, c.lease_owner AS old_owner,
               c.fencing_token AS old_token, c.lease_expires_at AS old_expires_at
        FROM runledger.runs c
        -- an array, so the rows are fetched by primary key, not by a scan of the table
        WHERE c.run_id = ANY (ARRAY(SELECT x.run_id FROM queued x
                                    UNION ALL SELECT y.run_id FROM expired y
                                    UNION ALL SELECT z.run_id FROM orphaned z))
          AND ((c.status = 'queued' AND c.available_at <= v_now)
               OR (c.status = 'running' AND c.lease_expires_at <= v_now)
               OR (c.status = 'running' AND c.lease_lock = ANY (v_gone)))
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
            updated_at = v_now,
            lease_lock = v_lock  -- session locks (revision 0011)
        FROM candidates c
        WHERE r.run_id = c.run_id
          AND ((r.status = 'queued' AND r.available_at <= v_now)
               OR (r.status = 'running' AND r.lease_expires_at <= v_now)
               OR (r.status = 'running' AND r.lease_lock = ANY (v_gone)))
        RETURNING r.run_id, r.flow, r.flow_version, r.input, r.state, r.state_version,
                  r.fencing_token, r.lease_id, r.lease_expires_at,
                  (c.old_status = 'running') AS takeover, c.old_owner, c.old_token,
                  c.old_expires_at
    )
    SELECT k.run_id, k.flow, k.flow_version, k.input, k.state, k.state_version,
           k.fencing_token, k.lease_id, k.lease_expires_at, k.takeover, k.old_owner, k.old_token,
           k.old_expires_at
    FROM claimed k
    LOOP
        IF v_claim.takeover THEN
            -- holder: why the run could be taken, 'expired' or (revision 0011)
            -- 'session_ended' (the lease still ran, the holder's session had ended)
            PERFORM runledger._event(v_claim.run_id, 'takeover', p_worker_id,
                v_claim.fencing_token, v_claim.state_version,
                jsonb_build_object('lease_id', v_claim.lease_id,
                                   'lease_expires_at', v_claim.lease_expires_at,
                                   'previous_owner', v_claim.old_owner,
                                   'previous_token', v_claim.old_token,
                                   'holder', CASE WHEN v_claim.old_expires_at <= v_now
                                                  THEN 'expired' ELSE 'session_ended' END,
                                   'previous_lease_expires_at', v_claim.old_expires_at),
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

-- A worker id belongs to one live database session at a time: the session that
-- registered it (pid and backend_start, so a reused pid is not mistaken for it). Another
-- session may take the id over once that one has ended (its backend is gone from
-- pg_stat_activity), once the worker stopped cleanly, or when it is the same session.
-- backend_start of another role's session is visible to the function's owner only with
-- pg_read_all_stats (a superuser has it): without it the sessions are told apart by pid.
CREATE FUNCTION runledger._register_worker(p_worker_id text, p_hostname text, p_pid int,
                                           p_flows text[], p_session_lock bigint)
RETURNS void
LANGUAGE plpgsql
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
                                   session_pid, session_started_at, session_lock)
    VALUES (p_worker_id, coalesce(p_hostname, ''), coalesce(p_pid, 0), p_flows, v_now, v_now,
            v_session_pid, v_session_started, p_session_lock)
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
    -- session_lock: the caller's (NULL from register_worker: a worker of the previous
    -- release that takes an id over must not inherit the last holder's key)
    UPDATE runledger.workers
    SET hostname = coalesce(p_hostname, ''), pid = coalesce(p_pid, 0), flows = p_flows,
        started_at = v_now, heartbeat_at = v_now, stopped_at = NULL,
        session_pid = v_session_pid, session_started_at = v_session_started,
        session_lock = p_session_lock
    WHERE worker_id = p_worker_id;
END
$$;

CREATE OR REPLACE FUNCTION runledger.register_worker(p_worker_id text, p_hostname text, p_pid int,
                                          p_flows text[])
RETURNS void
LANGUAGE plpgsql SECURITY DEFINER
SET search_path = pg_catalog, runledger, pg_temp
AS $$
BEGIN
    PERFORM runledger._register_worker(p_worker_id, p_hostname, p_pid, p_flows, NULL);
END
$$;

-- register_worker_v2 (revision 0011): register_worker, and with p_session_lock the
-- calling session takes a session-level advisory lock under a new random key, recorded
-- as workers.session_lock: claims stamp it on the runs of this worker, and a run whose
-- holder's lock is free is taken over before its lease expires (claim_runs). Call it on
-- the worker's long-lived listener session, and only where the database session is the
-- worker's own (not behind a transaction pooler): the worker checks that first. Without
-- p_session_lock the worker has no key (its runs are taken over on expiry only). Returns
-- the key (NULL without one) and the session's backend pid.
CREATE FUNCTION runledger.register_worker_v2(p_worker_id text, p_hostname text, p_pid int,
                                             p_flows text[], p_session_lock boolean)
RETURNS TABLE (session_lock bigint, session_pid integer)
LANGUAGE plpgsql SECURITY DEFINER
SET search_path = pg_catalog, runledger, pg_temp
AS $$
DECLARE
    v_key bigint;
BEGIN
    IF p_session_lock IS NULL THEN
        PERFORM runledger._raise('RL006', 'session lock must be true or false', NULL, NULL);
    END IF;
    IF p_session_lock THEN
        -- a key no live session holds; a session-level lock outlives this transaction (if
        -- the registration is refused, the session keeps a lock no run carries, until the
        -- worker closes it)
        LOOP
            v_key := ('x' || translate(gen_random_uuid()::text, '-', ''))::bit(64)::bigint;
            EXIT WHEN pg_try_advisory_lock(v_key);
        END LOOP;
        -- the session's own key, which _gone_sessions leaves out (a client can only hide
        -- a key from itself with this setting, never make a held one look free)
        PERFORM set_config('runledger.session_lock', v_key::text, false);
    END IF;
    PERFORM runledger._register_worker(p_worker_id, p_hostname, p_pid, p_flows, v_key);
    session_lock := v_key;
    session_pid := pg_backend_pid();
    RETURN NEXT;
END
$$;

-- The listener's heartbeat (revision 0011), every half second on the worker's listener
-- session: the backend pid answering (a pooler that moved the session shows here), and
-- whether a run of this worker's flows is held by a session that ended (the worker then
-- claims at once). Writes nothing.
CREATE FUNCTION runledger.heartbeat_listener(p_worker_id text)
RETURNS TABLE (session_pid integer, takeover_due boolean)
LANGUAGE plpgsql SECURITY DEFINER
SET search_path = pg_catalog, runledger, pg_temp
AS $$
DECLARE
    v_gone bigint[];
BEGIN
    PERFORM runledger._check_worker_id(p_worker_id);
    v_gone := runledger._gone_sessions();
    session_pid := pg_backend_pid();
    takeover_due := cardinality(v_gone) > 0 AND EXISTS (
        SELECT 1 FROM runledger.runs r JOIN runledger.workers w ON w.worker_id = p_worker_id
        WHERE r.status = 'running' AND r.lease_lock = ANY (v_gone)
          AND (r.flow || '@' || r.flow_version) = ANY (w.flows));
    RETURN NEXT;
END
$$;

REVOKE ALL ON FUNCTION runledger._gone_sessions() FROM PUBLIC;
REVOKE ALL ON FUNCTION runledger._register_worker(text, text, int, text[], bigint) FROM PUBLIC;
REVOKE ALL ON FUNCTION runledger.register_worker_v2(text, text, int, text[], boolean) FROM PUBLIC;
REVOKE ALL ON FUNCTION runledger.heartbeat_listener(text) FROM PUBLIC;
DO $roles$
BEGIN
    IF EXISTS (SELECT 1 FROM pg_roles WHERE rolname = 'runledger_worker') THEN
        GRANT EXECUTE ON FUNCTION
            runledger.register_worker_v2(text, text, int, text[], boolean),
            runledger.heartbeat_listener(text)
        TO runledger_worker;
    END IF;
END
$roles$;
