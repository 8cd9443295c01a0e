-- Revision 0007 down: back to 0006 exactly (the 0006 definitions, SET search_path
-- included, and the guard triggers that fired on every row).

CREATE OR REPLACE FUNCTION runledger.now() RETURNS timestamptz
LANGUAGE sql VOLATILE
SET search_path = pg_catalog, runledger, pg_temp
AS $$
    SELECT clock_timestamp() + coalesce((SELECT s.clock_offset FROM runledger.settings s), interval '0')
$$;

CREATE OR REPLACE FUNCTION runledger._raise(p_code text, p_message text, p_detail text, p_hint text)
RETURNS void LANGUAGE plpgsql
SET search_path = pg_catalog, runledger, pg_temp
AS $$
BEGIN
    RAISE EXCEPTION USING ERRCODE = p_code, MESSAGE = p_message,
        DETAIL = coalesce(p_detail, ''), HINT = coalesce(p_hint, '');
END
$$;

CREATE OR REPLACE FUNCTION runledger._check_run_id(p_run_id text) RETURNS void
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

CREATE OR REPLACE FUNCTION runledger._cap(p_name text) RETURNS integer
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
        WHEN 'provider_id' THEN 200
    END
$$;

CREATE OR REPLACE FUNCTION runledger._check_text(p_what text, p_value text, p_min integer, p_max integer)
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

CREATE OR REPLACE FUNCTION runledger._check_worker_id(p_worker_id text) RETURNS void
LANGUAGE plpgsql IMMUTABLE
SET search_path = pg_catalog, runledger, pg_temp
AS $$
BEGIN
    PERFORM runledger._check_text('worker id', p_worker_id, 1, runledger._cap('worker_id'));
END
$$;

CREATE OR REPLACE FUNCTION runledger._check_lease(p_lease interval) RETURNS void
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

CREATE OR REPLACE FUNCTION runledger._check_flow(p_flow text, p_flow_version text) RETURNS void
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

CREATE OR REPLACE FUNCTION runledger._check_json_depth(p_what text, p_value jsonb, p_max integer)
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

