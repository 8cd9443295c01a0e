-- runledger 0003: hostile input is refused in SQL, and nothing is written.
-- settings.max_json_depth (64): every JSON argument is refused (RL006) when it nests deeper
-- (_check_json_depth, a jsonpath search in C); record_turn's calls may nest two levels
-- more, so each call's args is held to the limit itself. Caps on every text and array
-- argument in one place (_cap, _check_text): refused, never cut. Every function that takes
-- a worker id checks it; report_stale_write refuses a run that does not exist (RL003).
-- _lock_leased_run reads the clock after the row lock is held, and so do the lease
-- holders' writes. register_worker records the calling session (workers.session_pid,
-- session_started_at) and refuses the id to another session while that one is alive
-- (RL008). Frozen once merged: change things in a new revision (and in the living files).

ALTER TABLE runledger.settings
    ADD COLUMN max_json_depth integer NOT NULL DEFAULT 64,
    ADD CONSTRAINT ck_settings_max_json_depth CHECK (max_json_depth BETWEEN 1 AND 1000);

ALTER TABLE runledger.workers
    ADD COLUMN session_pid integer,
    ADD COLUMN session_started_at timestamptz;


-- New helpers.

CREATE FUNCTION runledger._cap(p_name text) RETURNS integer
LANGUAGE sql IMMUTABLE
SET search_path = pg_catalog, runledger, pg_temp
AS $$
    SELECT CASE p_name
        WHEN 'worker_id' THEN 200
        WHEN 'hostname' THEN 255
        WHEN 'actor' THEN 200
        WHEN 'release_reason' THEN 200
        WHEN 'reason' THEN 1000
        WHEN 'note' THEN 4000
        WHEN 'operation' THEN 100
        WHEN 'message' THEN 4000
        WHEN 'idempotency_key' THEN 300
        WHEN 'flows' THEN 1000
        WHEN 'run_ids' THEN 10000
    END
$$;

CREATE FUNCTION runledger._check_text(p_what text, p_value text, p_min integer, p_max integer)
RETURNS void
LANGUAGE plpgsql IMMUTABLE
SET search_path = pg_catalog, runledger, pg_temp
AS $$
DECLARE
    v_length integer := length(p_value);
BEGIN
    IF (p_value IS NULL AND p_min > 0) OR v_length < p_min OR v_length > p_max THEN
        PERFORM runledger._raise('RL006',
            format('%s must be %s-%s characters, got %s', p_what, p_min, p_max,
                   coalesce(v_length::text, 'NULL')),
            format('%s starts %s', p_what, coalesce(quote_literal(left(p_value, 60)), 'NULL')),
            'the caps of text arguments are listed in docs/design.md (Caps and limits)');
    END IF;
END
$$;

CREATE FUNCTION runledger._check_json_depth(p_what text, p_value jsonb, p_max integer)
RETURNS void
LANGUAGE plpgsql IMMUTABLE
SET search_path = pg_catalog, runledger, pg_temp
AS $$
BEGIN
    IF jsonb_path_exists(p_value, format(
           'strict $.**{%s} ? (@.type() == "object" || @.type() == "array")', p_max)::jsonpath)
    THEN
        PERFORM runledger._raise('RL006',
            format('%s nests deeper than %s levels', p_what, p_max),
            'a scalar is depth 0 and each enclosing object or array adds one: {"a": [1]} is depth 2',
            'the limit is runledger.settings.max_json_depth');
    END IF;
END
$$;

-- The JSON checks take p_wrap (record_turn's calls: 2 levels of the contract's own).
DROP FUNCTION runledger._check_json_value_or_null(text, jsonb);
DROP FUNCTION runledger._check_json_value(text, jsonb);

CREATE FUNCTION runledger._check_json_value_or_null(p_what text, p_value jsonb,
                                                    p_wrap integer DEFAULT 0) RETURNS void
LANGUAGE plpgsql STABLE
SET search_path = pg_catalog, runledger, pg_temp
AS $$
DECLARE
    v_cap integer;
    v_depth integer;
    v_size integer;
BEGIN
    IF p_value IS NULL THEN
        RETURN;
    END IF;
    SELECT s.max_payload_bytes, s.max_json_depth INTO v_cap, v_depth FROM runledger.settings s;
    v_size := octet_length(p_value::text);
    IF v_size > coalesce(v_cap, 1048576) THEN
        PERFORM runledger._raise('RL006',
            format('%s is %s bytes, over the cap of %s bytes', p_what, v_size, v_cap),
            NULL, 'the cap is runledger.settings.max_payload_bytes');
    END IF;
    PERFORM runledger._check_json_depth(p_what, p_value, coalesce(v_depth, 64) + p_wrap);
