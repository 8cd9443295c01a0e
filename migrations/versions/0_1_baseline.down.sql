-- Undo the baseline: everything in schema runledger except Alembic's version table.
-- Roles are cluster-wide and shared with other databases: they stay.
DROP VIEW IF EXISTS runledger.lease_history, runledger.effect_ledger, runledger.run_timeline;
DO $drop$
DECLARE
    v_table regclass;
    v_fn regprocedure;
BEGIN
    FOR v_table IN SELECT c.oid::regclass FROM pg_class c
                   WHERE c.relnamespace = 'runledger'::regnamespace AND c.relkind = 'r'
                     AND c.relname <> 'alembic_version' LOOP
        EXECUTE format('DROP TABLE IF EXISTS %s CASCADE', v_table);
    END LOOP;
    FOR v_fn IN SELECT p.oid::regprocedure FROM pg_proc p
                WHERE p.pronamespace = 'runledger'::regnamespace LOOP
        EXECUTE format('DROP FUNCTION %s CASCADE', v_fn);
    END LOOP;
END
$drop$;