CREATE OR REPLACE FUNCTION runledger._check_json_value_or_null(p_what text, p_value jsonb,
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

CREATE OR REPLACE FUNCTION runledger._check_json_value(p_what text, p_value jsonb,
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

CREATE OR REPLACE FUNCTION runledger._check_json_object_or_null(p_what text, p_value jsonb) RETURNS void
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

CREATE OR REPLACE FUNCTION runledger._check_json_object(p_what text, p_value jsonb) RETURNS void
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

CREATE OR REPLACE FUNCTION runledger._check_word(p_what text, p_value text, p_allowed text[]) RETURNS void
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

CREATE OR REPLACE FUNCTION runledger._event(p_run_id text, p_kind text, p_actor text,
                                 p_fencing_token bigint, p_state_version bigint,
                                 p_detail jsonb, p_at timestamptz DEFAULT NULL) RETURNS void
LANGUAGE sql
SET search_path = pg_catalog, runledger, pg_temp
AS $$
    INSERT INTO runledger.run_events (run_id, at, kind, actor, fencing_token, state_version, detail)
    VALUES (p_run_id, coalesce(p_at, runledger.now()), p_kind, p_actor, p_fencing_token,
            p_state_version, coalesce(p_detail, '{}'::jsonb));
$$;

CREATE OR REPLACE FUNCTION runledger._notify_queued(p_flow text, p_flow_version text) RETURNS void
LANGUAGE sql
SET search_path = pg_catalog, runledger, pg_temp
AS $$
    SELECT pg_notify('runledger_runs', p_flow || '@' || p_flow_version);
$$;

CREATE OR REPLACE FUNCTION runledger._lock_run(p_run_id text) RETURNS runledger.runs
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

CREATE OR REPLACE FUNCTION runledger._requeue_if_settled(r runledger.runs, p_actor text, p_after text,
                                              p_now timestamptz) RETURNS boolean
LANGUAGE plpgsql
SET search_path = pg_catalog, runledger, pg_temp
AS $$
DECLARE
    v_left integer;
BEGIN
    IF r.status <> 'paused' THEN
        RETURN false;
    END IF;
    SELECT count(*) INTO v_left FROM runledger.run_calls x
    WHERE x.run_id = r.run_id
      AND (x.status = 'unknown' OR (x.status = 'planned' AND x.approval = 'pending'));
    IF v_left > 0 THEN
        RETURN false;
    END IF;
    UPDATE runledger.runs
    SET status = 'queued', pause_reason = NULL, available_at = p_now, updated_at = p_now
    WHERE run_id = r.run_id AND status = 'paused';
    PERFORM runledger._event(r.run_id, 'run_requeued', p_actor, NULL, r.state_version,
                             jsonb_build_object('after', p_after));
    PERFORM runledger._notify_queued(r.flow, r.flow_version);
    RETURN true;
END
$$;

CREATE OR REPLACE FUNCTION runledger._lock_awaiting_call(p_idempotency_key text) RETURNS runledger.run_calls
LANGUAGE plpgsql
SET search_path = pg_catalog, runledger, pg_temp
AS $$
DECLARE
    v_run_id text;
    r runledger.runs;
    c runledger.run_calls;
BEGIN
    PERFORM runledger._check_text('idempotency key', p_idempotency_key, 1,
                                  runledger._cap('idempotency_key'));
    SELECT x.run_id INTO v_run_id FROM runledger.run_calls x
    WHERE x.idempotency_key = p_idempotency_key;
    IF NOT FOUND THEN
        PERFORM runledger._raise('RL003', format('call %s not found', p_idempotency_key), NULL, NULL);
    END IF;
    r := runledger._lock_run(v_run_id);           -- the run row first, then the call
    c := runledger._lock_call(v_run_id, p_idempotency_key);
    IF c.status <> 'planned' OR c.approval IS DISTINCT FROM 'pending' THEN
        PERFORM runledger._raise('RL004',
            format('call %s does not await approval: it is %s, approval %s', p_idempotency_key,
                   c.status, coalesce(c.approval, 'not needed')),
            CASE WHEN c.approval IN ('approved', 'denied')
                 THEN format('%s by %s at %s', c.approval, c.approval_by, c.approval_at) END,
            'only a planned call recorded with "approval": true is approved or denied, once');
    END IF;
    IF r.status NOT IN ('queued', 'paused', 'cancelled', 'failed') THEN
        PERFORM runledger._raise('RL004',
            format('call %s is of a %s run; calls of running runs are not decided',
                   p_idempotency_key, r.status),
            format('run %s is held by %s', r.run_id, coalesce(r.lease_owner, 'nobody')),
            format('its worker pauses it on the call: decide once `runledger status %s` '
                   'shows it paused', r.run_id));
    END IF;
    RETURN c;
END
$$;

CREATE OR REPLACE FUNCTION runledger._prune_authorized() RETURNS boolean
LANGUAGE sql STABLE
SET search_path = pg_catalog, runledger, pg_temp
AS $$
    SELECT EXISTS (SELECT 1 FROM runledger.prune_authorizations a
                   WHERE a.txid = txid_current_if_assigned())
$$;

DROP TRIGGER tg_runs_guard ON runledger.runs;
DROP TRIGGER tg_runs_guard_columns ON runledger.runs;
DROP TRIGGER tg_runs_guard_delete ON runledger.runs;
DROP TRIGGER tg_run_calls_guard ON runledger.run_calls;
DROP TRIGGER tg_run_calls_guard_columns ON runledger.run_calls;
DROP TRIGGER tg_run_calls_guard_delete ON runledger.run_calls;
CREATE TRIGGER tg_runs_guard BEFORE UPDATE OR DELETE ON runledger.runs
    FOR EACH ROW EXECUTE FUNCTION runledger._guard_runs();
ALTER TABLE runledger.runs ENABLE ALWAYS TRIGGER tg_runs_guard;
CREATE TRIGGER tg_run_calls_guard BEFORE UPDATE OR DELETE ON runledger.run_calls
    FOR EACH ROW EXECUTE FUNCTION runledger._guard_run_calls();
ALTER TABLE runledger.run_calls ENABLE ALWAYS TRIGGER tg_run_calls_guard;
