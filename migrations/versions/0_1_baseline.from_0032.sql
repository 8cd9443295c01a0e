-- From revision 0032 (runledger at 4b19f01) to the baseline 0.1: the same schema but for
-- the function versions that no caller of 0.1 uses, and the text of the functions whose
-- comments changed. migrations/env.py runs it in one transaction with the stamp of the
-- version table, under the migration lock. tests/migrations/make_baseline.py wrote it.
DROP FUNCTION runledger.claim_runs(text, text[], interval, int);
DROP FUNCTION runledger.claim_runs_v2(text, text[], interval, int);
DROP FUNCTION runledger.claim_runs_v3(text, text[], interval, int);
DROP FUNCTION runledger.record_turn(text, uuid, bigint, int, jsonb);
DROP FUNCTION runledger.record_turn_v2(text, uuid, bigint, int, jsonb, jsonb, jsonb);
DROP FUNCTION runledger.record_turn_v3(text, uuid, bigint, int, jsonb, jsonb, jsonb, bigint, jsonb, boolean);
DROP FUNCTION runledger.register_worker(text, text, int, text[]);

CREATE OR REPLACE FUNCTION runledger._check_json_value_or_null(p_what text, p_value jsonb,
                                                    p_wrap integer DEFAULT 0) RETURNS void
LANGUAGE plpgsql STABLE
AS $$
DECLARE
    v_cap integer;
    v_depth integer;
    v_size integer;
    v_text text;
    v_open integer;
BEGIN
    IF p_value IS NULL THEN
        RETURN;
    END IF;
    v_text := p_value::text;
    v_size := octet_length(v_text);
    v_open := v_size - octet_length(translate(v_text, '{[', ''));
    -- A value that no setting allowed by the settings' CHECKs can refuse
    -- (under 1024 bytes, the least max_payload_bytes; at most 1 + p_wrap opening brackets,
    -- the least depth: max_json_depth >= 1) needs no read of the settings.
    IF v_size < 1024 AND v_open <= 1 + p_wrap THEN
        RETURN;
    END IF;
    SELECT s.max_payload_bytes, s.max_json_depth INTO v_cap, v_depth FROM runledger.settings s;
    IF v_size > coalesce(v_cap, 1048576) THEN
        PERFORM runledger._raise('RL006',
            format('%s is %s bytes, over the cap of %s bytes', p_what, v_size, v_cap),
            NULL, 'the cap is runledger.settings.max_payload_bytes');
    END IF;
    v_depth := coalesce(v_depth, 64) + p_wrap;
    -- A value deeper than v_depth has a container at level v_depth inside v_depth others:
    -- at least 2 * (v_depth + 1) characters of brackets. A shorter text cannot be too deep,
    -- so the walk is skipped; the result is the same. Nor can a text with
    -- at most v_depth opening brackets ('{' and '[', in strings too: one
    -- for each object and array and maybe more), which the walk would cost far more to
    -- find.
    IF v_size >= 2 * (v_depth + 1) AND v_open > v_depth THEN
        PERFORM runledger._check_json_depth(p_what, p_value, v_depth);
    END IF;
END
$$;

CREATE OR REPLACE FUNCTION runledger._event(p_run_id text, p_kind text, p_actor text,
                                 p_fencing_token bigint, p_state_version bigint,
                                 p_detail jsonb, p_at timestamptz DEFAULT NULL) RETURNS void
LANGUAGE plpgsql
AS $$
DECLARE
    v_id bigint;
    v_at timestamptz := coalesce(p_at, runledger.now());
    v_detail jsonb := coalesce(p_detail, '{}'::jsonb);
    v_previous bytea;
BEGIN
    SELECT e.hash INTO v_previous FROM runledger.run_events e
    WHERE e.run_id = p_run_id ORDER BY e.event_id DESC LIMIT 1;
    -- The SELECT above needs a snapshot newer than the run's lock, which
    -- only READ COMMITTED (and READ UNCOMMITTED, the same in PostgreSQL) takes. Under
    -- REPEATABLE READ or SERIALIZABLE it reads the transaction's first snapshot: an event
    -- committed since is not seen, and the new one would chain to the same event as it (a
    -- fork). So a run's chain is extended only in READ COMMITTED; its first event (a
    -- submit inside the caller's own transaction) is written under any isolation.
    IF FOUND AND pg_catalog.current_setting('transaction_isolation')
                 IN ('repeatable read', 'serializable') THEN
        PERFORM runledger._refuse_event_isolation(p_run_id);
    END IF;
    INSERT INTO runledger.run_events (event_id, run_id, at, kind, actor, fencing_token,
                                      state_version, detail, hash)
    SELECT n.id, p_run_id, v_at, p_kind, p_actor, p_fencing_token, p_state_version,
           v_detail,
           runledger._event_hash(v_previous, n.id, p_run_id, v_at, p_kind, p_actor,
                                 p_fencing_token, p_state_version, v_detail)
    FROM (SELECT pg_catalog.nextval('runledger.run_events_event_id_seq'::regclass) AS id) n
    RETURNING event_id INTO v_id;
    IF p_kind NOT IN ('call_dispatched', 'call_succeeded', 'call_failed', 'call_not_applied',
                      'turn_recorded', 'checkpoint', 'claimed') THEN
        PERFORM pg_notify('runledger_events', v_id || ' ' || p_run_id || ' ' || p_kind);
    END IF;
END
$$;

CREATE OR REPLACE FUNCTION runledger._events(p_run_id text, p_actor text, p_fencing_token bigint,
                                  p_at timestamptz, p_kinds text[],
                                  p_state_versions bigint[], p_details jsonb[])
RETURNS void
LANGUAGE plpgsql
AS $$
DECLARE
    v_at timestamptz := coalesce(p_at, runledger.now());
    v_previous bytea;
    v_payloads text[];
