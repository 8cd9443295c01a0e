-- Login users in runledger's three roles. Run it as an administrator (a role with
-- CREATEROLE, or the owner of the runledger schema on a managed server), after
-- `runledger migrate` has created the roles (service/runledger/db/sql/08_roles.sql):
--
--   psql "$ADMIN_URL" -v ON_ERROR_STOP=1 \
--        -v worker_password="$WORKER_PASSWORD" \
--        -v operator_password="$OPERATOR_PASSWORD" \
--        -v auditor_password="$AUDITOR_PASSWORD" \
--        -f deploy/roles.sql
--
-- It creates, or on a second run updates (it is re-runnable):
--   runledger_worker_login    IN ROLE runledger_worker    for `runledger worker`
--   runledger_operator_login  IN ROLE runledger_operator  for resolve, approve, cancel, list...
--   runledger_auditor_login   IN ROLE runledger_auditor   read only: tables and views
--
-- No password is in this file. A value may be the password itself or its SCRAM-SHA-256
-- verifier ('SCRAM-SHA-256$4096:...', which the server stores as is), so that the
-- password never reaches the server or its logs; deploy/README.md shows how to make one.
-- The users get nothing but their role: no superuser, no CREATEDB, no CREATEROLE, and
-- they inherit the role's privileges without SET ROLE.

\set ON_ERROR_STOP on

-- A variable that was not passed becomes empty, and the DO block refuses it by name.
\if :{?worker_password}
\else
\set worker_password ''
\endif
\if :{?operator_password}
\else
\set operator_password ''
\endif
\if :{?auditor_password}
\else
\set auditor_password ''
\endif

-- psql substitutes variables outside dollar quotes only: hand them to the DO block
-- through settings local to this transaction.
BEGIN;
SELECT set_config('runledger_roles.worker_password', :'worker_password', true),
       set_config('runledger_roles.operator_password', :'operator_password', true),
       set_config('runledger_roles.auditor_password', :'auditor_password', true)
\gset runledger_roles_ignored_

DO $login$
DECLARE
    v_user text;
    v_role text;
    v_password text;
BEGIN
    FOREACH v_role IN ARRAY ARRAY['runledger_worker', 'runledger_operator', 'runledger_auditor'] LOOP
        v_user := v_role || '_login';
        v_password := current_setting(
            'runledger_roles.' || replace(v_role, 'runledger_', '') || '_password');
        IF coalesce(v_password, '') = '' THEN
            RAISE EXCEPTION 'roles.sql: the password of % is empty', v_user
                USING HINT = 'pass -v ' || replace(v_role, 'runledger_', '') || '_password=...';
        END IF;
        IF NOT EXISTS (SELECT 1 FROM pg_roles WHERE rolname = v_role) THEN
            RAISE EXCEPTION 'roles.sql: role % does not exist', v_role
                USING HINT = 'run "runledger migrate" as the schema owner first';
        END IF;
        IF EXISTS (SELECT 1 FROM pg_roles WHERE rolname = v_user) THEN
            EXECUTE format('ALTER ROLE %I LOGIN NOSUPERUSER NOCREATEDB NOCREATEROLE INHERIT '
                           'NOREPLICATION NOBYPASSRLS PASSWORD %L', v_user, v_password);
        ELSE
            EXECUTE format('CREATE ROLE %I LOGIN NOSUPERUSER NOCREATEDB NOCREATEROLE INHERIT '
                           'NOREPLICATION NOBYPASSRLS PASSWORD %L', v_user, v_password);
        END IF;
        IF NOT pg_has_role(v_user, v_role, 'MEMBER') THEN
            EXECUTE format('GRANT %I TO %I', v_role, v_user);
        END IF;
        RAISE NOTICE 'roles.sql: % can log in, in role %', v_user, v_role;
    END LOOP;
END
$login$;
COMMIT;
