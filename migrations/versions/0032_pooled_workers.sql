-- runledger 0032: a worker behind a pooler (PgBouncer in transaction or session mode)
-- has no database session of its own, so its registration cannot be tied to one. With
-- p_session false, register_worker_v2 records no session (session_pid NULL) and the id is
-- the worker's until it stops or has been silent for silent_after (its lease, by the
-- database clock). The same process taking its id back (workers.incarnation), and a
-- worker that found the registered process gone on its own host (p_gone_process), are
-- accepted at once; heartbeat_worker with p_incarnation refuses (RL008) a process whose
-- id was taken over. docs/leases.md, docs/operating.md ("PgBouncer").
-- Frozen once merged: change things in a new revision (and in the living files).

ALTER TABLE runledger.workers ADD COLUMN incarnation uuid;
ALTER TABLE runledger.workers ADD COLUMN silent_after interval;

DROP FUNCTION runledger.register_worker_v2(text, text, int, text[], boolean, text);
DROP FUNCTION runledger._register_worker(text, text, int, text[], bigint, text);
DROP FUNCTION runledger.heartbeat_worker(text, boolean);

-- A worker id belongs to one live worker at a time.
-- - Registered on a session of its own (p_session: the worker's listener connection, to
--   the server itself), it is that session's (pid and backend_start, so a reused pid is
--   not mistaken for it): another session may take it over once that one has ended (its
--   backend is gone from pg_stat_activity), or when it is the same session.
-- - Registered without one (revision 0032: through a pooler, whose server sessions
--   outlive the worker, or are another client's at the next transaction; session_pid
--   NULL), it is the worker's until it has been silent for silent_after (its lease: the
--   worker heartbeats every third of it), measured from heartbeat_at by the database
--   clock. The worker stops claiming before then, counting from when it sent its last
--   heartbeat (docs/leases.md).
-- Either way it may be taken over once the worker stopped cleanly; by the same process
-- (p_incarnation, minted when it started) unless a session of its own still holds a
-- session lock for it and it registers on a session of its own again; and by a worker
-- that found the registered process gone on its own host (p_gone_process equal to
-- workers.process: runledger.worker.liveness). A row
-- registered before revision 0003 (no session, no silent_after) is taken over at once.
-- backend_start of another role's session is visible to the function's owner only with
-- pg_read_all_stats (a superuser has it): without it the sessions are told apart by pid.
CREATE FUNCTION runledger._register_worker(p_worker_id text, p_hostname text, p_pid int,
                                           p_flows text[], p_session_lock bigint,
                                           p_process text DEFAULT NULL,
                                           p_incarnation uuid DEFAULT NULL,
                                           p_session boolean DEFAULT true,
                                           p_silent_after interval DEFAULT NULL,
                                           p_gone_process text DEFAULT NULL)
RETURNS void
LANGUAGE plpgsql
AS $$
DECLARE
    v_now timestamptz := runledger.now();
    v_session_pid integer;
    v_session_started timestamptz;
    v_held boolean;
    w runledger.workers;
