-- runledger 0012 down: back to 0011 exactly (the auditor executes no function; no index
-- on created_at).

DROP INDEX runledger.ix_runs_created_at;

DO $roles$
BEGIN
    IF EXISTS (SELECT 1 FROM pg_roles WHERE rolname = 'runledger_auditor') THEN
        REVOKE EXECUTE ON FUNCTION runledger.now() FROM runledger_auditor;
    END IF;
END
$roles$;