END
$$;

CREATE FUNCTION runledger._check_json_value(p_what text, p_value jsonb,
                                            p_wrap integer DEFAULT 0) RETURNS void
LANGUAGE plpgsql STABLE
SET search_path = pg_catalog, runledger, pg_temp
AS $$
BEGIN
    IF p_value IS NULL THEN
        PERFORM runledger._raise('RL006', format('%s must not be null', p_what), NULL, NULL);
    END IF;
    PERFORM runledger._check_json_value_or_null(p_what, p_value, p_wrap);
END
$$;

-- Changed bodies.

CREATE OR REPLACE FUNCTION runledger._check_worker_id(p_worker_id text) RETURNS void
LANGUAGE plpgsql IMMUTABLE
SET search_path = pg_catalog, runledger, pg_temp
AS $$
BEGIN
    PERFORM runledger._check_text('worker id', p_worker_id, 1, runledger._cap('worker_id'));
END
$$;

CREATE OR REPLACE FUNCTION runledger._parse_flows(p_flows text[], OUT names text[], OUT versions text[])
LANGUAGE plpgsql IMMUTABLE
SET search_path = pg_catalog, runledger, pg_temp
AS $$
DECLARE
    f text;
BEGIN
    names := '{}';
    versions := '{}';
    IF p_flows IS NULL THEN
        PERFORM runledger._raise('RL006', 'flows must not be null', NULL, NULL);
    END IF;
    IF cardinality(p_flows) > runledger._cap('flows') THEN
        PERFORM runledger._raise('RL006',
            format('flows has %s elements, over the cap of %s', cardinality(p_flows),
                   runledger._cap('flows')), NULL, NULL);
    END IF;
    FOREACH f IN ARRAY p_flows LOOP
        IF f IS NULL OR f !~ '^[A-Za-z0-9][A-Za-z0-9._-]{0,127}@[A-Za-z0-9][A-Za-z0-9._+-]{0,63}$' THEN
            PERFORM runledger._raise('RL006',
                format('invalid flow reference %s', coalesce(quote_literal(left(f, 200)), 'NULL')),
                'a flow reference is name@version', NULL);
        END IF;
        names := names || split_part(f, '@', 1);
        versions := versions || split_part(f, '@', 2);
    END LOOP;
END
$$;

CREATE OR REPLACE FUNCTION runledger._lock_leased_run(p_run_id text, p_lease_id uuid, p_fencing_token bigint)
RETURNS runledger.runs
LANGUAGE plpgsql
SET search_path = pg_catalog, runledger, pg_temp
AS $$
DECLARE
    r runledger.runs;
    v_now timestamptz;
BEGIN
    r := runledger._lock_run(p_run_id);
    -- The clock is read once the row lock is held: a write that waited on the lock past
    -- the lease's expiry is refused. runledger.now() is VOLATILE, so under READ COMMITTED
    -- its query takes a new snapshot and sees a clock_offset committed during the wait.
    v_now := runledger.now();
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

CREATE OR REPLACE FUNCTION runledger._lock_call(p_run_id text, p_key text) RETURNS runledger.run_calls
LANGUAGE plpgsql
SET search_path = pg_catalog, runledger, pg_temp
AS $$
DECLARE
    c runledger.run_calls;
BEGIN
    PERFORM runledger._check_text('idempotency key', p_key, 1, runledger._cap('idempotency_key'));
    SELECT * INTO c FROM runledger.run_calls x WHERE x.idempotency_key = p_key FOR UPDATE;
    IF NOT FOUND OR c.run_id <> p_run_id THEN
        PERFORM runledger._raise('RL003',
            format('call %s not found in run %s', p_key, p_run_id), NULL, NULL);
    END IF;
    RETURN c;
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
    v_run_id text;
