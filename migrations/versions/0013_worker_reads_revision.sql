-- runledger 0013: runledger_worker may read runledger.alembic_version. A worker checks
-- the schema revision when it connects (Store.connect, and the worker's /readyz): a
-- login user in the role alone (deploy/roles.sql), without the owner's privileges, was
-- refused there and could not start. Nothing else changes.
-- Frozen once merged: change things in a new revision (and in the living files).

DO $grant$
BEGIN
    IF EXISTS (SELECT 1 FROM pg_roles WHERE rolname = 'runledger_worker') THEN
        GRANT SELECT ON runledger.alembic_version TO runledger_worker;
    END IF;
END
$grant$;
