-- runledger 0016 down: back to 0015 exactly. The chain (hashes, checkpoints, the record of
-- pruned chains) is dropped with its tables and column.

DROP TRIGGER tg_event_checkpoints_guard ON runledger.event_checkpoints;
DROP TRIGGER tg_event_checkpoints_no_truncate ON runledger.event_checkpoints;
DROP TRIGGER tg_event_checkpoint_heads_guard ON runledger.event_checkpoint_heads;
DROP TRIGGER tg_event_checkpoint_heads_no_truncate ON runledger.event_checkpoint_heads;
DROP TRIGGER tg_event_chain_prunes_guard ON runledger.event_chain_prunes;
DROP TRIGGER tg_event_chain_prunes_no_truncate ON runledger.event_chain_prunes;
DROP FUNCTION runledger._guard_event_chain();
DROP FUNCTION runledger.checkpoint_events(text, interval);

CREATE OR REPLACE FUNCTION runledger._event(p_run_id text, p_kind text, p_actor text,
                                 p_fencing_token bigint, p_state_version bigint,
                                 p_detail jsonb, p_at timestamptz DEFAULT NULL) RETURNS void
LANGUAGE plpgsql
AS $$
DECLARE
    v_id bigint;
BEGIN
    INSERT INTO runledger.run_events (run_id, at, kind, actor, fencing_token, state_version, detail)
    VALUES (p_run_id, coalesce(p_at, runledger.now()), p_kind, p_actor, p_fencing_token,
            p_state_version, coalesce(p_detail, '{}'::jsonb))
    RETURNING event_id INTO v_id;
    IF p_kind NOT IN ('call_dispatched', 'call_succeeded', 'call_failed', 'call_not_applied',
                      'turn_recorded', 'checkpoint', 'claimed') THEN
        PERFORM pg_notify('runledger_events', v_id || ' ' || p_run_id || ' ' || p_kind);
    END IF;
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
    -- revision 0010: a lease of an earlier timeline is not renewed (its writes are refused)
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
        -- lock in a fixed order so two renewals never wait on each other in a cycle
        SELECT l.run_id FROM runledger.runs l JOIN wanted w ON w.run_id = l.run_id
        WHERE l.lease_id = w.lease_id AND l.lease_owner = p_worker_id
          AND l.status = 'running' AND l.lease_expires_at > v_now AND l.fencing_token > v_floor
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

CREATE OR REPLACE FUNCTION runledger.prune_runs(p_before timestamptz, p_keep_events boolean)
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
    v_txid := txid_current();
    INSERT INTO runledger.prune_authorizations (txid) VALUES (v_txid) ON CONFLICT DO NOTHING;
    WITH gone AS (
        DELETE FROM runledger.runs x
        WHERE x.status IN ('succeeded', 'failed', 'cancelled') AND x.finished_at < p_before
        RETURNING x.run_id
    ), events AS (
        DELETE FROM runledger.run_events e
        WHERE NOT coalesce(p_keep_events, false) AND e.run_id IN (SELECT g.run_id FROM gone g)
    )
    SELECT count(*) INTO v_count FROM gone;
    DELETE FROM runledger.prune_authorizations a WHERE a.txid = v_txid;
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
    )
    SELECT count(*) INTO v_count FROM gone;
    DELETE FROM runledger.prune_authorizations a WHERE a.txid = v_txid;
    RETURN v_count;
END
$$;

DROP FUNCTION runledger._checkpoint_digest(bytea, bigint, bigint, text);
DROP FUNCTION runledger._event_hash(bytea, bigint, text, timestamptz, text, text, bigint, bigint,
                                    jsonb);
DROP TABLE runledger.event_chain_prunes;
DROP TABLE runledger.event_checkpoint_heads;
DROP TABLE runledger.event_checkpoints;
ALTER TABLE runledger.run_events DROP CONSTRAINT ck_run_events_hash, DROP COLUMN hash;