BEGIN
    IF cardinality(p_state_versions) IS DISTINCT FROM cardinality(p_kinds)
       OR cardinality(p_details) IS DISTINCT FROM cardinality(p_kinds) THEN
        RAISE EXCEPTION 'runledger._events: % kinds, % state versions, % details',
            cardinality(p_kinds), cardinality(p_state_versions), cardinality(p_details)
            USING ERRCODE = 'XX000';
    END IF;
    SELECT e.hash INTO v_previous FROM runledger.run_events e
    WHERE e.run_id = p_run_id ORDER BY e.event_id DESC LIMIT 1;
    -- as _event, for each event after the first
    IF (FOUND OR cardinality(p_kinds) > 1)
       AND pg_catalog.current_setting('transaction_isolation')
           IN ('repeatable read', 'serializable') THEN
        PERFORM runledger._refuse_event_isolation(p_run_id);
    END IF;
    WITH ins AS (
        INSERT INTO runledger.run_events (event_id, run_id, at, kind, actor, fencing_token,
                                          state_version, detail, hash)
        SELECT r.event_id, p_run_id, v_at, r.kind, p_actor, p_fencing_token,
               r.state_version, r.detail, r.hash
        FROM runledger._event_rows(v_previous, p_run_id, p_actor, p_fencing_token, v_at,
                                   p_kinds, p_state_versions, p_details) AS r
        RETURNING run_events.event_id, run_events.kind)
    SELECT array_agg(ins.event_id || ' ' || p_run_id || ' ' || ins.kind ORDER BY ins.event_id)
           FILTER (WHERE ins.kind NOT IN ('call_dispatched', 'call_succeeded', 'call_failed',
                                          'call_not_applied', 'turn_recorded', 'checkpoint',
                                          'claimed'))
    INTO v_payloads FROM ins;
    FOR i IN 1 .. coalesce(cardinality(v_payloads), 0) LOOP
        PERFORM pg_notify('runledger_events', v_payloads[i]);
    END LOOP;
END
$$;

CREATE OR REPLACE FUNCTION runledger._lock_run(p_run_id text) RETURNS runledger.runs
LANGUAGE plpgsql
AS $$
DECLARE
    r runledger.runs;
BEGIN
    -- The id is checked only when no row matched: every stored run_id
    -- passes the same rule (ck_runs_run_id), so a row found means a valid id, and an
    -- invalid one (NULL too) matches no row and waits on no lock. RL006 still comes before
    -- RL003, as before.
    SELECT * INTO r FROM runledger.runs x WHERE x.run_id = p_run_id FOR NO KEY UPDATE;
    IF NOT FOUND THEN
        PERFORM runledger._check_run_id(p_run_id);
        PERFORM runledger._raise('RL003', format('run %s not found', p_run_id), NULL, NULL);
    END IF;
    RETURN r;
END
$$;

CREATE OR REPLACE FUNCTION runledger._lock_leased_run_at(p_run_id text, p_lease_id uuid,
                                              p_fencing_token bigint,
                                              OUT r runledger.runs, OUT at timestamptz)
LANGUAGE plpgsql
AS $$
BEGIN
    -- _lock_run, inline: one indexed SELECT ... FOR NO KEY UPDATE
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
    -- A lease is good only on the timeline that granted it. After a
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

CREATE OR REPLACE FUNCTION runledger._lock_call(p_run_id text, p_key text) RETURNS runledger.run_calls
LANGUAGE plpgsql
AS $$
DECLARE
    c runledger.run_calls;
BEGIN
    -- _check_text's rule, tested here first so that a valid key costs no call
    IF p_key IS NULL OR length(p_key) < 1 OR length(p_key) > runledger._cap('idempotency_key') THEN
        PERFORM runledger._check_text('idempotency key', p_key, 1,
                                      runledger._cap('idempotency_key'));
    END IF;
    SELECT * INTO c FROM runledger.run_calls x WHERE x.idempotency_key = p_key FOR UPDATE;
    IF NOT FOUND OR c.run_id <> p_run_id THEN
        PERFORM runledger._raise('RL003',
            format('call %s not found in run %s', p_key, p_run_id), NULL, NULL);
    END IF;
    RETURN c;
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
        -- that passes the checks matched the UPDATE): the write, after the lock
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
    -- A call an earlier holder sent, with no answer journaled, is sent
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
        -- Not taken over at once. The holder, cut off with the old primary,
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

CREATE OR REPLACE FUNCTION runledger._claim(p_worker_id text, p_flows text[], p_lease interval,
                                  p_max_runs int, p_read boolean)
RETURNS TABLE (run_id text, flow text, flow_version text, input jsonb, state jsonb,
               state_version bigint, fencing_token bigint, lease_id uuid,
               lease_expires_at timestamptz, takeover boolean, stalled_claims integer,
               turns json, calls json, failover_turn integer, traceparent text)
LANGUAGE plpgsql
AS $$
#variable_conflict use_column
DECLARE
    v_now timestamptz := runledger.now();
    v_flows record;
    v_claim record;
    v_timeline integer;
    v_floor bigint;
    -- session locks: the claimer's listener-session lock, stamped on each
    -- run it claims; the locks of holder sessions that ended (their runs are taken over
    -- before their leases expire)
    v_lock bigint;
    v_gone bigint[] := '{}';
    -- the planner settings of the claim statement, restored after it
    v_plan_cache_mode text := pg_catalog.current_setting('plan_cache_mode');
    v_jit text := pg_catalog.current_setting('jit');
    v_seqscan text := pg_catalog.current_setting('enable_seqscan');
    v_bitmapscan text := pg_catalog.current_setting('enable_bitmapscan');
    v_set text;
