-- runledger 0031: a lost connection is not a dead worker. A call an earlier holder sent,
-- with no answer journaled, is looked up or sent again only once that sender can no longer
-- be sending it: it said so (release_call), its process is known gone (release_call by
-- the holder, with the evidence), or its lease has expired by the database clock
-- (runledger._sender_until; _dispatch refuses with RL009 before then). call_sender tells
-- the current holder who sent a call in flight and until when it may be sending it;
-- workers.process and register_worker_v2's p_process name a worker's process, for a peer
-- on the same host to check. docs/leases.md.
-- Frozen once merged: change things in a new revision (and in the living files).

ALTER TABLE runledger.workers ADD COLUMN process text;

DROP FUNCTION runledger.register_worker_v2(text, text, int, text[], boolean);
DROP FUNCTION runledger._register_worker(text, text, int, text[], bigint);


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

CREATE FUNCTION runledger._sender_until(p_run_id text, p_key text, p_token bigint,
                                        p_attempt integer, p_now timestamptz)
RETURNS timestamptz
LANGUAGE plpgsql
AS $$
DECLARE
    v_kind text;
    v_detail jsonb;
    v_until timestamptz;
BEGIN
    IF EXISTS (SELECT 1 FROM runledger.run_events e
               WHERE e.run_id = p_run_id AND e.kind = 'send_released'
                 AND e.detail ->> 'idempotency_key' = p_key
                 AND e.detail ->> 'attempt' = p_attempt::text) THEN
        RETURN NULL;
    END IF;
    -- the claim that ended the sender's lease: the first one with a greater token
    SELECT e.kind, e.detail INTO v_kind, v_detail FROM runledger.run_events e
    WHERE e.run_id = p_run_id AND e.kind IN ('claimed', 'takeover')
      AND e.fencing_token > p_token
    ORDER BY e.event_id LIMIT 1;
    -- 'claimed': the run was queued again by its holder (released, paused) or by an
    -- operator, not taken from a lease that still ran
    IF v_kind IS DISTINCT FROM 'takeover' THEN
        RETURN NULL;
    END IF;
    v_until := (v_detail ->> 'previous_lease_expires_at')::timestamptz;
    IF v_until IS NULL OR v_until <= p_now THEN
        RETURN NULL;
    END IF;
    RETURN v_until;
END
$$;

CREATE FUNCTION runledger.call_sender(p_run_id text, p_lease_id uuid, p_fencing_token bigint,
                                      p_idempotency_key text)
RETURNS TABLE (sender text, sender_token bigint, attempt integer, dispatched_at timestamptz,
               until timestamptz, released jsonb, process text, registered_at timestamptz,
               now timestamptz)
LANGUAGE plpgsql SECURITY DEFINER
SET search_path = pg_catalog, runledger, pg_temp
AS $$
DECLARE
    v_lock record;
    c runledger.run_calls;
BEGIN
    v_lock := runledger._lock_leased_run_at(p_run_id, p_lease_id, p_fencing_token);
    c := runledger._lock_call(p_run_id, p_idempotency_key);
    IF c.status <> 'dispatched' THEN
        RETURN;
    END IF;
    sender := c.dispatched_by;
    sender_token := c.dispatched_token;
    attempt := c.attempts;
    dispatched_at := c.dispatched_at;
    now := v_lock.at;
    SELECT e.detail INTO released FROM runledger.run_events e
    WHERE e.run_id = p_run_id AND e.kind = 'send_released'
      AND e.detail ->> 'idempotency_key' = p_idempotency_key
      AND e.detail ->> 'attempt' = c.attempts::text
    ORDER BY e.event_id LIMIT 1;
    -- released: no sender is sending it (the release is what _sender_until looks for first)
    IF released IS NULL AND c.dispatched_token < p_fencing_token THEN
        until := runledger._sender_until(p_run_id, p_idempotency_key, c.dispatched_token,
                                         c.attempts, v_lock.at);
    END IF;
    SELECT w.process, w.started_at INTO process, registered_at
    FROM runledger.workers w WHERE w.worker_id = c.dispatched_by;
    RETURN NEXT;
END
$$;

