-- runledger 0013 down: back to 0012 exactly (runledger_worker cannot read the revision).

DO $revoke$
BEGIN
    IF EXISTS (SELECT 1 FROM pg_roles WHERE rolname = 'runledger_worker') THEN
        REVOKE SELECT ON runledger.alembic_version FROM runledger_worker;
    END IF;
END
$revoke$;
