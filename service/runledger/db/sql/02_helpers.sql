-- ---------------------------------------------------------------------------------
-- Helpers (not granted to anyone: only the SECURITY DEFINER functions call them)
-- ---------------------------------------------------------------------------------
-- No helper has SET search_path (nor has runledger.now()). A SET costs on
-- every call (the path is set and restored, and its cached lookups recomputed) and it
-- keeps a SQL function from being inlined. It is safe to leave out here because:
--   * a function without SET runs with its caller's search_path;
--   * the helpers are granted to no one (not even PUBLIC), so only the owner's code calls
--     them: the SECURITY DEFINER contract functions and the SECURITY DEFINER trigger
--     functions of 06_wall.sql, every one of which pins pg_catalog, runledger, pg_temp
--     (tests/migrations/test_function_contract.py checks both);
--   * under that path pg_catalog comes first and pg_temp last, so a built-in function,
--     operator or type named without a schema is the built-in one, and no temporary
--     object can stand in for a table; our own tables and functions are written
--     schema-qualified all the same.
-- A helper must never become SECURITY DEFINER nor be granted without getting the SET back.

-- Every refusal leaves the database through here: a custom SQLSTATE (class RL, see
-- runledger.errors), a message, and DETAIL and HINT for the person reading it.
CREATE FUNCTION runledger._raise(p_code text, p_message text, p_detail text, p_hint text)
RETURNS void LANGUAGE plpgsql
AS $$
BEGIN
    RAISE EXCEPTION USING ERRCODE = p_code, MESSAGE = p_message,
        DETAIL = coalesce(p_detail, ''), HINT = coalesce(p_hint, '');
END
$$;

-- -- checks: one helper per rule, each raising RL006 ------------------------------------

CREATE FUNCTION runledger._check_run_id(p_run_id text) RETURNS void
LANGUAGE plpgsql IMMUTABLE
AS $$
BEGIN
    IF p_run_id IS NULL OR p_run_id !~ '^[A-Za-z0-9][A-Za-z0-9._:@-]{0,127}$' THEN
        PERFORM runledger._raise('RL006',
            format('invalid run id %s', coalesce(quote_literal(left(p_run_id, 200)), 'NULL')),
            'a run id is 1-128 characters of [A-Za-z0-9._:@-], starting with a letter or digit',
            NULL);
    END IF;
END
$$;

-- Caps on text arguments (characters) and on array arguments (elements): the one place
-- they are written down, listed in docs/design.md ("Caps and limits"). IMMUTABLE: a call
-- with a literal name is folded into a constant when the calling statement is planned.
CREATE FUNCTION runledger._cap(p_name text) RETURNS integer
LANGUAGE sql IMMUTABLE
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
        WHEN 'provider_id' THEN 200
    END
$$;

-- A text argument of p_min (0: NULL allowed; 1: NULL and '' refused) to p_max characters.
-- Refused, never cut: a stored value is the value sent.
CREATE FUNCTION runledger._check_text(p_what text, p_value text, p_min integer, p_max integer)
RETURNS void
LANGUAGE plpgsql IMMUTABLE
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

CREATE FUNCTION runledger._check_worker_id(p_worker_id text) RETURNS void
LANGUAGE plpgsql IMMUTABLE
AS $$
BEGIN
    PERFORM runledger._check_text('worker id', p_worker_id, 1, runledger._cap('worker_id'));
END
$$;

-- A lease is judged by the database clock; a day is far longer than any sane lease.
CREATE FUNCTION runledger._check_lease(p_lease interval) RETURNS void
LANGUAGE plpgsql STABLE
AS $$
BEGIN
    IF p_lease IS NULL OR p_lease <= interval '0' OR p_lease > interval '1 day' THEN
        PERFORM runledger._raise('RL006', format('lease %s must be positive and at most a day',
            coalesce(p_lease::text, 'NULL')), NULL, NULL);
    END IF;
END
$$;

-- A flow name and version, as submit_run takes them. A flow reference 'name@version'
-- (claim_runs_v4, register_worker_v2) is checked by _parse_flows below.
CREATE FUNCTION runledger._check_flow(p_flow text, p_flow_version text) RETURNS void
LANGUAGE plpgsql IMMUTABLE
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