CREATE FUNCTION runledger.release_call(p_run_id text, p_lease_id uuid, p_fencing_token bigint,
                                       p_idempotency_key text, p_worker_id text,
                                       p_detail jsonb)
RETURNS boolean
LANGUAGE plpgsql SECURITY DEFINER
SET search_path = pg_catalog, runledger, pg_temp
AS $$
DECLARE
    r runledger.runs;
    c runledger.run_calls;
    v_now timestamptz;
    v_by text;
BEGIN
    PERFORM runledger._check_worker_id(p_worker_id);
    PERFORM runledger._check_json_object('detail', p_detail);
    IF NOT (p_detail ? 'ended') OR jsonb_typeof(p_detail -> 'ended') <> 'string'
       OR NOT (p_detail ->> 'ended' = ANY (ARRAY['returned', 'raised', 'not_applied',
                                                 'cancelled', 'not_sent',
                                                 'process_gone'])) THEN
        PERFORM runledger._raise('RL006',
            'detail.ended must be returned, raised, not_applied, cancelled, not_sent or '
            'process_gone',
            format('detail.ended is %s', coalesce(p_detail -> 'ended', 'null'::jsonb)), NULL);
    END IF;
    IF p_lease_id IS NULL OR p_fencing_token IS NULL THEN
        PERFORM runledger._raise('RL006', 'lease id and fencing token must not be null',
                                 NULL, NULL);
    END IF;
    r := runledger._lock_run(p_run_id);
    v_now := runledger.now();
    c := runledger._lock_call(p_run_id, p_idempotency_key);
    IF c.dispatched_token = p_fencing_token THEN
        -- the sender: the lease its token was granted with
        IF NOT EXISTS (SELECT 1 FROM runledger.run_events e
                       WHERE e.run_id = p_run_id AND e.kind IN ('claimed', 'takeover')
                         AND e.fencing_token = p_fencing_token
                         AND e.detail ->> 'lease_id' = p_lease_id::text) THEN
            PERFORM runledger._raise('RL001',
                format('lease %s token %s did not send call %s', p_lease_id, p_fencing_token,
                       p_idempotency_key),
                'no claim of the run granted that lease with that token', NULL);
        END IF;
        IF p_detail ->> 'ended' = 'process_gone' THEN
            PERFORM runledger._raise('RL006', 'a sender cannot say its own process is gone',
                                     NULL, NULL);
        END IF;
        v_by := 'sender';
    ELSE
        -- the current holder, for a call an earlier holder sent
        IF r.status <> 'running' OR r.lease_id IS DISTINCT FROM p_lease_id
           OR r.fencing_token IS DISTINCT FROM p_fencing_token OR r.lease_expires_at <= v_now
           OR NOT (c.dispatched_token < p_fencing_token) THEN
            PERFORM runledger._raise('RL001',
                format('lease %s token %s neither sent call %s nor holds run %s', p_lease_id,
                       p_fencing_token, p_idempotency_key, p_run_id),
                format('the call was last sent under token %s; the run is %s under token %s',
                       coalesce(c.dispatched_token::text, 'none'), r.status, r.fencing_token),
                NULL);
        END IF;
        IF p_detail ->> 'ended' <> 'process_gone' OR NOT (p_detail ? 'process') THEN
            PERFORM runledger._raise('RL006',
                'a holder releases an earlier sender''s call only with ended process_gone '
                'and the process it checked', NULL, NULL);
        END IF;
        v_by := 'holder';
    END IF;
    IF c.status <> 'dispatched' OR EXISTS (
           SELECT 1 FROM runledger.run_events e
           WHERE e.run_id = p_run_id AND e.kind = 'send_released'
             AND e.detail ->> 'idempotency_key' = p_idempotency_key
             AND e.detail ->> 'attempt' = c.attempts::text) THEN
        RETURN false;
    END IF;
    PERFORM runledger._event(p_run_id, 'send_released', p_worker_id,
        CASE WHEN v_by = 'holder' THEN p_fencing_token END, NULL,
        p_detail || jsonb_build_object('idempotency_key', p_idempotency_key,
                                       'attempt', c.attempts,
                                       'sender', c.dispatched_by,
                                       'sender_token', c.dispatched_token, 'by', v_by),
        v_now);
    RETURN true;
