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
