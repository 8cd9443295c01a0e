-- runledger 0014: retention at scale (issue "Operate and observe"): prune_runs_v2 deletes
-- finished runs in batches (at most p_limit per call, oldest first, SKIP LOCKED), and
-- ix_runs_finished_at finds them without reading the table. Granted to
-- runledger_operator. prune_runs is unchanged.
-- Frozen once merged: change things in a new revision (and in the living files).

CREATE INDEX ix_runs_finished_at ON runledger.runs (finished_at) WHERE finished_at IS NOT NULL;
-- prune_runs_v2 (revision 0014): retention in batches. As prune_runs, but at most p_limit
-- runs (1-10000) per call, the oldest finished first (ix_runs_finished_at), each locked
-- with SKIP LOCKED: a run an operator holds is left for the next call, and no worker ever
-- waits on it (a worker holds only queued, running or paused runs, never touched here).
-- One call is one short transaction; `runledger prune` calls it until it returns fewer
-- than p_limit. Safe to repeat: a call whose acknowledgement was lost has deleted its
-- batch, and the next call deletes the next one. Events are kept unless p_keep_events is
-- false. Returns how many runs were deleted.
CREATE FUNCTION runledger.prune_runs_v2(p_before timestamptz, p_keep_events boolean,
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

REVOKE ALL ON FUNCTION runledger.prune_runs_v2(timestamptz, boolean, integer) FROM PUBLIC;
DO $roles$
BEGIN
    IF EXISTS (SELECT 1 FROM pg_roles WHERE rolname = 'runledger_operator') THEN
        GRANT EXECUTE ON FUNCTION runledger.prune_runs_v2(timestamptz, boolean, integer)
        TO runledger_operator;
    ELSE
        RAISE WARNING 'runledger: role runledger_operator does not exist; grant EXECUTE on runledger.prune_runs_v2 by hand';
    END IF;
END
$roles$;