END
$$;

CREATE OR REPLACE FUNCTION runledger._dispatch(p_run_id text, p_key text, p_owner text,
                                    p_fencing_token bigint, p_state_version bigint,
                                    p_now timestamptz) RETURNS integer
LANGUAGE plpgsql
AS $$
DECLARE
    c runledger.run_calls;
    v_tool text;
    v_attempt integer;
    v_previous text;
    v_sender bigint;
    v_until timestamptz;
BEGIN
    UPDATE runledger.run_calls x
    SET status = 'dispatched', attempts = x.attempts + 1, dispatched_token = p_fencing_token,
        dispatched_by = p_owner, dispatched_at = p_now
    FROM runledger.run_calls o
    WHERE x.idempotency_key = p_key AND o.idempotency_key = p_key
      AND x.run_id IS NOT DISTINCT FROM p_run_id
      AND x.status IN ('planned', 'dispatched') AND x.approval IS DISTINCT FROM 'pending'
    RETURNING x.tool, x.attempts, o.status, o.dispatched_token
    INTO v_tool, v_attempt, v_previous, v_sender;
    IF NOT FOUND THEN
        c := runledger._lock_call(p_run_id, p_key);
        IF c.status NOT IN ('planned', 'dispatched') THEN
            PERFORM runledger._raise('RL004',
                format('call %s is %s and cannot be dispatched', p_key, c.status),
                format('attempts %s, last token %s', c.attempts,
                       coalesce(c.completed_token, c.dispatched_token)),
                CASE c.status WHEN 'unknown'
                     THEN 'an operator must resolve it (runledger resolve)'
                     ELSE 'the call already has a final result: reuse it' END);
        END IF;
        IF c.approval = 'pending' THEN
            PERFORM runledger._raise('RL004',
                format('call %s awaits approval and cannot be dispatched', p_key),
                format('tool %s, recorded in turn %s', c.tool, c.turn),
                format('a person approves it (runledger approve %s) or denies it '
                       '(runledger deny %s --reason ...); pause the run until then',
                       p_key, p_key));
        END IF;
        -- not reached while every writer of the run's calls holds the run's lock (a call
        -- that passes the checks matched the UPDATE): the write as before 0019
        UPDATE runledger.run_calls
        SET status = 'dispatched', attempts = c.attempts + 1, dispatched_token = p_fencing_token,
            dispatched_by = p_owner, dispatched_at = p_now
        WHERE idempotency_key = p_key AND status IN ('planned', 'dispatched')
          AND approval IS DISTINCT FROM 'pending';
        v_tool := c.tool;
        v_attempt := c.attempts + 1;
        v_previous := c.status;
        v_sender := c.dispatched_token;
    END IF;
    -- Revision 0031: a call an earlier holder sent, with no answer journaled, is sent
    -- again only once that sender can no longer be sending it (runledger._sender_until);
    -- the refusal undoes the UPDATE above.
    IF v_previous = 'dispatched' AND v_sender < p_fencing_token THEN
        v_until := runledger._sender_until(p_run_id, p_key, v_sender, v_attempt - 1, p_now);
        IF v_until IS NOT NULL THEN
            PERFORM runledger._raise('RL009',
                format('call %s may still be on its way from its earlier sender', p_key),
                format('attempt %s was sent under token %s, whose lease runs until %s; '
                       'the sender has not said that its send ended', v_attempt - 1, v_sender,
                       v_until),
                'wait until then, or until the sender releases it (runledger.release_call)');
        END IF;
    END IF;
    PERFORM runledger._event(p_run_id, 'call_dispatched', p_owner, p_fencing_token,
        p_state_version, jsonb_build_object('idempotency_key', p_key, 'tool', v_tool,
                                            'attempt', v_attempt,
                                            'previous_status', v_previous), p_now);
    RETURN v_attempt;
END
$$;

CREATE OR REPLACE FUNCTION runledger.complete_call_v2(p_run_id text, p_lease_id uuid, p_fencing_token bigint,
                                           p_idempotency_key text, p_outcome text,
                                           p_result jsonb, p_receipt jsonb,
                                           p_next_key text DEFAULT NULL)
