-- Undo 0001: everything in schema runledger except Alembic's version table.
-- Roles are cluster-wide and shared with other databases: they stay.
DROP VIEW IF EXISTS runledger.lease_history, runledger.effect_ledger, runledger.run_timeline;
DROP TABLE IF EXISTS runledger.run_calls, runledger.run_turns, runledger.run_events,
    runledger.workers, runledger.runs, runledger.settings CASCADE;
DO $drop$
DECLARE
    v_fn regprocedure;
BEGIN
    FOR v_fn IN SELECT p.oid::regprocedure FROM pg_proc p
                WHERE p.pronamespace = 'runledger'::regnamespace LOOP
        EXECUTE format('DROP FUNCTION %s CASCADE', v_fn);
    END LOOP;
END
$drop$;