BEGIN
    PERFORM runledger._check_worker_id(p_worker_id);
    PERFORM runledger._check_text('hostname', p_hostname, 0, runledger._cap('hostname'));
    PERFORM runledger._check_text('process', p_process, 0, runledger._cap('hostname'));
    PERFORM runledger._check_text('gone process', p_gone_process, 0, runledger._cap('hostname'));
    PERFORM runledger._parse_flows(p_flows);
    IF p_session IS NULL THEN
        PERFORM runledger._raise('RL006', 'session must be true or false', NULL, NULL);
    END IF;
    IF p_silent_after IS NOT NULL OR NOT p_session THEN
        -- without a session of its own, how long its silence takes is what frees the id
        PERFORM runledger._check_lease(p_silent_after);
    END IF;
    IF p_session THEN
        v_session_pid := pg_backend_pid();
        SELECT a.backend_start INTO v_session_started FROM pg_stat_activity a
        WHERE a.pid = v_session_pid;
    END IF;

    INSERT INTO runledger.workers (worker_id, hostname, pid, flows, started_at, heartbeat_at,
                                   session_pid, session_started_at, session_lock, process,
                                   incarnation, silent_after)
    VALUES (p_worker_id, coalesce(p_hostname, ''), coalesce(p_pid, 0), p_flows, v_now, v_now,
            v_session_pid, v_session_started, p_session_lock, p_process, p_incarnation,
            p_silent_after)
    ON CONFLICT ON CONSTRAINT pk_workers DO NOTHING;
    IF FOUND THEN
        RETURN;
    END IF;

    -- The id is registered (perhaps by a session whose insert we just waited for): lock
    -- the row, so two sessions taking one id over are judged one after the other.
    SELECT * INTO w FROM runledger.workers x WHERE x.worker_id = p_worker_id FOR UPDATE;
    v_held := CASE
        WHEN w.stopped_at IS NOT NULL THEN false
        -- the same process (its listener reconnected), unless a session of its own still
        -- holds a lock for the id and it registers on a session of its own again (it waits
        -- for that one to end); through a pooler the lock was never its own session's
        WHEN w.incarnation = p_incarnation AND (w.session_lock IS NULL OR NOT p_session)
            THEN false
        -- the caller found that process gone on its own host
        WHEN w.process = p_gone_process THEN false
        WHEN w.session_pid IS NOT NULL THEN
            NOT (w.session_pid IS NOT DISTINCT FROM v_session_pid
                 AND w.session_started_at IS NOT DISTINCT FROM v_session_started)
            AND EXISTS (SELECT 1 FROM pg_stat_activity a
                        WHERE a.pid = w.session_pid
                          AND (a.backend_start IS NULL OR w.session_started_at IS NULL
                               OR a.backend_start = w.session_started_at))
        -- no session of its own: held until it has been silent for silent_after
        ELSE w.silent_after IS NOT NULL AND w.heartbeat_at + w.silent_after > v_now
    END;
    IF v_held AND w.session_pid IS NOT NULL THEN
        PERFORM runledger._raise('RL008',
            format('worker id %s is in use by a live worker', p_worker_id),
            format('registered by host %s pid %s since %s (database session pid %s), not stopped',
                   coalesce(nullif(w.hostname, ''), '?'), w.pid, w.started_at, w.session_pid),
            'start this worker with another --worker-id, or stop the other worker first');
    ELSIF v_held THEN
        PERFORM runledger._raise('RL008',
            format('worker id %s is in use by a live worker', p_worker_id),
            format('registered by host %s pid %s since %s without a session of its own '
                   '(through a pooler), last heartbeat %s ago: the id is free once it has '
                   'been silent for %s',
                   coalesce(nullif(w.hostname, ''), '?'), w.pid, w.started_at,
                   date_trunc('second', v_now - w.heartbeat_at), w.silent_after),
            'start this worker with another --worker-id, or stop the other worker first');
    END IF;
    -- session_lock: the caller's (NULL from register_worker: a worker of the previous
    -- release that takes an id over must not inherit the last holder's key)
    UPDATE runledger.workers
    SET hostname = coalesce(p_hostname, ''), pid = coalesce(p_pid, 0), flows = p_flows,
        started_at = v_now, heartbeat_at = v_now, stopped_at = NULL,
        session_pid = v_session_pid, session_started_at = v_session_started,
        session_lock = p_session_lock, process = p_process, incarnation = p_incarnation,
        silent_after = p_silent_after
    WHERE worker_id = p_worker_id;
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
-- Revision 0031: p_process, the worker's process as its host names it (workers.process).
-- Revision 0032: p_incarnation, the worker process's own random id; p_session false:
-- the calling session is not the worker's own (a pooler's), so the id is not tied to it
-- but to the worker's heartbeats (p_silent_after, required then); p_gone_process: the
-- registered process, which the caller found gone on its own host (_register_worker).
CREATE FUNCTION runledger.register_worker_v2(p_worker_id text, p_hostname text, p_pid int,
                                             p_flows text[], p_session_lock boolean,
                                             p_process text DEFAULT NULL,
                                             p_incarnation uuid DEFAULT NULL,
                                             p_session boolean DEFAULT true,
                                             p_silent_after interval DEFAULT NULL,
                                             p_gone_process text DEFAULT NULL)
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
    IF p_session_lock AND p_session IS NOT TRUE THEN
        PERFORM runledger._raise('RL006', 'a session lock needs a session of its own',
            'register with p_session_lock false through a pooler', NULL);
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
                                       p_process, p_incarnation, p_session, p_silent_after,
                                       p_gone_process);
    session_lock := v_key;
    session_pid := pg_backend_pid();
    RETURN NEXT;
END
$$;

-- An unknown worker id is a no-op: the worker may have been registered in another
-- database, or its row removed by hand. Revision 0032: with p_incarnation, only the
-- process that holds the registration heartbeats (or says it stopped); another one (the
-- id was taken over while it was silent, or after its process was found gone) is
-- refused with RL008, and stops.
CREATE FUNCTION runledger.heartbeat_worker(p_worker_id text, p_stopped boolean DEFAULT false,
                                           p_incarnation uuid DEFAULT NULL)
RETURNS void
LANGUAGE plpgsql SECURITY DEFINER
SET search_path = pg_catalog, runledger, pg_temp
AS $$
DECLARE
    v_now timestamptz := runledger.now();
    w runledger.workers;
BEGIN
    PERFORM runledger._check_worker_id(p_worker_id);
    UPDATE runledger.workers
    SET heartbeat_at = v_now,
        stopped_at = CASE WHEN p_stopped THEN v_now ELSE stopped_at END
    WHERE worker_id = p_worker_id
      AND (p_incarnation IS NULL OR incarnation IS NOT DISTINCT FROM p_incarnation);
    IF NOT FOUND AND p_incarnation IS NOT NULL THEN
        SELECT * INTO w FROM runledger.workers x WHERE x.worker_id = p_worker_id;
        IF FOUND THEN
            PERFORM runledger._raise('RL008',
                format('worker id %s was taken over by another worker', p_worker_id),
                format('registered by host %s pid %s since %s',
                       coalesce(nullif(w.hostname, ''), '?'), w.pid, w.started_at),
                'this worker stops; start it with another --worker-id to run both');
        END IF;
    END IF;
END
$$;

REVOKE ALL ON FUNCTION
    runledger._register_worker(text, text, int, text[], bigint, text, uuid, boolean, interval,
                               text),
    runledger.register_worker_v2(text, text, int, text[], boolean, text, uuid, boolean,
                                 interval, text),
    runledger.heartbeat_worker(text, boolean, uuid) FROM PUBLIC;
DO $roles$
BEGIN
    IF EXISTS (SELECT 1 FROM pg_roles WHERE rolname = 'runledger_worker') THEN
        GRANT EXECUTE ON FUNCTION
            runledger.register_worker_v2(text, text, int, text[], boolean, text, uuid, boolean,
                                         interval, text),
            runledger.heartbeat_worker(text, boolean, uuid)
        TO runledger_worker;
    ELSE
        RAISE WARNING 'runledger: role runledger_worker does not exist; grant EXECUTE on runledger.register_worker_v2 and heartbeat_worker by hand';
    END IF;
END
$roles$;
