-- runledger 0032 down: registrations tied to a database session again (0031's
-- _register_worker and register_worker_v2, 0003's heartbeat_worker); the columns go.

DROP FUNCTION runledger.heartbeat_worker(text, boolean, uuid);
DROP FUNCTION runledger.register_worker_v2(text, text, int, text[], boolean, text, uuid, boolean,
                                           interval, text);
DROP FUNCTION runledger._register_worker(text, text, int, text[], bigint, text, uuid, boolean,
                                         interval, text);
ALTER TABLE runledger.workers DROP COLUMN silent_after;
ALTER TABLE runledger.workers DROP COLUMN incarnation;

CREATE FUNCTION runledger._register_worker(p_worker_id text, p_hostname text, p_pid int,
                                           p_flows text[], p_session_lock bigint,
                                           p_process text DEFAULT NULL)
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
    PERFORM runledger._check_text('process', p_process, 0, runledger._cap('hostname'));
    PERFORM runledger._parse_flows(p_flows);
    SELECT a.backend_start INTO v_session_started FROM pg_stat_activity a
    WHERE a.pid = v_session_pid;

    INSERT INTO runledger.workers (worker_id, hostname, pid, flows, started_at, heartbeat_at,
                                   session_pid, session_started_at, session_lock, process)
    VALUES (p_worker_id, coalesce(p_hostname, ''), coalesce(p_pid, 0), p_flows, v_now, v_now,
            v_session_pid, v_session_started, p_session_lock, p_process)
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
        session_lock = p_session_lock, process = p_process
    WHERE worker_id = p_worker_id;
END
$$;

CREATE FUNCTION runledger.register_worker_v2(p_worker_id text, p_hostname text, p_pid int,
                                             p_flows text[], p_session_lock boolean,
                                             p_process text DEFAULT NULL)
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
    PERFORM runledger._register_worker(p_worker_id, p_hostname, p_pid, p_flows, v_key,
                                       p_process);
    session_lock := v_key;
    session_pid := pg_backend_pid();
    RETURN NEXT;
END
$$;


CREATE FUNCTION runledger.heartbeat_worker(p_worker_id text, p_stopped boolean DEFAULT false)
RETURNS void
LANGUAGE plpgsql SECURITY DEFINER
SET search_path = pg_catalog, runledger, pg_temp
AS $$
DECLARE
    v_now timestamptz := runledger.now();
BEGIN
    PERFORM runledger._check_worker_id(p_worker_id);
    UPDATE runledger.workers
    SET heartbeat_at = v_now,
        stopped_at = CASE WHEN p_stopped THEN v_now ELSE stopped_at END
    WHERE worker_id = p_worker_id;
END
$$;


REVOKE ALL ON FUNCTION runledger._register_worker(text, text, int, text[], bigint, text),
    runledger.register_worker_v2(text, text, int, text[], boolean, text),
    runledger.heartbeat_worker(text, boolean) FROM PUBLIC;
DO $roles$
BEGIN
    IF EXISTS (SELECT 1 FROM pg_roles WHERE rolname = 'runledger_worker') THEN
        GRANT EXECUTE ON FUNCTION
            runledger.register_worker_v2(text, text, int, text[], boolean, text),
            runledger.heartbeat_worker(text, boolean)
        TO runledger_worker;
    END IF;
END
$roles$;
