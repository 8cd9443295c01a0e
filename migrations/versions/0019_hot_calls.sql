-- runledger 0019: the per-call SQL of the worker's hot path, cheaper (issue "The hot path").
-- The same signatures, results, errors, rows and events: _lock_leased_run_at (new) returns
-- the clock reading of the lease check, which its callers use instead of reading the clock
-- again; a call's dispatch and completion are one UPDATE ... RETURNING (the lock and the
-- checks of _lock_call only to refuse); the JSON checks skip what cannot fail.
-- Frozen once merged: change things in a new revision (and in the living files).


-- Revision 0019: the lease check and the clock reading it made after the lock, for the
-- callers that use the time as well: one reading per transaction instead of a second
-- runledger.now() right after it (the same semantics: the clock is read once the row lock
-- is held). _lock_leased_run is this function's run row.
CREATE FUNCTION runledger._lock_leased_run_at(p_run_id text, p_lease_id uuid,
                                              p_fencing_token bigint,
                                              OUT r runledger.runs, OUT at timestamptz)
LANGUAGE plpgsql
AS $$
BEGIN
    -- _lock_run, inline (revision 0007): one indexed SELECT ... FOR NO KEY UPDATE
    SELECT * INTO r FROM runledger.runs x WHERE x.run_id = p_run_id FOR NO KEY UPDATE;
    IF NOT FOUND THEN
        PERFORM runledger._check_run_id(p_run_id);
        PERFORM runledger._raise('RL003', format('run %s not found', p_run_id), NULL, NULL);
    END IF;
    -- The clock is read once the row lock is held: a write that waited on the lock past
    -- the lease's expiry is refused. runledger.now() is VOLATILE, so under READ COMMITTED
    -- its query takes a new snapshot and sees a clock_offset committed during the wait.
    at := runledger.now();
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
    IF r.lease_expires_at <= at THEN
        PERFORM runledger._raise('RL001',
            format('lease expired on run %s: token %s', p_run_id, p_fencing_token),
            format('run %s is %s; seen lease %s token %s; current lease %s token %s held by %s '
                   'expired at %s, database clock is %s',
                   p_run_id, r.status, p_lease_id, p_fencing_token, r.lease_id, r.fencing_token,
                   coalesce(r.lease_owner, 'nobody'), r.lease_expires_at, at),
            'renew leases more often than the lease length; the run will be claimed again');
    END IF;
    -- Revision 0010: a lease is good only on the timeline that granted it. After a
    -- promotion its token is at most the new timeline's floor (claims grant more), even
    -- before a claim has recorded the failover and ended the old leases.
    IF p_fencing_token <= runledger._token_floor() THEN
        PERFORM runledger._raise('RL001',
            format('lease lost on run %s: token %s was granted before a failover', p_run_id,
                   p_fencing_token),
            format('the server is on timeline %s; leases of this timeline have tokens over %s',
                   runledger._timeline(), runledger._token_floor()),
            'the database was promoted: drop the run, it will be claimed again');
    END IF;
END
$$;

REVOKE ALL ON FUNCTION runledger._lock_leased_run_at(text, uuid, bigint) FROM PUBLIC;

-- Lock the run row, then check that (lease_id, fencing_token) is its current,
-- unexpired lease by the database clock read after the lock. Every worker write starts
-- here. Since revision 0019 the run row of _lock_leased_run_at (one body for both).
CREATE OR REPLACE FUNCTION runledger._lock_leased_run(p_run_id text, p_lease_id uuid, p_fencing_token bigint)
RETURNS runledger.runs
LANGUAGE sql
AS $$
    SELECT (runledger._lock_leased_run_at(p_run_id, p_lease_id, p_fencing_token)).r
$$;

