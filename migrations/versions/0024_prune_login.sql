-- runledger 0024: who pruned. Each event chain prune_runs deletes (p_keep_events false)
-- records the database login that deleted it, next to when: event_chain_prunes.pruned_by
-- (session_user; NULL for the chains pruned before this revision). prune_runs calls
-- prune_runs_v2, so both record it; their signatures and results are unchanged.
-- Frozen once merged: change things in a new revision (and in the living files).

ALTER TABLE runledger.event_chain_prunes ADD COLUMN pruned_by text;

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
        -- revision 0016: each deleted chain, so that audit tells it from a tampered one;
        -- revision 0024: and the database login that deleted it (session_user: this
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