RETURNS int
LANGUAGE plpgsql SECURITY DEFINER
SET search_path = pg_catalog, runledger, pg_temp
AS $$
DECLARE
    v_lock record;
    r runledger.runs;
    c runledger.run_calls;
    v_now timestamptz;
    v_detail jsonb;
    v_tool text;
    v_attempts integer;
    v_done boolean := false;
    v_this tid;
    v_that tid;
    v_previous text;
    v_next record;
BEGIN
    -- the clock the lease check read after the lock (revision 0019)
    v_lock := runledger._lock_leased_run_at(p_run_id, p_lease_id, p_fencing_token);
    r := v_lock.r;
    v_now := v_lock.at;
    -- the checks' common cases inline (revision 0019): a check helper runs only where it
    -- refuses or has a value to measure, in the same order
    IF p_outcome IS NULL OR p_outcome NOT IN ('succeeded', 'failed', 'unknown', 'not_applied') THEN
        PERFORM runledger._check_word('outcome', p_outcome,
                                      ARRAY['succeeded', 'failed', 'unknown', 'not_applied']);
    END IF;
    IF p_result IS NOT NULL THEN
        PERFORM runledger._check_json_value_or_null('result', p_result);
    END IF;
    IF p_receipt IS NOT NULL THEN
        PERFORM runledger._check_json_object_or_null('receipt', p_receipt);
    END IF;
    -- Revision 0019: the call's UPDATE first, one statement instead of SELECT ... FOR
    -- UPDATE and an UPDATE of the same row (the lock was one more heap write and WAL
    -- record), when the next call's arguments are fine. The call is the one _lock_call
    -- would lock: every writer of a run's calls holds the run's row lock first, as
    -- this function does. Only when no row matched (an invalid key, a key of another
    -- run, a call not dispatched) or a next-call refusal is due does the path of
    -- revision 0008 run, to refuse with the exact error in the same order. The run is
    -- a filter (IS NOT DISTINCT FROM), as in _dispatch: the row is found by its key.
    -- Revision 0021: with the next call, both rows in one UPDATE (one statement's start,
    -- constraint and trigger set-up instead of two), only when both would pass: this call
    -- dispatched, the next one planned or dispatched and not awaiting approval, both of
    -- this run. One read of both rows, each by its key, finds out, with the status the
    -- next call has now (its call_dispatched names it) and where each row is: the UPDATE
    -- goes to them by ctid (a plan that does not depend on the table's size or
    -- statistics) and repeats the conditions. As every writer of the run's calls holds
    -- the run's lock, it writes both. Otherwise nothing is written here and the path
    -- below refuses with the exact error, as before. What the next call's row gets is
    -- what _dispatch writes.
    IF p_next_key IS NOT NULL AND p_outcome IN ('succeeded', 'failed')
       AND p_next_key <> p_idempotency_key THEN
        SELECT c1.ctid, c2.ctid, c2.status INTO v_this, v_that, v_previous
        FROM runledger.run_calls c1, runledger.run_calls c2
        WHERE c1.idempotency_key = p_idempotency_key AND c1.run_id IS NOT DISTINCT FROM p_run_id
          AND c1.status = 'dispatched'
          AND c2.idempotency_key = p_next_key AND c2.run_id IS NOT DISTINCT FROM p_run_id
          AND c2.status IN ('planned', 'dispatched') AND c2.approval IS DISTINCT FROM 'pending'
          -- revision 0031: one an earlier holder sent goes through _dispatch's sender check
          AND (c2.status = 'planned' OR c2.dispatched_token >= p_fencing_token);
    END IF;
    IF v_that IS NOT NULL THEN
        WITH u AS (
            UPDATE runledger.run_calls x
            SET status = CASE WHEN x.idempotency_key = p_idempotency_key THEN p_outcome
                              ELSE 'dispatched' END,
                result = CASE WHEN x.idempotency_key <> p_idempotency_key THEN x.result
                              WHEN p_outcome = 'succeeded' THEN p_result END,
                receipt = CASE WHEN x.idempotency_key = p_idempotency_key THEN p_receipt
                               ELSE x.receipt END,
                error = CASE WHEN x.idempotency_key <> p_idempotency_key THEN x.error
                             WHEN p_outcome = 'failed' THEN p_result END,
                completed_token = CASE WHEN x.idempotency_key = p_idempotency_key
                                       THEN p_fencing_token ELSE x.completed_token END,
                completed_by = CASE WHEN x.idempotency_key = p_idempotency_key
                                    THEN r.lease_owner ELSE x.completed_by END,
                completed_at = CASE WHEN x.idempotency_key = p_idempotency_key
                                    THEN v_now ELSE x.completed_at END,
                attempts = CASE WHEN x.idempotency_key = p_idempotency_key
                                THEN x.attempts ELSE x.attempts + 1 END,
                dispatched_token = CASE WHEN x.idempotency_key = p_idempotency_key
                                        THEN x.dispatched_token ELSE p_fencing_token END,
                dispatched_by = CASE WHEN x.idempotency_key = p_idempotency_key
                                     THEN x.dispatched_by ELSE r.lease_owner END,
                dispatched_at = CASE WHEN x.idempotency_key = p_idempotency_key
                                     THEN x.dispatched_at ELSE v_now END
            WHERE x.ctid = ANY (ARRAY[v_this, v_that])
              AND CASE WHEN x.idempotency_key = p_idempotency_key THEN x.status = 'dispatched'
                       WHEN x.idempotency_key = p_next_key
                       THEN x.status IN ('planned', 'dispatched')
                            AND x.approval IS DISTINCT FROM 'pending' END
            RETURNING x.idempotency_key AS key, x.tool, x.attempts)
        SELECT count(*) AS written,
               max(u.tool) FILTER (WHERE u.key = p_idempotency_key) AS tool,
               max(u.attempts) FILTER (WHERE u.key = p_idempotency_key) AS attempts,
               max(u.tool) FILTER (WHERE u.key = p_next_key) AS next_tool,
               max(u.attempts) FILTER (WHERE u.key = p_next_key) AS next_attempt
        INTO v_next FROM u;
        IF v_next.written <> 2 THEN
            -- not reached while every writer of the run's calls holds the run's lock
            PERFORM runledger._raise('RL004',
                format('calls %s and %s changed while run %s was locked', p_idempotency_key,
                       p_next_key, p_run_id),
                'a write that does not hold the run''s lock changed them', 'send the call again');
        END IF;
        IF r.stalled_claims <> 0 THEN
            UPDATE runledger.runs SET stalled_claims = 0, updated_at = v_now
            WHERE run_id = p_run_id AND lease_id = p_lease_id;
        END IF;
        -- the call's event, then the next call's call_dispatched, as below; revision 0028:
        -- both in one INSERT (runledger._events)
        v_detail := jsonb_build_object('idempotency_key', p_idempotency_key,
                                       'tool', v_next.tool, 'attempt', v_next.attempts);
        PERFORM runledger._events(p_run_id, r.lease_owner, p_fencing_token, v_now,
            CASE WHEN p_outcome = 'succeeded' THEN ARRAY['call_succeeded', 'call_dispatched']
                 ELSE ARRAY['call_failed', 'call_dispatched'] END,
            ARRAY[r.state_version, r.state_version],
            ARRAY[v_detail, jsonb_build_object('idempotency_key', p_next_key,
                                               'tool', v_next.next_tool,
                                               'attempt', v_next.next_attempt,
                                               'previous_status', v_previous)]);
        RETURN v_next.next_attempt;
    END IF;
    IF p_next_key IS NULL THEN
        UPDATE runledger.run_calls x
        SET status = CASE WHEN p_outcome = 'not_applied' THEN 'planned' ELSE p_outcome END,
            result = CASE WHEN p_outcome = 'succeeded' THEN p_result END,
            receipt = CASE WHEN p_outcome = 'not_applied' THEN NULL ELSE p_receipt END,
            error = CASE WHEN p_outcome = 'succeeded' THEN NULL ELSE p_result END,
            completed_token = CASE WHEN p_outcome = 'not_applied' THEN NULL ELSE p_fencing_token END,
            completed_by = CASE WHEN p_outcome = 'not_applied' THEN NULL ELSE r.lease_owner END,
            completed_at = CASE WHEN p_outcome = 'not_applied' THEN NULL ELSE v_now END
        WHERE x.idempotency_key = p_idempotency_key AND x.run_id IS NOT DISTINCT FROM p_run_id
          AND x.status = 'dispatched'
        RETURNING x.tool, x.attempts INTO v_tool, v_attempts;
        v_done := FOUND;
    END IF;
    IF NOT v_done THEN
        c := runledger._lock_call(p_run_id, p_idempotency_key);
        IF c.status <> 'dispatched' THEN
            PERFORM runledger._raise('RL004',
                format('call %s is %s, not dispatched', p_idempotency_key, c.status),
                NULL, 'dispatch_call must be committed before the tool runs');
        END IF;
        IF p_next_key IS NOT NULL THEN
            IF p_outcome NOT IN ('succeeded', 'failed') THEN
                PERFORM runledger._raise('RL006',
                    format('the next call is dispatched only after a final outcome, not %s', p_outcome),
                    format('call %s, next call %s', p_idempotency_key, left(p_next_key, 300)),
                    'complete the call alone; the run pauses or sends it again');
            END IF;
            IF p_next_key = p_idempotency_key THEN
                PERFORM runledger._raise('RL006',
                    format('call %s cannot be its own next call', p_idempotency_key), NULL, NULL);
            END IF;
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
        v_tool := c.tool;
        v_attempts := c.attempts;
    END IF;
    -- progress: a run claimed again counts claims without it (crash_loop). The row is
    -- written only when there is a count to reset (revision 0009): after the first write
    -- of a lease there never is, and a call's own row carries its times.
    IF r.stalled_claims <> 0 THEN
        UPDATE runledger.runs SET stalled_claims = 0, updated_at = v_now
        WHERE run_id = p_run_id AND lease_id = p_lease_id;
    END IF;
    v_detail := jsonb_build_object('idempotency_key', p_idempotency_key, 'tool', v_tool,
                                   'attempt', v_attempts);
    CASE p_outcome
        WHEN 'succeeded' THEN
            PERFORM runledger._event(p_run_id, 'call_succeeded', r.lease_owner, p_fencing_token,
                                     r.state_version, v_detail, v_now);
        WHEN 'failed' THEN
            PERFORM runledger._event(p_run_id, 'call_failed', r.lease_owner, p_fencing_token,
                                     r.state_version, v_detail, v_now);
        WHEN 'unknown' THEN
            PERFORM runledger._event(p_run_id, 'call_unknown', r.lease_owner, p_fencing_token,
                                     r.state_version, v_detail, v_now);
        WHEN 'not_applied' THEN
            PERFORM runledger._event(p_run_id, 'call_not_applied', r.lease_owner,
                                     p_fencing_token, r.state_version, v_detail, v_now);
    END CASE;
    IF p_next_key IS NULL THEN
        RETURN NULL;
    END IF;
    -- the next call is locked and checked as dispatch_call does, after this one
    RETURN runledger._dispatch(p_run_id, p_next_key, r.lease_owner, p_fencing_token,
                               r.state_version, v_now);
END
$$;

REVOKE ALL ON FUNCTION runledger._register_worker(text, text, int, text[], bigint, text),
    runledger.register_worker_v2(text, text, int, text[], boolean, text),
    runledger._sender_until(text, text, bigint, integer, timestamptz),
    runledger.call_sender(text, uuid, bigint, text),
    runledger.release_call(text, uuid, bigint, text, text, jsonb) FROM PUBLIC;
DO $roles$
BEGIN
    IF EXISTS (SELECT 1 FROM pg_roles WHERE rolname = 'runledger_worker') THEN
        GRANT EXECUTE ON FUNCTION
            runledger.register_worker_v2(text, text, int, text[], boolean, text),
            runledger.call_sender(text, uuid, bigint, text),
            runledger.release_call(text, uuid, bigint, text, text, jsonb)
        TO runledger_worker;
    ELSE
        RAISE WARNING 'runledger: role runledger_worker does not exist; grant EXECUTE on runledger.register_worker_v2, call_sender and release_call by hand';
    END IF;
END
$roles$;
