-- ---------------------------------------------------------------------------------
-- Helpers (not granted to anyone: only the SECURITY DEFINER functions call them)
-- ---------------------------------------------------------------------------------

-- Every refusal leaves the database through here: a custom SQLSTATE (class RL, see
-- runledger.errors), a message, and DETAIL and HINT for the person reading it.
CREATE FUNCTION runledger._raise(p_code text, p_message text, p_detail text, p_hint text)
RETURNS void LANGUAGE plpgsql
SET search_path = pg_catalog, runledger, pg_temp
AS $$
BEGIN
    RAISE EXCEPTION USING ERRCODE = p_code, MESSAGE = p_message,
        DETAIL = coalesce(p_detail, ''), HINT = coalesce(p_hint, '');
END
$$;

-- -- checks: one helper per rule, each raising RL006 ------------------------------------

CREATE FUNCTION runledger._check_run_id(p_run_id text) RETURNS void
LANGUAGE plpgsql IMMUTABLE
SET search_path = pg_catalog, runledger, pg_temp
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

-- A lease is judged by the database clock; a day is far longer than any sane lease.
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

-- A flow name and version, as submit_run takes them. A flow reference 'name@version'
-- (claim_runs, register_worker) is checked by _parse_flows below.
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

-- JSON arguments: four named checks instead of two bare booleans. Each one refuses what
-- its name excludes (null, a non-object), then a payload over settings.max_payload_bytes.
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

CREATE FUNCTION runledger._check_word(p_what text, p_value text, p_allowed text[]) RETURNS void
LANGUAGE plpgsql IMMUTABLE
SET search_path = pg_catalog, runledger, pg_temp
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

-- The only INSERT into run_events. Callers pass the event kind as a literal, so a grep
-- for it finds the writer. p_at: the function's one reading of the clock when the event
-- belongs to a set-based statement (claims, renewals); otherwise the clock now.
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

-- A run of this flow version became claimable: wake the claimers (LISTEN runledger_runs).
CREATE FUNCTION runledger._notify_queued(p_flow text, p_flow_version text) RETURNS void
LANGUAGE sql
SET search_path = pg_catalog, runledger, pg_temp
AS $$
    SELECT pg_notify('runledger_runs', p_flow || '@' || p_flow_version);
$$;

-- -- locks: the run row first, then its calls -------------------------------------------

CREATE FUNCTION runledger._lock_run(p_run_id text) RETURNS runledger.runs
LANGUAGE plpgsql
SET search_path = pg_catalog, runledger, pg_temp
AS $$
DECLARE
    r runledger.runs;
BEGIN
    PERFORM runledger._check_run_id(p_run_id);
    SELECT * INTO r FROM runledger.runs WHERE run_id = p_run_id FOR NO KEY UPDATE;
    IF NOT FOUND THEN
        PERFORM runledger._raise('RL003', format('run %s not found', p_run_id), NULL, NULL);
    END IF;
    RETURN r;
END
$$;

-- Lock the run row, then check that (lease_id, fencing_token) is its current,
-- unexpired lease by the database clock. Every worker write starts here.
CREATE FUNCTION runledger._lock_leased_run(p_run_id text, p_lease_id uuid, p_fencing_token bigint)
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

CREATE FUNCTION runledger._lock_call(p_run_id text, p_key text) RETURNS runledger.run_calls
LANGUAGE plpgsql
SET search_path = pg_catalog, runledger, pg_temp
AS $$
DECLARE
    c runledger.run_calls;
BEGIN
    IF p_key IS NULL OR length(p_key) > 300 THEN
        PERFORM runledger._raise('RL006', 'invalid idempotency key', NULL, NULL);
    END IF;
    SELECT * INTO c FROM runledger.run_calls x WHERE x.idempotency_key = p_key FOR UPDATE;
    IF NOT FOUND OR c.run_id <> p_run_id THEN
        PERFORM runledger._raise('RL003',
            format('call %s not found in run %s', p_key, p_run_id), NULL, NULL);
    END IF;
    RETURN c;
END
$$;
