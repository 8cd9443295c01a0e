-- runledger 0012 down: back to 0011 exactly (runledger_worker cannot read the revision).

DO $revoke$
BEGIN
    IF EXISTS (SELECT 1 FROM pg_roles WHERE rolname = 'runledger_worker') THEN
        REVOKE SELECT ON runledger.alembic_version FROM runledger_worker;
    END IF;
END
$revoke$;