-- Nesting depth, counted so: a scalar is depth 0; an object or array is one more than its
-- deepest member, so {} and {"a": 1} are depth 1, [[]] and {"a": [1]} depth 2. A value
-- deeper than p_max has an object or array at level p_max (the root is level 0): jsonpath
-- (C) looks for one and does not walk below that level.
CREATE FUNCTION runledger._check_json_depth(p_what text, p_value jsonb, p_max integer)
RETURNS void
LANGUAGE plpgsql IMMUTABLE
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

-- JSON arguments: four named checks instead of two bare booleans. Each one refuses what
-- its name excludes (null, a non-object), then a payload over settings.max_payload_bytes,
-- then one nested deeper than settings.max_json_depth. p_wrap: levels of the contract's
-- own structure around the values a caller nests (record_turn_v4's array and call objects
-- around each call's args: 2), allowed on top of the limit.
CREATE FUNCTION runledger._check_json_value_or_null(p_what text, p_value jsonb,
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

CREATE FUNCTION runledger._check_json_value(p_what text, p_value jsonb,
                                            p_wrap integer DEFAULT 0) RETURNS void
LANGUAGE plpgsql STABLE
AS $$
BEGIN
    IF p_value IS NULL THEN
        PERFORM runledger._raise('RL006', format('%s must not be null', p_what), NULL, NULL);
    END IF;
    PERFORM runledger._check_json_value_or_null(p_what, p_value, p_wrap);
END
$$;

CREATE FUNCTION runledger._check_json_object_or_null(p_what text, p_value jsonb) RETURNS void
LANGUAGE plpgsql STABLE
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
AS $$
BEGIN
    IF p_value IS NULL THEN
        PERFORM runledger._raise('RL006', format('%s must not be null', p_what), NULL, NULL);
    END IF;
    PERFORM runledger._check_json_object_or_null(p_what, p_value);
END
$$;

CREATE FUNCTION runledger._check_word(p_what text, p_value text, p_allowed text[]) RETURNS void
LANGUAGE plpgsql IMMUTABLE
AS $$
BEGIN
    IF p_value IS NULL OR NOT (p_value = ANY (p_allowed)) THEN
        PERFORM runledger._raise('RL006',
            format('unknown %s %s', p_what, coalesce(quote_literal(left(p_value, 100)), 'NULL')),
            format('expected one of: %s', array_to_string(p_allowed, ', ')), NULL);
    END IF;
END
$$;

CREATE FUNCTION runledger._parse_flows(p_flows text[], OUT names text[], OUT versions text[])
LANGUAGE plpgsql IMMUTABLE
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

-- -- writes every function shares -----------------------------------------------------

-- The link of an event in its run's hash chain. sha256 over the previous
-- event's hash (none for a run's first event, or the first after the chain began) and the
-- event's columns as one JSON array: [event_id, run_id, at in microseconds since the
-- epoch, kind, actor, fencing_token, state_version, detail]. jsonb's text form is
-- canonical (keys sorted, one spelling of each number) and the time is an integer, so the
-- input depends on no session setting. Inlined where it is used (plain SQL, STABLE).
CREATE FUNCTION runledger._event_hash(p_previous bytea, p_event_id bigint, p_run_id text,
                                      p_at timestamptz, p_kind text, p_actor text,
                                      p_fencing_token bigint, p_state_version bigint,
                                      p_detail jsonb) RETURNS bytea
LANGUAGE sql STABLE
AS $$
    SELECT pg_catalog.sha256(
        coalesce(p_previous, ''::bytea) OPERATOR(pg_catalog.||) pg_catalog.convert_to(
            pg_catalog.jsonb_build_array(p_event_id, p_run_id,
                (EXTRACT(epoch FROM p_at) OPERATOR(pg_catalog.*) 1000000)::bigint,
                p_kind, p_actor, p_fencing_token, p_state_version, p_detail)::text, 'UTF8'))
$$;

-- A checkpoint's digest, chained over the previous one. heads: the
-- checkpoint's heads as 'run_id event_id hash-hex' lines in run_id order, joined by
-- newlines (see runledger.checkpoint_events).
CREATE FUNCTION runledger._checkpoint_digest(p_previous bytea, p_checkpoint_id bigint,
                                             p_through_event_id bigint, p_heads text)
RETURNS bytea
LANGUAGE sql IMMUTABLE
AS $$
    SELECT pg_catalog.sha256(
        coalesce(p_previous, ''::bytea) OPERATOR(pg_catalog.||) pg_catalog.convert_to(
            p_checkpoint_id::text || ' ' || p_through_event_id::text || E'\n'
            || coalesce(p_heads, ''), 'UTF8'))
$$;

