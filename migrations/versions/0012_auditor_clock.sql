-- runledger 0012: runledger_auditor may execute runledger.now(), the database clock that
-- every read command of the CLI (runledger list, show, workers, unknown, events) judges
-- leases and ages by. now() only reads the clock and runledger.settings (which the
-- auditor may read anyway); the auditor still executes no other function.
-- And ix_runs_created_at, for `runledger list` (newest first) on a large table.
-- Frozen once merged: change things in a new revision (and in the living files).

CREATE INDEX ix_runs_created_at ON runledger.runs (created_at, run_id);

DO $roles$
BEGIN
    IF EXISTS (SELECT 1 FROM pg_roles WHERE rolname = 'runledger_auditor') THEN
        GRANT EXECUTE ON FUNCTION runledger.now() TO runledger_auditor;
    ELSE
        RAISE WARNING 'runledger: role runledger_auditor does not exist; grant EXECUTE on runledger.now() by hand';
    END IF;
END
$roles$;