BEGIN
    PERFORM runledger._check_worker_id(p_worker_id);
    PERFORM runledger._check_lease(p_lease);
    IF p_max_runs IS NULL OR p_max_runs < 0 OR p_max_runs > 10000 THEN
        PERFORM runledger._raise('RL006', 'max runs must be 0-10000', NULL, NULL);
    END IF;
    v_flows := runledger._parse_flows(p_flows);
    -- failover: the token floor of this timeline, once it is recorded
    v_timeline := runledger._timeline();
    v_floor := (v_timeline - 1)::bigint << 32;  -- runledger._token_floor()
    IF (SELECT t.timeline FROM runledger.timelines t ORDER BY t.position DESC LIMIT 1)
       IS DISTINCT FROM v_timeline THEN
        PERFORM runledger._note_timeline(p_worker_id, v_now);
    END IF;
    -- session locks
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
    -- The statement is planned once per session, not at every call. With
    -- its parameters known (the clock, the limits, the gone sessions' keys) the planner's
    -- estimate of a custom plan always beats that of the generic one, so the plan cache
    -- planned it anew each time: ~0.9 ms of planning for ~0.3 ms of work. The generic
    -- plan has the same shape (index-ordered scans, rows fetched by key), so the cost stays
    -- flat with the backlog (bench/claim_scaling.py). Without JIT: not knowing the limits,
    -- the generic plan's estimate passes jit_above_cost from about a million queued runs
    -- on, and compiling it would cost ~70 ms a claim for well under a millisecond of work.
    -- Set for the transaction (the function's own SET clause is the search path alone, as
    -- every contract function's) and put back after the loop; an error undoes it anyway.
    -- And planned without sequential or bitmap scans. A generic plan is
    -- built from the statistics of the moment: a backlog submitted in one burst and
    -- claimed before autovacuum has analyzed runs got a plan that read the candidates
    -- through a bitmap of every claimable row, filtered by id (every queued run read at
    -- each claim, 33 ms at 20,000, until the next analyze). Without those two, the
    -- candidates are fetched by primary key and each scan above through its index,
    -- whatever the statistics say (tests/contract/test_claim_plan.py). For that, the
    -- candidates and the UPDATE state the claimable condition as a CASE on status, which
    -- the planner cannot match to the partial indexes' predicates: an OR of the same
    -- conditions let it read the candidates through a whole partial index (every queued
    -- run) when it took that index for small. Only the primary key is left to them.
    v_set := pg_catalog.set_config('plan_cache_mode', 'force_generic_plan', true);
    v_set := pg_catalog.set_config('jit', 'off', true);
    v_set := pg_catalog.set_config('enable_seqscan', 'off', true);
    v_set := pg_catalog.set_config('enable_bitmapscan', 'off', true);
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
        -- The flow is compared through an expression (c.flow || ''), which
        -- no index has: this scan can only go through ix_runs_lease_expiry (and orphaned
        -- below through ix_runs_lease_lock). With the plain columns, a generic plan built
        -- without statistics (a burst claimed before autovacuum's analyze) went through
        -- ix_runs_claimable by flow and filtered every queued row of the flow for a
        -- running one: 100,000 rows read per claim at 100,000 queued, 1.1 s at a million.
        SELECT c.run_id FROM runledger.runs c
        JOIN pinned p ON p.name = (c.flow || '') AND p.version = (c.flow_version || '')
        WHERE c.status = 'running' AND c.lease_expires_at <= v_now
        ORDER BY c.lease_expires_at
        LIMIT p_max_runs * 4 + 32
    ), orphaned AS (  -- session locks: the holder's session ended
        SELECT c.run_id FROM runledger.runs c
        JOIN pinned p ON p.name = (c.flow || '') AND p.version = (c.flow_version || '')
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
          -- the claimable condition as a CASE: see above
          AND CASE c.status WHEN 'queued' THEN c.available_at <= v_now
                              WHEN 'running' THEN c.lease_expires_at <= v_now
                                                  OR c.lease_lock = ANY (v_gone)
                              ELSE false END
        ORDER BY c.priority DESC, c.created_at, c.run_id
        LIMIT p_max_runs
        FOR NO KEY UPDATE OF c SKIP LOCKED
    ), claimed AS (
        UPDATE runledger.runs r
        SET status = 'running',
            fencing_token = greatest(r.fencing_token + 1, v_floor + 1),  -- failover floor
            lease_id = gen_random_uuid(),
            lease_owner = p_worker_id,
            lease_expires_at = v_now + p_lease,
            claims = r.claims + 1,
            stalled_claims = r.stalled_claims + 1,
            updated_at = v_now,
            lease_lock = v_lock  -- session locks
        FROM candidates c
        WHERE r.run_id = c.run_id
          -- the claimable condition as a CASE: see above
          AND CASE r.status WHEN 'queued' THEN r.available_at <= v_now
                              WHEN 'running' THEN r.lease_expires_at <= v_now
                                                  OR r.lease_lock = ANY (v_gone)
                              ELSE false END
        RETURNING r.run_id, r.flow, r.flow_version, r.input, r.state, r.state_version,
                  r.fencing_token, r.lease_id, r.lease_expires_at,
                  (c.old_status = 'running') AS takeover, c.old_owner, c.old_token,
                  c.old_expires_at, r.stalled_claims, r.traceparent
    )
    -- the worker's per-run read (p_read): the claim writes no
    -- turn, call or failover row, so the statement's own snapshot has them as they are
    SELECT k.run_id, k.flow, k.flow_version, k.input, k.state, k.state_version,
           k.fencing_token, k.lease_id, k.lease_expires_at, k.takeover, k.old_owner, k.old_token,
           k.old_expires_at, k.stalled_claims, k.traceparent,
           CASE WHEN p_read AND k.stalled_claims <= 1 THEN (
               SELECT coalesce(json_agg(json_build_object('turn', t.turn, 'calls', t.calls,
                                                          'record', t.record,
                                                          'output', t.output)
                                        ORDER BY t.turn), '[]'::json)
               FROM runledger.run_turns t WHERE t.run_id = k.run_id) END AS turns,
           CASE WHEN p_read AND k.stalled_claims <= 1 THEN (
               SELECT coalesce(json_agg(c ORDER BY c.turn, c.position), '[]'::json)
               FROM runledger.run_calls c WHERE c.run_id = k.run_id) END AS calls,
           CASE WHEN p_read THEN (SELECT min(f.turn) FROM runledger.failover_runs f
                                  WHERE f.run_id = k.run_id) END AS failover_turn
    FROM claimed k
    LOOP
        IF v_claim.takeover THEN
            -- holder: why the run could be taken, 'expired' or
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
        stalled_claims := v_claim.stalled_claims;
        turns := v_claim.turns;
        calls := v_claim.calls;
        failover_turn := v_claim.failover_turn;
        traceparent := v_claim.traceparent;
        RETURN NEXT;
    END LOOP;
    v_set := pg_catalog.set_config('plan_cache_mode', v_plan_cache_mode, true);
    v_set := pg_catalog.set_config('jit', v_jit, true);
    v_set := pg_catalog.set_config('enable_seqscan', v_seqscan, true);
    v_set := pg_catalog.set_config('enable_bitmapscan', v_bitmapscan, true);
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
    -- a lease of an earlier timeline is not renewed (its writes are refused)
    v_floor bigint := runledger._token_floor();
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
        -- lock in a fixed order so two renewals never wait on each other in a cycle.
        -- Every running run asked for, not only those it renews: a lease
        -- that failed gets its renewal_failed event below, and a run's events are appended
        -- under its row lock (runledger._event). All in one pass and one order: two stale
        -- workers whose runs were taken over by each other would wait on each other if the
        -- failed ones were locked one by one in the loop. Each row as it is once locked.
        SELECT l.run_id, l.lease_id, l.lease_owner, l.status
        FROM runledger.runs l JOIN wanted w ON w.run_id = l.run_id
        WHERE l.status = 'running'
        ORDER BY l.run_id
        FOR NO KEY UPDATE OF l
    ), renewed AS (
        UPDATE runledger.runs r
        SET lease_expires_at = v_now + p_lease
        FROM locked k JOIN wanted w ON w.run_id = k.run_id
        WHERE r.run_id = k.run_id AND r.lease_id = w.lease_id AND r.lease_owner = p_worker_id
          AND r.status = 'running' AND r.lease_expires_at > v_now AND r.fencing_token > v_floor
        RETURNING r.run_id, r.lease_expires_at
    )
    SELECT n.run_id, n.lease_expires_at, true AS renewed, NULL::uuid AS lease_id,
           NULL::uuid AS current_lease_id, NULL::text AS current_owner, NULL::text AS status
    FROM renewed n
    UNION ALL
    -- a run that left 'running' (finished, released, cancelled) has its own event: only a
    -- lease that expired or was taken over is a renewal failure (a locked run is running)
    SELECT w.run_id, NULL, false, w.lease_id, k.lease_id, k.lease_owner, k.status
    FROM wanted w JOIN locked k ON k.run_id = w.run_id
    WHERE NOT EXISTS (SELECT 1 FROM renewed n WHERE n.run_id = w.run_id)
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

CREATE OR REPLACE FUNCTION runledger._register_worker(p_worker_id text, p_hostname text, p_pid int,
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
    -- session_lock: the caller's own key, or NULL (a worker that takes an id over never
    -- inherits the last holder's key)
    UPDATE runledger.workers
    SET hostname = coalesce(p_hostname, ''), pid = coalesce(p_pid, 0), flows = p_flows,
        started_at = v_now, heartbeat_at = v_now, stopped_at = NULL,
        session_pid = v_session_pid, session_started_at = v_session_started,
        session_lock = p_session_lock, process = p_process, incarnation = p_incarnation,
        silent_after = p_silent_after
    WHERE worker_id = p_worker_id;
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
    -- the clock the lease check read after the lock
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

CREATE OR REPLACE FUNCTION runledger.record_turn_v4(p_run_id text, p_lease_id uuid, p_fencing_token bigint,
                                         p_turn int, p_calls jsonb, p_record jsonb,
                                         p_output jsonb, p_expected_version bigint,
                                         p_state jsonb, p_finish boolean, p_dispatch text[])
RETURNS TABLE (state_version bigint, attempts integer[])
LANGUAGE plpgsql SECURITY DEFINER
SET search_path = pg_catalog, runledger, pg_temp
AS $$
#variable_conflict use_column
DECLARE
    v_lock record;
    r runledger.runs;
    v_now timestamptz;
    v_count integer;
    v_found boolean;
    v_calls jsonb;
    v_record jsonb;
    v_output jsonb;
    v_next integer;
    v_open integer;
    v_run_calls integer;
    v_calls_ok boolean;
    v_repeated boolean;
    v_bad record;
    v_version bigint;
    v_id text;
    v_fast boolean;
    v_dispatched jsonb[];
    v_kinds text[];
BEGIN
    -- the clock the lease check read after the lock (as complete_call_v2)
    v_lock := runledger._lock_leased_run_at(p_run_id, p_lease_id, p_fencing_token);
    r := v_lock.r;
    v_now := v_lock.at;
    PERFORM runledger._check_json_value('calls', p_calls, 2);
    IF jsonb_typeof(p_calls) <> 'array' THEN
        PERFORM runledger._raise('RL006', 'calls must be a JSON array', NULL, NULL);
    END IF;
    IF p_turn IS NULL OR p_turn < 0 THEN
        PERFORM runledger._raise('RL006', 'turn must be a non-negative integer', NULL, NULL);
    END IF;
    IF p_record IS NOT NULL THEN
        PERFORM runledger._check_json_object_or_null('record', p_record);
    END IF;
    IF p_output IS NOT NULL THEN
        PERFORM runledger._check_json_value_or_null('output', p_output);
    END IF;
    v_count := jsonb_array_length(p_calls);
    IF p_output IS NOT NULL AND v_count > 0 THEN
        PERFORM runledger._raise('RL006', 'output is the final decision''s: it needs empty calls',
            format('turn %s has %s call(s)', p_turn, v_count),
            'send the output with the decision that ends the run');
    END IF;
    IF p_state IS NOT NULL THEN
        PERFORM runledger._check_json_object_or_null('state', p_state);
    END IF;
    IF p_finish IS NULL THEN
        PERFORM runledger._raise('RL006', 'finish must not be null', NULL,
            'true ends the run with the final decision, false records the turn only');
    END IF;
    IF p_finish AND v_count > 0 THEN
        PERFORM runledger._raise('RL006', 'only the final decision finishes the run: it needs empty calls',
            format('turn %s has %s call(s)', p_turn, v_count), NULL);
    END IF;
    -- the calls to dispatch: distinct call ids of this decision (checked as calls are below;
    -- an id that is not one of them matches none). One id is distinct
    -- without a count, and a call object with that string id (containment, no query)
    -- settles it; anything else takes the queries.
    IF p_dispatch IS NOT NULL AND cardinality(p_dispatch) > 0 THEN
        v_repeated := array_position(p_dispatch, NULL) IS NOT NULL;
        IF NOT v_repeated AND cardinality(p_dispatch) > 1 THEN
            v_repeated := cardinality(p_dispatch)
                          > (SELECT count(DISTINCT u) FROM unnest(p_dispatch) u);
        END IF;
        IF v_repeated THEN
            PERFORM runledger._raise('RL006', 'dispatch must list distinct call ids, none null',
                format('got %s', left(array_to_string(p_dispatch, ', ', 'NULL'), 300)), NULL);
        END IF;
        IF cardinality(p_dispatch) > 1
           OR NOT p_calls @> jsonb_build_array(jsonb_build_object('call_id', p_dispatch[1])) THEN
            SELECT u INTO v_id FROM unnest(p_dispatch) u
            WHERE NOT EXISTS (SELECT 1 FROM jsonb_array_elements(p_calls) e
                              WHERE jsonb_typeof(e) = 'object' AND e ->> 'call_id' = u)
            LIMIT 1;
            IF FOUND THEN
                PERFORM runledger._raise('RL006',
                    format('call %s to dispatch is not a call of turn %s', left(v_id, 100), p_turn),
                    'dispatch names call ids of the decision it comes with', NULL);
            END IF;
        END IF;
    END IF;

    -- What the checks below read, in one statement: the turn p_turn if it
    -- is recorded, the next turn, the run's open calls and all its calls, and whether
    -- every call passes the checks of the call loop (then the query that finds the first
    -- problem is not run). Each is used in the order of the checks, as before. The patterns
    -- are those of the checks with the length tested apart: a bounded repetition ({0,63})
    -- costs the regex engine several times more than a star.
    SELECT t.turn IS NOT NULL, t.calls, t.record, t.output, n.next, k.open, k.total, v.ok
    INTO v_found, v_calls, v_record, v_output, v_next, v_open, v_run_calls, v_calls_ok
    FROM (SELECT coalesce(max(x.turn) + 1, 0) AS next FROM runledger.run_turns x
          WHERE x.run_id = p_run_id) n
    CROSS JOIN (SELECT count(*) FILTER (WHERE c.status NOT IN ('succeeded', 'failed')) AS open,
                       count(*) AS total
                FROM runledger.run_calls c WHERE c.run_id = p_run_id) k
    CROSS JOIN (SELECT count(*) = 0 OR (bool_and(coalesce(
                    jsonb_typeof(e) = 'object'
                    AND jsonb_typeof(e -> 'call_id') = 'string'
                    AND (e ->> 'call_id') ~ '^[A-Za-z0-9][A-Za-z0-9._-]*$'
                    AND length(e ->> 'call_id') <= 64
                    AND jsonb_typeof(e -> 'tool') = 'string'
                    AND (e ->> 'tool') ~ '^[A-Za-z_][A-Za-z0-9._-]*$'
                    AND length(e ->> 'tool') <= 128
                    AND jsonb_typeof(coalesce(e -> 'args', '{}'::jsonb)) = 'object'
                    AND coalesce(jsonb_typeof(e -> 'provider_id'), 'null') IN ('null', 'string')
                    AND (jsonb_typeof(e -> 'provider_id') IS DISTINCT FROM 'string'
                         OR length(e ->> 'provider_id') BETWEEN 1 AND runledger._cap('provider_id'))
                    AND (NOT e ? 'approval' OR jsonb_typeof(e -> 'approval') = 'boolean'),
                    false))
                    AND count(DISTINCT e ->> 'call_id') = count(*)) AS ok
                FROM jsonb_array_elements(p_calls) e) v
    LEFT JOIN runledger.run_turns t ON t.run_id = p_run_id AND t.turn = p_turn;
    IF v_found THEN
        IF v_calls = p_calls AND v_record IS NOT DISTINCT FROM p_record
           AND v_output IS NOT DISTINCT FROM p_output THEN
            -- the same decision again: nothing of it is written again; its calls to
            -- dispatch are, as dispatch_call would
            state_version := r.state_version;
            attempts := runledger._dispatch_each(r, p_turn, p_dispatch, v_now, r.state_version);
            RETURN NEXT;
            RETURN;
        END IF;
        PERFORM runledger._raise('RL004',
            format('turn %s of run %s is already recorded with another decision', p_turn, p_run_id),
            CASE WHEN v_calls = p_calls THEN 'the calls are the same; the record or the output differ'
                 ELSE 'the calls differ' END,
            'a recorded decision is never replaced: replay it');
    END IF;
    IF p_state IS NOT NULL AND p_expected_version IS DISTINCT FROM r.state_version THEN
        PERFORM runledger._raise('RL002',
            format('state version conflict on run %s', p_run_id),
            format('expected state_version %s, the run is at %s (token %s)',
                   coalesce(p_expected_version::text, 'NULL'), r.state_version, p_fencing_token),
            'reload the run state and decide again');
    END IF;
    IF p_turn <> v_next THEN
        PERFORM runledger._raise('RL004',
            format('turn %s of run %s is out of order', p_turn, p_run_id),
            format('the next turn to record is %s', v_next), NULL);
    END IF;
    IF v_open > 0 THEN
        PERFORM runledger._raise('RL004',
            format('run %s has %s call(s) without a final result', p_run_id, v_open),
            NULL, 'complete every call of the previous turn before recording the next');
    END IF;

    -- One pass over the calls: the first one (in order) with a problem, and its first
    -- problem in the order of the CASE below. A repeated call id is one whose earlier twin
    -- came first; every call before the first bad one is good.
    IF v_calls_ok IS NOT TRUE THEN
        SELECT x.c, x.problem INTO v_bad FROM (
            SELECT e.c, e.pos, CASE
                WHEN jsonb_typeof(e.c) <> 'object' THEN 'object'
                WHEN jsonb_typeof(e.c -> 'call_id') IS DISTINCT FROM 'string'
                     OR (e.c ->> 'call_id') !~ '^[A-Za-z0-9][A-Za-z0-9._-]{0,63}$' THEN 'call_id'
                WHEN e.seen > 1 THEN 'twice'
                WHEN jsonb_typeof(e.c -> 'tool') IS DISTINCT FROM 'string'
                     OR (e.c ->> 'tool') !~ '^[A-Za-z_][A-Za-z0-9._-]{0,127}$' THEN 'tool'
                WHEN jsonb_typeof(coalesce(e.c -> 'args', '{}'::jsonb)) <> 'object' THEN 'args'
                WHEN coalesce(jsonb_typeof(e.c -> 'provider_id'), 'null') NOT IN ('null', 'string')
                     THEN 'provider_type'
                WHEN jsonb_typeof(e.c -> 'provider_id') = 'string'
                     AND length(e.c ->> 'provider_id') NOT BETWEEN 1 AND runledger._cap('provider_id')
                     THEN 'provider_id'
                WHEN e.c ? 'approval' AND jsonb_typeof(e.c -> 'approval') <> 'boolean' THEN 'approval'
            END AS problem
            FROM (SELECT a.c, a.pos,
                         count(*) OVER (PARTITION BY a.c ->> 'call_id' ORDER BY a.pos) AS seen
                  FROM jsonb_array_elements(p_calls) WITH ORDINALITY AS a(c, pos)) e
        ) x
        WHERE x.problem IS NOT NULL
        ORDER BY x.pos
        LIMIT 1;
        IF FOUND THEN
            CASE v_bad.problem
                WHEN 'object' THEN
                    PERFORM runledger._raise('RL006', 'each call must be a JSON object', NULL, NULL);
                WHEN 'call_id' THEN
                    PERFORM runledger._raise('RL006',
                        format('invalid call id %s', coalesce(left(v_bad.c ->> 'call_id', 100), 'NULL')),
                        'a call id is 1-64 characters of [A-Za-z0-9._-]', NULL);
                WHEN 'twice' THEN
                    PERFORM runledger._raise('RL006',
                        format('call id %s appears twice in turn %s', v_bad.c ->> 'call_id', p_turn),
                        NULL, NULL);
                WHEN 'tool' THEN
                    PERFORM runledger._raise('RL006',
                        format('invalid tool name %s', coalesce(left(v_bad.c ->> 'tool', 100), 'NULL')),
                        NULL, NULL);
                WHEN 'args' THEN
                    PERFORM runledger._raise('RL006',
                        format('args of call %s must be a JSON object', v_bad.c ->> 'call_id'),
                        NULL, NULL);
                WHEN 'provider_type' THEN
                    PERFORM runledger._raise('RL006',
                        format('provider id of call %s must be a string or null', v_bad.c ->> 'call_id'),
                        NULL, NULL);
                WHEN 'provider_id' THEN
                    PERFORM runledger._check_text('provider id', v_bad.c ->> 'provider_id', 1,
                                                  runledger._cap('provider_id'));
                ELSE
                    PERFORM runledger._raise('RL006',
                        format('approval of call %s must be true or false', v_bad.c ->> 'call_id'),
                        format('got %s', left((v_bad.c -> 'approval')::text, 100)),
                        'leave "approval" out for a call that needs none');
            END CASE;
        END IF;
    END IF;

    v_version := r.state_version + CASE WHEN p_state IS NULL THEN 0 ELSE 1 END;
    INSERT INTO runledger.run_turns (run_id, turn, calls, fencing_token, created_at, record, output)
    VALUES (p_run_id, p_turn, p_calls, p_fencing_token, v_now, p_record, p_output);
    -- The calls to dispatch are inserted dispatched (attempt 1, this lease),
    -- the row _dispatch would make of them, instead of planned and then updated one by one,
    -- unless a call of the decision awaits approval (_dispatch refuses those: its path
    -- below, with its error) or p_dispatch does not start at 1 (that path reads element 1).
    -- Their call_dispatched details, in p_dispatch's order.
    v_fast := coalesce(cardinality(p_dispatch), 0) > 0 AND array_lower(p_dispatch, 1) = 1
              AND NOT p_calls @> '[{"approval": true}]'::jsonb;
    WITH ins AS (
        INSERT INTO runledger.run_calls (run_id, turn, call_id, position, tool, args,
                                         idempotency_key, status, attempts, provider_id,
                                         approval, dispatched_token, dispatched_by,
                                         dispatched_at)
        SELECT p_run_id, p_turn, a.c ->> 'call_id', a.pos - 1, a.c ->> 'tool',
               coalesce(a.c -> 'args', '{}'::jsonb),
               p_run_id || ':' || p_turn || ':' || (a.c ->> 'call_id'),
               CASE WHEN d.dispatch THEN 'dispatched' ELSE 'planned' END,
               CASE WHEN d.dispatch THEN 1 ELSE 0 END,
               a.c ->> 'provider_id',
               CASE WHEN (a.c -> 'approval') = 'true'::jsonb THEN 'pending' END,
               CASE WHEN d.dispatch THEN r.fencing_token END,
               CASE WHEN d.dispatch THEN r.lease_owner END,
               CASE WHEN d.dispatch THEN v_now END
        FROM jsonb_array_elements(p_calls) WITH ORDINALITY AS a(c, pos)
        CROSS JOIN LATERAL (SELECT v_fast AND (a.c ->> 'call_id') = ANY (p_dispatch)
                                   AS dispatch) d
        RETURNING call_id, tool, idempotency_key, status)
    SELECT array_agg(jsonb_build_object('idempotency_key', ins.idempotency_key,
                                        'tool', ins.tool, 'attempt', 1,
                                        'previous_status', 'planned') ORDER BY w.ord)
    INTO v_dispatched
    FROM ins JOIN unnest(p_dispatch) WITH ORDINALITY AS w(id, ord) ON w.id = ins.call_id
    WHERE ins.status = 'dispatched';
    -- the checkpoint, the progress and, for the final decision, the end: one row version
    UPDATE runledger.runs
    SET state = CASE WHEN p_state IS NULL THEN state ELSE p_state END,
        state_version = v_version,
        stalled_claims = 0,
        status = CASE WHEN p_finish THEN 'succeeded' ELSE status END,
        result = CASE WHEN p_finish
                      THEN coalesce(p_output, jsonb_build_object('turns', p_turn + 1,
                                                                 'calls', v_run_calls))
                      ELSE result END,
        error = CASE WHEN p_finish THEN NULL ELSE error END,
        pause_reason = CASE WHEN p_finish THEN NULL ELSE pause_reason END,
        lease_id = CASE WHEN p_finish THEN NULL ELSE lease_id END,
        lease_expires_at = CASE WHEN p_finish THEN NULL ELSE lease_expires_at END,
        lease_owner = CASE WHEN p_finish THEN NULL ELSE lease_owner END,
        finished_at = CASE WHEN p_finish THEN v_now ELSE finished_at END,
        updated_at = v_now
    WHERE run_id = p_run_id AND lease_id = p_lease_id AND fencing_token = p_fencing_token
      AND state_version = r.state_version;
    -- the checkpoint, the decision, the calls dispatched above (in p_dispatch's order, as
    -- _dispatch writes their events) and the run's end: in one INSERT
    -- (runledger._events), in that order
    v_kinds := CASE WHEN p_state IS NOT NULL THEN ARRAY['checkpoint'] ELSE '{}'::text[] END
               || ARRAY['turn_recorded']
               || array_fill('call_dispatched'::text,
                             ARRAY[coalesce(cardinality(v_dispatched), 0)])
               || CASE WHEN p_finish THEN ARRAY['run_succeeded'] ELSE '{}'::text[] END;
    PERFORM runledger._events(p_run_id, r.lease_owner, p_fencing_token, v_now, v_kinds,
        array_fill(v_version, ARRAY[cardinality(v_kinds)]),
        CASE WHEN p_state IS NOT NULL THEN ARRAY['{}'::jsonb] ELSE '{}'::jsonb[] END
        || jsonb_build_object('turn', p_turn, 'calls', v_count)
        || coalesce(v_dispatched, '{}'::jsonb[])
        || CASE WHEN p_finish THEN ARRAY['{}'::jsonb] ELSE '{}'::jsonb[] END);
    state_version := v_version;
    IF v_fast THEN
        attempts := array_fill(1, ARRAY[cardinality(p_dispatch)]);
    ELSIF cardinality(p_dispatch) = 1 THEN
        -- one call: what _dispatch_each does for it, one call layer less
        attempts := ARRAY[runledger._dispatch(p_run_id, p_run_id || ':' || p_turn || ':' || p_dispatch[1],
                                              r.lease_owner, r.fencing_token, v_version, v_now)];
    ELSE
        attempts := runledger._dispatch_each(r, p_turn, p_dispatch, v_now, v_version);
    END IF;
    RETURN NEXT;
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
    -- the clock the lease check read after the lock
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
    -- the clock the lease check read after the lock
    v_lock := runledger._lock_leased_run_at(p_run_id, p_lease_id, p_fencing_token);
    r := v_lock.r;
    v_now := v_lock.at;
    -- not_applied: the effect certainly did not happen and the call will be sent again
    -- with the same key; it goes back to planned, so no one mistakes it for in flight.
    -- The checks' common cases inline, as complete_call_v2.
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
    -- The call's UPDATE first, one statement instead of SELECT ... FOR
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
    -- written only when there is a count to reset: after the first write
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
    -- the clock the lease check read after the lock
    v_lock := runledger._lock_leased_run_at(p_run_id, p_lease_id, p_fencing_token);
    r := v_lock.r;
    v_now := v_lock.at;
    -- the checks' common cases inline: a check helper runs only where it
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
    -- The call's UPDATE first, one statement instead of SELECT ... FOR
    -- UPDATE and an UPDATE of the same row (the lock was one more heap write and WAL
    -- record), when the next call's arguments are fine. The call is the one _lock_call
    -- would lock: every writer of a run's calls holds the run's row lock first, as
    -- this function does. Only when no row matched (an invalid key, a key of another
    -- run, a call not dispatched) or a next-call refusal is due does the slow path
    -- below run, to refuse with the exact error in the same order. The run is
    -- a filter (IS NOT DISTINCT FROM), as in _dispatch: the row is found by its key.
    -- With the next call, both rows in one UPDATE (one statement's start,
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
          -- one an earlier holder sent goes through _dispatch's sender check
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
        -- the call's event, then the next call's call_dispatched, as below: both in one
        -- INSERT (runledger._events)
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
    -- written only when there is a count to reset: after the first write
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
    -- the clock the lease check read after the lock
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
        -- as complete_call_v2: a check helper runs only with a value
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
    -- the clock the lease check read after the lock
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

CREATE OR REPLACE FUNCTION runledger.prune_runs(p_before timestamptz, p_keep_events boolean)
RETURNS integer
LANGUAGE plpgsql SECURITY DEFINER
SET search_path = pg_catalog, runledger, pg_temp
AS $$
DECLARE
    v_count integer := 0;
    v_batch integer;
BEGIN
    IF p_before IS NULL THEN
        PERFORM runledger._raise('RL006', 'before must not be null', NULL, NULL);
    END IF;
    -- prune_runs_v2's batches, one after the other in this transaction, so
    -- that the deletes (and the record of the chains they delete) are written once
    LOOP
        v_batch := runledger.prune_runs_v2(p_before, coalesce(p_keep_events, false), 10000);
        v_count := v_count + v_batch;
        EXIT WHEN v_batch < 10000;
    END LOOP;
    RETURN v_count;
END
$$;

CREATE OR REPLACE FUNCTION runledger.prune_runs_v2(p_before timestamptz, p_keep_events boolean,
                                        p_limit integer)
RETURNS integer
LANGUAGE plpgsql SECURITY DEFINER
SET search_path = pg_catalog, runledger, pg_temp
AS $$
DECLARE
    v_count integer;
    v_txid bigint;
BEGIN
    IF p_before IS NULL THEN
        PERFORM runledger._raise('RL006', 'before must not be null', NULL, NULL);
    END IF;
    IF p_keep_events IS NULL THEN
        PERFORM runledger._raise('RL006', 'keep events must be true or false', NULL, NULL);
    END IF;
    IF p_limit IS NULL OR p_limit < 1 OR p_limit > 10000 THEN
        PERFORM runledger._raise('RL006',
            format('limit must be 1-10000, got %s', coalesce(p_limit::text, 'NULL')), NULL,
            'prune in batches: call again until fewer than the limit are deleted');
    END IF;
    v_txid := txid_current();
    INSERT INTO runledger.prune_authorizations (txid) VALUES (v_txid) ON CONFLICT DO NOTHING;
    WITH batch AS (
        SELECT x.run_id FROM runledger.runs x
        WHERE x.finished_at < p_before AND x.status IN ('succeeded', 'failed', 'cancelled')
        ORDER BY x.finished_at
        LIMIT p_limit
        FOR UPDATE SKIP LOCKED
    ), gone AS (
        DELETE FROM runledger.runs x USING batch b
        WHERE x.run_id = b.run_id
        RETURNING x.run_id
    ), events AS (
        DELETE FROM runledger.run_events e
        WHERE NOT p_keep_events AND e.run_id IN (SELECT g.run_id FROM gone g)
        RETURNING e.run_id, e.event_id, e.hash
    ), chains AS (
        -- each deleted chain, so that audit tells it from a tampered one;
        -- and the database login that deleted it (session_user: this
        -- function runs as its owner, current_user would name the owner)
        INSERT INTO runledger.event_chain_prunes (run_id, last_event_id, last_hash, events,
                                                  pruned_at, pruned_by)
        SELECT DISTINCT ON (d.run_id) d.run_id, d.event_id, d.hash,
               count(*) OVER (PARTITION BY d.run_id), runledger.now(), session_user
        FROM events d ORDER BY d.run_id, d.event_id DESC
    )
    SELECT count(*) INTO v_count FROM gone;
    DELETE FROM runledger.prune_authorizations a WHERE a.txid = v_txid;
    RETURN v_count;
END
$$;

CREATE OR REPLACE FUNCTION runledger._guard_run_calls() RETURNS trigger
LANGUAGE plpgsql SECURITY DEFINER
SET search_path = pg_catalog, runledger, pg_temp
AS $$
BEGIN
    IF TG_OP = 'DELETE' THEN
        IF NOT runledger._prune_authorized() THEN
            PERFORM runledger._raise('RL007',
                format('calls are deleted only by runledger.prune_runs (%s)', OLD.idempotency_key),
                NULL, 'a session setting does not authorize a delete');
        END IF;
        RETURN OLD;
    END IF;
    IF NEW.idempotency_key <> OLD.idempotency_key OR NEW.run_id <> OLD.run_id
       OR NEW.turn <> OLD.turn OR NEW.call_id <> OLD.call_id OR NEW.tool <> OLD.tool
       OR NEW.args <> OLD.args OR NEW.provider_id IS DISTINCT FROM OLD.provider_id THEN
        PERFORM runledger._raise('RL007',
            format('call %s: key, tool, args and provider id are immutable', OLD.idempotency_key),
            NULL, NULL);
    END IF;
    IF OLD.status = 'succeeded' AND (NEW.status <> OLD.status
        OR NEW.result IS DISTINCT FROM OLD.result OR NEW.receipt IS DISTINCT FROM OLD.receipt) THEN
        PERFORM runledger._raise('RL007',
            format('call %s succeeded; its result and receipt cannot be overwritten',
                   OLD.idempotency_key),
            format('receipt %s', OLD.receipt), NULL);
    END IF;
    IF NEW.attempts < OLD.attempts THEN
        PERFORM runledger._raise('RL007',
            format('attempts of call %s cannot decrease', OLD.idempotency_key), NULL, NULL);
    END IF;
    -- an approval moves pending -> approved or pending -> denied, once; who
    -- decided, when and why never change afterwards
    IF NEW.approval IS DISTINCT FROM OLD.approval
       AND NOT coalesce(OLD.approval = 'pending' AND NEW.approval IN ('approved', 'denied'),
                        false) THEN
        PERFORM runledger._raise('RL007',
            format('approval of call %s cannot move from %s to %s', OLD.idempotency_key,
                   coalesce(OLD.approval, 'NULL'), coalesce(NEW.approval, 'NULL')),
            NULL, 'a pending approval is decided once, by approve_call or deny_call');
    END IF;
    IF OLD.approval IN ('approved', 'denied')
       AND (NEW.approval_by IS DISTINCT FROM OLD.approval_by
            OR NEW.approval_note IS DISTINCT FROM OLD.approval_note
            OR NEW.approval_at IS DISTINCT FROM OLD.approval_at) THEN
        PERFORM runledger._raise('RL007',
            format('call %s was %s by %s: the decision cannot be rewritten', OLD.idempotency_key,
                   OLD.approval, OLD.approval_by), NULL, NULL);
    END IF;
    RETURN NEW;
END
$$;