-- The refusal of an event written to a run's chain outside READ COMMITTED
-- (see _event), for _event and _events alike; called only to refuse.
CREATE FUNCTION runledger._refuse_event_isolation(p_run_id text) RETURNS void
LANGUAGE plpgsql
AS $$
BEGIN
    PERFORM runledger._raise('RL006',
        format('events of run %s are written in READ COMMITTED transactions only, not %s',
               p_run_id, upper(pg_catalog.current_setting('transaction_isolation'))),
        'a transaction with one snapshot does not see the events committed since it'
        || ' began, and the run''s hash chain would fork',
        'call the contract functions in autocommit or in a READ COMMITTED transaction,'
        || ' with default_transaction_isolation read committed');
END
$$;

-- One of the two INSERTs into run_events (the other is _events: the events of one write
-- together). Callers pass the event kind as a literal, so a grep for it finds
-- the writer. p_at: the function's one reading of the clock when the event belongs to a
-- set-based statement (claims, renewals); otherwise the clock now.
-- PL/pgSQL: a SQL function that is not inlined (an INSERT never is)
-- parses and plans its body at every call site in every transaction; PL/pgSQL plans the
-- INSERT once per session.
-- An event that changes what an operator sees of a run (not the per-call
-- and per-turn ones) is also sent on NOTIFY channel runledger_events, payload
-- '<event_id> <run_id> <kind>', at commit (a rolled-back event sends nothing). Nor
-- 'claimed': a commit that notifies wakes every listening session of the database (each
-- worker's listener reads the queue in a transaction of its own), and a claim's commit
-- notifies nothing else; a run's end, a pause or an operator's act is what is sent.
-- 'submitted' costs no wake-up: its commit wakes the claimers (runledger_runs) anyway.
-- The event carries its link in the run's hash chain.
-- One run's events are appended one at a time under the run's row lock,
-- which every writer of them holds before it calls this function (FOR NO KEY UPDATE or
-- stronger, taken in an earlier statement; or the run row inserted by its own
-- transaction: submit_run's first event): the leased writes (_lock_leased_run_at), the
-- claims and the failover marking (their locking statements), the operator functions
-- (_lock_run), renew_leases and report_stale_write, as every writer of a run's calls
-- does. The lock was taken in an earlier statement, so under READ COMMITTED the
-- SELECT below takes a snapshot newer than it and reads the run's true last event; no
-- lock of the last event row is needed (it would be a heap lock and a WAL record per
-- event on top of the run's, for the same order). The event id is drawn inside the INSERT,
-- after its table lock: runledger.checkpoint_events, which takes the table in SHARE mode,
-- never misses an id drawn before it and inserted after it. A row lock takes no slot in
-- the lock table, so a failover that marks a million runs writes their events in one
-- transaction.
CREATE FUNCTION runledger._event(p_run_id text, p_kind text, p_actor text,
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

-- The events of one write in one INSERT. _event appends one event per
-- statement: a SELECT of the run's last hash, then an INSERT with its own statement set-up
-- (the table's CHECK, its two indexes). The writes that append two or more events of a run
-- together (complete_call_v2 with the next call's dispatch, record_turn_v4: the checkpoint,
-- the decision, its dispatched calls, the run's end) read the last hash once and insert
-- every row in one statement, each row chained to the one before it, in the order given:
-- the same rows, ids in the same order, the same hashes as _event called once per kind.
-- p_kinds, p_state_versions and p_details are parallel arrays (a NULL detail is '{}').
-- The ids are drawn inside the INSERT, after its table lock, by _event_rows (a function the
-- INSERT runs to completion when it reads its first row: each row's id, then its link to
-- the one before), as _event draws its id: runledger.checkpoint_events never misses one.
-- The list of kinds not notified is _event's, word for word (tests/migrations/
-- test_living_files.py holds them equal); the isolation refusal is the same helper's.
-- The rules of _event hold: the run's row lock is held by the caller; the chain is
-- extended in READ COMMITTED only (a first event of a run under another level only alone,
-- as with _event: the second would find the first); the kinds an operator sees are sent
-- on runledger_events, in id order.
CREATE FUNCTION runledger._event_rows(p_previous bytea, p_run_id text, p_actor text,
                                      p_fencing_token bigint, p_at timestamptz,
                                      p_kinds text[], p_state_versions bigint[],
                                      p_details jsonb[], OUT event_id bigint, OUT kind text,
                                      OUT state_version bigint, OUT detail jsonb,
                                      OUT hash bytea)
RETURNS SETOF record
LANGUAGE plpgsql
AS $$
BEGIN
    hash := p_previous;
    FOR i IN 1 .. coalesce(cardinality(p_kinds), 0) LOOP
        event_id := pg_catalog.nextval('runledger.run_events_event_id_seq'::regclass);
        kind := p_kinds[i];
        state_version := p_state_versions[i];
        detail := coalesce(p_details[i], '{}'::jsonb);
        hash := runledger._event_hash(hash, event_id, p_run_id, p_at, kind, p_actor,
                                      p_fencing_token, state_version, detail);
        RETURN NEXT;
    END LOOP;
END
$$;

CREATE FUNCTION runledger._events(p_run_id text, p_actor text, p_fencing_token bigint,
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

-- A run of this flow version became claimable: wake the claimers (LISTEN runledger_runs).
CREATE FUNCTION runledger._notify_queued(p_flow text, p_flow_version text) RETURNS void
LANGUAGE sql
AS $$
    SELECT pg_notify('runledger_runs', p_flow || '@' || p_flow_version);
$$;

-- -- locks: the run row first, then its calls -------------------------------------------

CREATE FUNCTION runledger._lock_run(p_run_id text) RETURNS runledger.runs
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

-- The lease check and the clock reading it made after the lock, for the
-- callers that use the time as well: one reading per transaction instead of a second
-- runledger.now() right after it (the same semantics: the clock is read once the row lock
-- is held). _lock_leased_run is this function's run row.
CREATE FUNCTION runledger._lock_leased_run_at(p_run_id text, p_lease_id uuid,
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

-- Lock the run row, then check that (lease_id, fencing_token) is its current,
-- unexpired lease by the database clock read after the lock. Every worker write starts
-- here. The run row of _lock_leased_run_at (one body for both).
CREATE FUNCTION runledger._lock_leased_run(p_run_id text, p_lease_id uuid, p_fencing_token bigint)
RETURNS runledger.runs
LANGUAGE sql
AS $$
    SELECT (runledger._lock_leased_run_at(p_run_id, p_lease_id, p_fencing_token)).r
$$;

CREATE FUNCTION runledger._lock_call(p_run_id text, p_key text) RETURNS runledger.run_calls
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

-- The dispatch of one call of a locked, leased run: dispatch_call,
-- complete_call_v2 (the next call) and record_turn_v4 (the first calls of a decision) call
-- it after their lease check, with the clock they read after the lock.
-- complete_call_v2 and record_turn_v4 write the same row themselves in their common case
-- (in the UPDATE of the completed call; in the INSERT of the decision's calls) and call
-- this function otherwise: a change here is a change there too. It refuses a call that
-- cannot be sent (final, unknown, awaiting approval), marks it dispatched under the token
-- and writes its call_dispatched event. Returns the attempt number.
-- One UPDATE ... RETURNING instead of SELECT ... FOR UPDATE and an UPDATE
-- of the same row (the lock was one more heap write and WAL record). The self-join reads
-- the status before the update (the event's previous_status): the row read is the row
-- updated, since every writer of a run's calls holds the run's row lock first (leased
-- writes, claims' failover marking, the operator functions via _lock_run), and the caller
-- holds it. Only when no row matched does the slow path lock and read the call, to refuse
-- it with the exact error (a key that is invalid or of another run matches none).
-- The run is compared with IS NOT DISTINCT FROM (run_id is NOT NULL: the same test) so
-- that it is a filter: the row is found by its key's unique index, as _lock_call finds
-- it, never by a scan of the run's calls through the primary key.
CREATE FUNCTION runledger._dispatch(p_run_id text, p_key text, p_owner text,
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

-- record_turn_v4's calls to dispatch (call ids of turn p_turn, checked by it), in order;
-- their attempt numbers. NULL or empty: none, and an empty array back.
CREATE FUNCTION runledger._dispatch_each(p_run runledger.runs, p_turn integer,
                                         p_call_ids text[], p_now timestamptz,
                                         p_state_version bigint) RETURNS integer[]
LANGUAGE plpgsql
AS $$
DECLARE
    v_id text;
    v_attempts integer[] := '{}';
BEGIN
    FOREACH v_id IN ARRAY coalesce(p_call_ids, '{}') LOOP
        v_attempts := v_attempts || runledger._dispatch(
            p_run.run_id, p_run.run_id || ':' || p_turn || ':' || v_id, p_run.lease_owner,
            p_run.fencing_token, p_state_version, p_now);
    END LOOP;
    RETURN v_attempts;
END
$$;

-- -- timelines ---------------------------------------------------------

-- The server's timeline: that of the WAL it writes now, from the name of the current WAL
-- file (a primary's new timeline shows there at once after a promotion, whereas
-- pg_control_checkpoint() names it only after the next checkpoint). Fails on a standby
-- (WAL control functions cannot run during recovery), as any write would. SQL, so that it
-- is inlined where it is called.
CREATE FUNCTION runledger._timeline() RETURNS integer
LANGUAGE sql VOLATILE
AS $$
    SELECT ('x' || substr(pg_walfile_name(pg_current_wal_lsn()), 1, 8))::bit(32)::integer
$$;

-- The fencing tokens of timeline N are over (N - 1) << 32, and a claim grants
-- greatest(token + 1, floor + 1): on timeline 1 tokens count 1, 2, ... as before, and
-- every token granted on a later timeline exceeds every token of an earlier one, those a
-- failover lost included (a run is claimed fewer than 2^32 times per timeline).
CREATE FUNCTION runledger._token_floor() RETURNS bigint
LANGUAGE sql VOLATILE
AS $$
    SELECT (runledger._timeline() - 1)::bigint << 32
$$;

-- Whether a commit acknowledged under these settings is on every standby
-- synchronous_standby_names lists, so that promoting any of them loses no acknowledged
-- commit: synchronous_commit waits for the standbys (on, remote_write, remote_apply), and
-- the list asks for as many standbys as it names ('n2'; 'FIRST 2 (n2, n3)'; 'ANY 2 (n2,
-- n3)'). Not so for an empty list, for '*', or for fewer than it names ('n2, n3' is
-- FIRST 1: n3 is only a candidate; 'ANY 1 (n2, n3)': either one may lack a commit).
CREATE FUNCTION runledger._synchronous(p_commit text, p_names text) RETURNS boolean
LANGUAGE plpgsql IMMUTABLE
AS $$
DECLARE
    v_names text := btrim(coalesce(p_names, ''));
    v_parts text[];
    v_count integer := 1;
BEGIN
    IF coalesce(p_commit, '') NOT IN ('on', 'remote_write', 'remote_apply') OR v_names = ''
       OR strpos(v_names, '*') > 0 THEN
        RETURN false;
    END IF;
    v_parts := regexp_match(v_names, '^(?:(?:any|first)\s+)?(\d+)\s*\((.*)\)$', 'i');
    IF v_parts IS NOT NULL THEN
        v_count := v_parts[1]::integer;
        v_names := v_parts[2];
    END IF;
    RETURN v_count >= 1 AND v_count = cardinality(string_to_array(v_names, ','));
END
$$;

-- The witness of how commits are acknowledged (runledger.commit_guarantees), kept by
-- every claim after its failover check: a row when the claiming session's
-- synchronous_commit or the server's synchronous_standby_names differ from the last row.
-- One read by primary key when nothing changed.
CREATE FUNCTION runledger._note_commit_guarantee(p_actor text, p_now timestamptz,
                                                 p_timeline integer) RETURNS void
LANGUAGE plpgsql
AS $$
DECLARE
    v_commit text := pg_catalog.current_setting('synchronous_commit');
    v_names text := pg_catalog.current_setting('synchronous_standby_names');
    v_last runledger.commit_guarantees;
BEGIN
    SELECT * INTO v_last FROM runledger.commit_guarantees g ORDER BY g.position DESC LIMIT 1;
    IF FOUND AND v_last.synchronous_commit = v_commit
       AND v_last.synchronous_standby_names = v_names THEN
        RETURN;
    END IF;
    -- one writer at a time; the others find its row
    LOCK TABLE runledger.commit_guarantees IN SHARE ROW EXCLUSIVE MODE;
    SELECT * INTO v_last FROM runledger.commit_guarantees g ORDER BY g.position DESC LIMIT 1;
    IF FOUND AND v_last.synchronous_commit = v_commit
       AND v_last.synchronous_standby_names = v_names THEN
        RETURN;
    END IF;
    INSERT INTO runledger.commit_guarantees (position, synchronous_commit,
                                             synchronous_standby_names, timeline, seen_at,
                                             seen_by)
    VALUES (coalesce(v_last.position, 0) + 1, v_commit, v_names, p_timeline, p_now, p_actor);
END
$$;