-- JSON arguments: four named checks instead of two bare booleans. Each one refuses what
-- its name excludes (null, a non-object), then a payload over settings.max_payload_bytes,
-- then one nested deeper than settings.max_json_depth. p_wrap: levels of the contract's
-- own structure around the values a caller nests (record_turn's array and call objects
-- around each call's args: 2), allowed on top of the limit.
CREATE OR REPLACE FUNCTION runledger._check_json_value_or_null(p_what text, p_value jsonb,
                                                    p_wrap integer DEFAULT 0) RETURNS void
LANGUAGE plpgsql STABLE
AS $$
DECLARE
    v_cap integer;
    v_depth integer;
    v_size integer;
    v_text text;
BEGIN
    IF p_value IS NULL THEN
        RETURN;
    END IF;
    SELECT s.max_payload_bytes, s.max_json_depth INTO v_cap, v_depth FROM runledger.settings s;
    v_text := p_value::text;
    v_size := octet_length(v_text);
    IF v_size > coalesce(v_cap, 1048576) THEN
        PERFORM runledger._raise('RL006',
            format('%s is %s bytes, over the cap of %s bytes', p_what, v_size, v_cap),
            NULL, 'the cap is runledger.settings.max_payload_bytes');
    END IF;
    v_depth := coalesce(v_depth, 64) + p_wrap;
    -- A value deeper than v_depth has a container at level v_depth inside v_depth others:
    -- at least 2 * (v_depth + 1) characters of brackets. A shorter text cannot be too deep,
    -- so the walk is skipped (revision 0007); the result is the same. Revision 0019: nor
    -- can a text with at most v_depth opening brackets ('{' and '[', in strings too: one
    -- for each object and array and maybe more), which the walk would cost far more to
    -- find.
    IF v_size >= 2 * (v_depth + 1)
       AND v_size - octet_length(translate(v_text, '{[', '')) > v_depth THEN
        PERFORM runledger._check_json_depth(p_what, p_value, v_depth);
    END IF;
END
$$;

-- The dispatch of one call of a locked, leased run (revision 0009), the one place it is
-- written: dispatch_call, complete_call_v2 (the next call) and record_turn_v4 (the first
-- calls of a decision) call it after their lease check, with the clock they read after the
-- lock. It refuses a call that cannot be sent (final, unknown, awaiting approval), marks
-- it dispatched under the token and writes its call_dispatched event. Returns the attempt
-- number.
-- Revision 0019: one UPDATE ... RETURNING instead of SELECT ... FOR UPDATE and an UPDATE
-- of the same row (the lock was one more heap write and WAL record). The self-join reads
-- the status before the update (the event's previous_status): the row read is the row
-- updated, since every writer of a run's calls holds the run's row lock first (leased
-- writes, claims' failover marking, the operator functions via _lock_run), and the caller
-- holds it. Only when no row matched does the slow path lock and read the call, to refuse
-- it with the exact error as before (a key that is invalid or of another run matches none).
-- The run is compared with IS NOT DISTINCT FROM (run_id is NOT NULL: the same test) so
-- that it is a filter: the row is found by its key's unique index, as _lock_call finds
-- it, never by a scan of the run's calls through the primary key.
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
BEGIN
    UPDATE runledger.run_calls x
    SET status = 'dispatched', attempts = x.attempts + 1, dispatched_token = p_fencing_token,
        dispatched_by = p_owner, dispatched_at = p_now
    FROM runledger.run_calls o
    WHERE x.idempotency_key = p_key AND o.idempotency_key = p_key
      AND x.run_id IS NOT DISTINCT FROM p_run_id
      AND x.status IN ('planned', 'dispatched') AND x.approval IS DISTINCT FROM 'pending'
    RETURNING x.tool, x.attempts, o.status INTO v_tool, v_attempt, v_previous;
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
    END IF;
    PERFORM runledger._event(p_run_id, 'call_dispatched', p_owner, p_fencing_token,
        p_state_version, jsonb_build_object('idempotency_key', p_key, 'tool', v_tool,
                                            'attempt', v_attempt,
                                            'previous_status', v_previous), p_now);
    RETURN v_attempt;
END
$$;

CREATE OR REPLACE FUNCTION runledger.checkpoint(p_run_id text, p_lease_id uuid, p_fencing_token bigint,
                                     p_expected_version bigint, p_state jsonb)
RETURNS bigint
LANGUAGE plpgsql SECURITY DEFINER
SET search_path = pg_catalog, runledger, pg_temp
AS $$
DECLARE
    v_lock record;
    r runledger.runs;
    v_now timestamptz;
BEGIN
    -- the clock the lease check read after the lock (revision 0019)
    v_lock := runledger._lock_leased_run_at(p_run_id, p_lease_id, p_fencing_token);
    r := v_lock.r;
    v_now := v_lock.at;
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
        updated_at = v_now
    WHERE run_id = p_run_id AND state_version = r.state_version AND lease_id = p_lease_id;
    PERFORM runledger._event(p_run_id, 'checkpoint', r.lease_owner, p_fencing_token,
                             r.state_version + 1, '{}'::jsonb, v_now);
    RETURN r.state_version + 1;
END
$$;

CREATE OR REPLACE FUNCTION runledger.dispatch_call(p_run_id text, p_lease_id uuid, p_fencing_token bigint,
                                        p_idempotency_key text)
RETURNS int
LANGUAGE plpgsql SECURITY DEFINER
SET search_path = pg_catalog, runledger, pg_temp
AS $$
DECLARE
    v_lock record;
BEGIN
    -- the clock the lease check read after the lock (revision 0019)
    v_lock := runledger._lock_leased_run_at(p_run_id, p_lease_id, p_fencing_token);
    RETURN runledger._dispatch(p_run_id, p_idempotency_key, (v_lock.r).lease_owner,
                               p_fencing_token, (v_lock.r).state_version, v_lock.at);
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
    v_lock record;
    r runledger.runs;
    c runledger.run_calls;
    v_now timestamptz;
    v_detail jsonb;
    v_tool text;
    v_attempts integer;
BEGIN
    -- the clock the lease check read after the lock (revision 0019)
    v_lock := runledger._lock_leased_run_at(p_run_id, p_lease_id, p_fencing_token);
    r := v_lock.r;
    v_now := v_lock.at;
    -- not_applied: the effect certainly did not happen and the call will be sent again
    -- with the same key; it goes back to planned, so no one mistakes it for in flight.
    -- The checks' common cases inline, as complete_call_v2 (revision 0019).
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
    -- UPDATE and an UPDATE of the same row, as complete_call_v2 (which says why it
    -- is safe); the checks of _lock_call only when no row matched, to refuse.
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
    IF NOT FOUND THEN
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
END
$$;

-- complete_call_v2 (revision 0008): complete_call, and with p_next_key the dispatch of the
-- next call in the same transaction (what dispatch_call does, with its checks), for calls
-- that run one after another: the result of one is committed before the next is sent, in
-- one commit instead of two. The next call is dispatched only after a final outcome
-- (succeeded or failed). Returns the next call's attempt number, or NULL without one.
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
    IF p_next_key IS NULL
       OR (p_outcome IN ('succeeded', 'failed') AND p_next_key <> p_idempotency_key) THEN
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

-- complete_calls (revision 0018): the results of several calls of one run in one
-- transaction -- group commit of a parallel group's results that are ready together --
-- and, with p_next_key, the dispatch of the next call, as complete_call_v2 does (then
-- every outcome must be final). p_keys, p_outcomes, p_results and p_receipts are parallel
-- one-dimensional arrays of 1 to 100 calls, each key once. Each call is checked and
-- refused as complete_call_v2 checks its one call, in the arrays' order, and a refusal
-- leaves nothing of the batch written. One run lock, one clock reading, one UPDATE of the
-- calls; each call's event as complete_call writes it, in the arrays' order, then the next
-- call's call_dispatched. Returns the next call's attempt number, or NULL without one.
CREATE OR REPLACE FUNCTION runledger.complete_calls(p_run_id text, p_lease_id uuid, p_fencing_token bigint,
                                         p_keys text[], p_outcomes text[], p_results jsonb[],
                                         p_receipts jsonb[], p_next_key text DEFAULT NULL)
RETURNS int
LANGUAGE plpgsql SECURITY DEFINER
SET search_path = pg_catalog, runledger, pg_temp
AS $$
DECLARE
    v_lock record;
    r runledger.runs;
    c runledger.run_calls;
    v_now timestamptz;
    v_n integer := coalesce(cardinality(p_keys), 0);
    v_i integer;
    v_outcome text;
    v_tools text[] := '{}';
    v_attempts integer[] := '{}';
    v_detail jsonb;
BEGIN
    -- the clock the lease check read after the lock (revision 0019)
    v_lock := runledger._lock_leased_run_at(p_run_id, p_lease_id, p_fencing_token);
    r := v_lock.r;
    v_now := v_lock.at;
    IF v_n < 1 OR v_n > 100 OR array_ndims(p_keys) <> 1 OR array_lower(p_keys, 1) <> 1 THEN
        PERFORM runledger._raise('RL006', 'complete_calls takes 1 to 100 calls',
            format('got %s key(s) in %s dimension(s)', v_n,
                   coalesce(array_ndims(p_keys)::text, 'no')),
            'pass one-dimensional arrays, one element per call');
    END IF;
    IF array_ndims(p_outcomes) IS DISTINCT FROM 1 OR array_ndims(p_results) IS DISTINCT FROM 1
       OR array_ndims(p_receipts) IS DISTINCT FROM 1
       OR array_lower(p_outcomes, 1) <> 1 OR array_lower(p_results, 1) <> 1
       OR array_lower(p_receipts, 1) <> 1
       OR cardinality(p_outcomes) <> v_n OR cardinality(p_results) <> v_n
       OR cardinality(p_receipts) <> v_n THEN
        PERFORM runledger._raise('RL006',
            'keys, outcomes, results and receipts must be arrays of one length',
            format('%s key(s), %s outcome(s), %s result(s), %s receipt(s)', v_n,
                   coalesce(cardinality(p_outcomes)::text, 'NULL'),
                   coalesce(cardinality(p_results)::text, 'NULL'),
                   coalesce(cardinality(p_receipts)::text, 'NULL')),
            'one element per call; a result or receipt may be a NULL element');
    END IF;
    FOR v_i IN 1 .. v_n LOOP
        v_outcome := p_outcomes[v_i];
        -- not_applied: the call goes back to planned and is sent again with the same key
        IF v_outcome IS NULL
           OR v_outcome NOT IN ('succeeded', 'failed', 'unknown', 'not_applied') THEN
            PERFORM runledger._check_word('outcome', v_outcome,
                                          ARRAY['succeeded', 'failed', 'unknown', 'not_applied']);
        END IF;
        -- as complete_call_v2 (revision 0019): a check helper runs only with a value
        IF p_results[v_i] IS NOT NULL THEN
            PERFORM runledger._check_json_value_or_null('result', p_results[v_i]);
        END IF;
        IF p_receipts[v_i] IS NOT NULL THEN
            PERFORM runledger._check_json_object_or_null('receipt', p_receipts[v_i]);
        END IF;
        IF p_keys[v_i] = ANY (p_keys[1:v_i - 1]) THEN
            PERFORM runledger._raise('RL006',
                format('call %s appears twice in one completion', p_keys[v_i]), NULL,
                'complete a call once');
        END IF;
        c := runledger._lock_call(p_run_id, p_keys[v_i]);
        IF c.status <> 'dispatched' THEN
            PERFORM runledger._raise('RL004',
                format('call %s is %s, not dispatched', p_keys[v_i], c.status),
                NULL, 'dispatch_call must be committed before the tool runs');
        END IF;
        IF p_next_key IS NOT NULL AND v_outcome NOT IN ('succeeded', 'failed') THEN
            PERFORM runledger._raise('RL006',
                format('the next call is dispatched only after a final outcome, not %s', v_outcome),
                format('call %s, next call %s', p_keys[v_i], left(p_next_key, 300)),
                'complete the call alone; the run pauses or sends it again');
        END IF;
        IF p_next_key = p_keys[v_i] THEN
            PERFORM runledger._raise('RL006',
                format('call %s cannot be its own next call', p_keys[v_i]), NULL, NULL);
        END IF;
        v_tools := v_tools || c.tool;
        v_attempts := v_attempts || c.attempts;
    END LOOP;

    UPDATE runledger.run_calls x
    SET status = CASE WHEN u.o = 'not_applied' THEN 'planned' ELSE u.o END,
        result = CASE WHEN u.o = 'succeeded' THEN u.res END,
        receipt = CASE WHEN u.o = 'not_applied' THEN NULL ELSE u.rec END,
        error = CASE WHEN u.o = 'succeeded' THEN NULL ELSE u.res END,
        completed_token = CASE WHEN u.o = 'not_applied' THEN NULL ELSE p_fencing_token END,
        completed_by = CASE WHEN u.o = 'not_applied' THEN NULL ELSE r.lease_owner END,
        completed_at = CASE WHEN u.o = 'not_applied' THEN NULL ELSE v_now END
    FROM unnest(p_keys, p_outcomes, p_results, p_receipts) AS u(k, o, res, rec)
    WHERE x.idempotency_key = u.k AND x.status = 'dispatched';
    -- progress, as complete_call_v2: the run row only when there is a count to reset
    IF r.stalled_claims <> 0 THEN
        UPDATE runledger.runs SET stalled_claims = 0, updated_at = v_now
        WHERE run_id = p_run_id AND lease_id = p_lease_id;
    END IF;
    FOR v_i IN 1 .. v_n LOOP
        v_detail := jsonb_build_object('idempotency_key', p_keys[v_i], 'tool', v_tools[v_i],
                                       'attempt', v_attempts[v_i]);
        CASE p_outcomes[v_i]
            WHEN 'succeeded' THEN
                PERFORM runledger._event(p_run_id, 'call_succeeded', r.lease_owner,
                                         p_fencing_token, r.state_version, v_detail, v_now);
            WHEN 'failed' THEN
                PERFORM runledger._event(p_run_id, 'call_failed', r.lease_owner,
                                         p_fencing_token, r.state_version, v_detail, v_now);
            WHEN 'unknown' THEN
                PERFORM runledger._event(p_run_id, 'call_unknown', r.lease_owner,
                                         p_fencing_token, r.state_version, v_detail, v_now);
            WHEN 'not_applied' THEN
                PERFORM runledger._event(p_run_id, 'call_not_applied', r.lease_owner,
                                         p_fencing_token, r.state_version, v_detail, v_now);
        END CASE;
    END LOOP;
    IF p_next_key IS NULL THEN
        RETURN NULL;
    END IF;
    -- the next call is locked and checked as dispatch_call does, after these
    RETURN runledger._dispatch(p_run_id, p_next_key, r.lease_owner, p_fencing_token,
                               r.state_version, v_now);
END
$$;

CREATE OR REPLACE FUNCTION runledger.finish_run(p_run_id text, p_lease_id uuid, p_fencing_token bigint,
                                     p_status text, p_result jsonb, p_reason text)
RETURNS void
LANGUAGE plpgsql SECURITY DEFINER
SET search_path = pg_catalog, runledger, pg_temp
AS $$
DECLARE
    v_lock record;
    r runledger.runs;
    v_now timestamptz;
    v_open integer;
    v_detail jsonb;
BEGIN
    -- the clock the lease check read after the lock (revision 0019)
    v_lock := runledger._lock_leased_run_at(p_run_id, p_lease_id, p_fencing_token);
    r := v_lock.r;
    v_now := v_lock.at;
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
                                     r.state_version, v_detail, v_now);
        WHEN 'failed' THEN
            PERFORM runledger._event(p_run_id, 'run_failed', r.lease_owner, p_fencing_token,
                                     r.state_version, v_detail, v_now);
        WHEN 'paused' THEN
            PERFORM runledger._event(p_run_id, 'run_paused', r.lease_owner, p_fencing_token,
                                     r.state_version, v_detail, v_now);
    END CASE;
END
$$;