BEGIN
    PERFORM runledger._check_worker_id(p_worker_id);
    PERFORM runledger._check_lease(p_lease);
    IF coalesce(cardinality(p_run_ids), 0) <> coalesce(cardinality(p_lease_ids), 0) THEN
        PERFORM runledger._raise('RL006', 'run ids and lease ids must be arrays of one length',
            NULL, NULL);
    END IF;
    IF cardinality(p_run_ids) > runledger._cap('run_ids') THEN
        PERFORM runledger._raise('RL006',
            format('run ids has %s elements, over the cap of %s', cardinality(p_run_ids),
                   runledger._cap('run_ids')), NULL, NULL);
    END IF;
    FOREACH v_run_id IN ARRAY coalesce(p_run_ids, '{}') LOOP
        PERFORM runledger._check_run_id(v_run_id);
    END LOOP;
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
    v_now timestamptz;
BEGIN
    r := runledger._lock_leased_run(p_run_id, p_lease_id, p_fencing_token);
    v_now := runledger.now();  -- after the lock, as the lease check
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

CREATE OR REPLACE FUNCTION runledger.release_lease(p_run_id text, p_lease_id uuid, p_fencing_token bigint,
                                        p_reason text, p_error jsonb)
RETURNS void
LANGUAGE plpgsql SECURITY DEFINER
SET search_path = pg_catalog, runledger, pg_temp
AS $$
DECLARE
    r runledger.runs;
    v_now timestamptz;
BEGIN
    r := runledger._lock_leased_run(p_run_id, p_lease_id, p_fencing_token);
    v_now := runledger.now();  -- after the lock, as the lease check
    PERFORM runledger._check_text('reason', p_reason, 1, runledger._cap('release_reason'));
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

CREATE OR REPLACE FUNCTION runledger.report_stale_write(p_run_id text, p_worker_id text, p_lease_id uuid,
                                             p_fencing_token bigint, p_operation text,
                                             p_message text)
RETURNS void
LANGUAGE plpgsql SECURITY DEFINER
SET search_path = pg_catalog, runledger, pg_temp
AS $$
DECLARE
    r runledger.runs;
BEGIN
    PERFORM runledger._check_run_id(p_run_id);
    PERFORM runledger._check_worker_id(p_worker_id);
    PERFORM runledger._check_text('operation', p_operation, 1, runledger._cap('operation'));
    PERFORM runledger._check_text('message', p_message, 0, runledger._cap('message'));
    SELECT * INTO r FROM runledger.runs x WHERE x.run_id = p_run_id;
    IF NOT FOUND THEN
        PERFORM runledger._raise('RL003', format('run %s not found', p_run_id),
            'a stale write is reported only for a run that exists', NULL);
    END IF;
    PERFORM runledger._event(p_run_id, 'stale_write_rejected', p_worker_id, NULL, NULL,
        jsonb_build_object('operation', p_operation, 'stale_lease_id', p_lease_id,
                           'stale_token', p_fencing_token, 'current_token', r.fencing_token,
                           'current_owner', r.lease_owner, 'message', p_message));
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

CREATE OR REPLACE FUNCTION runledger.heartbeat_worker(p_worker_id text, p_stopped boolean DEFAULT false)
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
    -- each call's args may nest as deep as any JSON value: the array and the call object
    -- around them are two levels of the contract's own
    PERFORM runledger._check_json_value('calls', p_calls, 2);
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

CREATE OR REPLACE FUNCTION runledger.dispatch_call(p_run_id text, p_lease_id uuid, p_fencing_token bigint,
                                        p_idempotency_key text)
RETURNS int
LANGUAGE plpgsql SECURITY DEFINER
SET search_path = pg_catalog, runledger, pg_temp
AS $$
DECLARE
    r runledger.runs;
    c runledger.run_calls;
    v_now timestamptz;
BEGIN
    r := runledger._lock_leased_run(p_run_id, p_lease_id, p_fencing_token);
    v_now := runledger.now();  -- after the lock, as the lease check
    c := runledger._lock_call(p_run_id, p_idempotency_key);
    IF c.status NOT IN ('planned', 'dispatched') THEN
        PERFORM runledger._raise('RL004',
            format('call %s is %s and cannot be dispatched', p_idempotency_key, c.status),
            format('attempts %s, last token %s', c.attempts,
                   coalesce(c.completed_token, c.dispatched_token)),
            CASE c.status WHEN 'unknown'
                 THEN 'an operator must resolve it (runledger resolve)'
                 ELSE 'the call already has a final result: reuse it' END);
    END IF;
    UPDATE runledger.run_calls
    SET status = 'dispatched', attempts = c.attempts + 1, dispatched_token = p_fencing_token,
        dispatched_by = r.lease_owner, dispatched_at = v_now
    WHERE idempotency_key = p_idempotency_key AND status IN ('planned', 'dispatched');
    PERFORM runledger._event(p_run_id, 'call_dispatched', r.lease_owner, p_fencing_token,
        r.state_version, jsonb_build_object('idempotency_key', p_idempotency_key,
                                            'tool', c.tool, 'attempt', c.attempts + 1,
                                            'previous_status', c.status));
    RETURN c.attempts + 1;
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
    v_now timestamptz;
    v_detail jsonb;
BEGIN
    r := runledger._lock_leased_run(p_run_id, p_lease_id, p_fencing_token);
    v_now := runledger.now();  -- after the lock, as the lease check
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
    v_now timestamptz;
    v_open integer;
    v_detail jsonb;
BEGIN
    r := runledger._lock_leased_run(p_run_id, p_lease_id, p_fencing_token);
    v_now := runledger.now();  -- after the lock, as the lease check
    PERFORM runledger._check_word('status', p_status, ARRAY['succeeded', 'failed', 'paused']);
    PERFORM runledger._check_json_value_or_null('result', p_result);
    PERFORM runledger._check_text('reason', p_reason, 0, runledger._cap('reason'));
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
    PERFORM runledger._check_text('actor', p_actor, 1, runledger._cap('actor'));
    PERFORM runledger._check_text('note', p_note, 0, runledger._cap('note'));
    PERFORM runledger._check_text('idempotency key', p_idempotency_key, 1,
                                  runledger._cap('idempotency_key'));
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

CREATE OR REPLACE FUNCTION runledger.cancel_run(p_run_id text, p_actor text, p_reason text)
RETURNS void
LANGUAGE plpgsql SECURITY DEFINER
SET search_path = pg_catalog, runledger, pg_temp
AS $$
DECLARE
    r runledger.runs;
    v_now timestamptz := runledger.now();
BEGIN
    -- a NULL actor is the default 'operator'; an empty one is refused
    PERFORM runledger._check_text('actor', coalesce(p_actor, 'operator'), 1,
                                  runledger._cap('actor'));
    PERFORM runledger._check_text('reason', p_reason, 0, runledger._cap('reason'));
    r := runledger._lock_run(p_run_id);
    IF r.status = 'cancelled' THEN
        RETURN;
    END IF;
    IF r.status IN ('succeeded', 'failed') THEN
        PERFORM runledger._raise('RL004',
            format('run %s already %s', p_run_id, r.status), NULL, NULL);
    END IF;
    UPDATE runledger.runs
    SET status = 'cancelled', lease_id = NULL, lease_expires_at = NULL, lease_owner = NULL,
        error = jsonb_strip_nulls(jsonb_build_object('reason', 'cancelled', 'note', p_reason)),
        finished_at = v_now, updated_at = v_now
    WHERE run_id = p_run_id AND status IN ('queued', 'running', 'paused');
    -- A call in flight may have taken effect: it becomes unknown, for a person to
    -- reconcile (resolve_call works on cancelled runs), instead of dispatched forever.
    UPDATE runledger.run_calls
    SET status = 'unknown',
        error = jsonb_build_object('reason', 'cancelled while in flight'),
        completed_at = v_now
    WHERE run_id = p_run_id AND status = 'dispatched';
    PERFORM runledger._event(p_run_id, 'run_cancelled', coalesce(p_actor, 'operator'), NULL,
        r.state_version, jsonb_strip_nulls(jsonb_build_object(
            'reason', p_reason, 'previous_status', r.status, 'previous_owner', r.lease_owner)));
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
    PERFORM runledger._check_text('actor', coalesce(p_actor, 'operator'), 1,
                                  runledger._cap('actor'));
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

-- Internal helpers: granted to no one.

REVOKE ALL ON FUNCTION runledger._cap(text) FROM PUBLIC;

REVOKE ALL ON FUNCTION runledger._check_text(text, text, integer, integer) FROM PUBLIC;

REVOKE ALL ON FUNCTION runledger._check_json_depth(text, jsonb, integer) FROM PUBLIC;

REVOKE ALL ON FUNCTION runledger._check_json_value_or_null(text, jsonb, integer) FROM PUBLIC;

REVOKE ALL ON FUNCTION runledger._check_json_value(text, jsonb, integer) FROM PUBLIC;
