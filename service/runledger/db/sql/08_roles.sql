-- ---------------------------------------------------------------------------------
-- Privileges and roles
-- ---------------------------------------------------------------------------------

REVOKE ALL ON ALL FUNCTIONS IN SCHEMA runledger FROM PUBLIC;
-- The functions the CHECK constraints call, to anyone who may write the
-- tables (a CHECK's function is executed with the writer's rights). Pure functions of
-- their arguments, every name in them schema-qualified: nothing to gain by calling them.
GRANT EXECUTE ON FUNCTION runledger._ck_runs_run_id(text) TO PUBLIC;
GRANT EXECUTE ON FUNCTION runledger._ck_runs_status(text) TO PUBLIC;
GRANT EXECUTE ON FUNCTION runledger._ck_runs_input_object(jsonb) TO PUBLIC;
GRANT EXECUTE ON FUNCTION runledger._ck_runs_state_object(jsonb) TO PUBLIC;
GRANT EXECUTE ON FUNCTION runledger._ck_runs_lease_complete(uuid, timestamptz) TO PUBLIC;
GRANT EXECUTE ON FUNCTION runledger._ck_runs_running_has_lease(text, uuid) TO PUBLIC;
GRANT EXECUTE ON FUNCTION runledger._ck_runs_finished_at(text, timestamptz) TO PUBLIC;
GRANT EXECUTE ON FUNCTION runledger._ck_runs_traceparent(text) TO PUBLIC;
GRANT EXECUTE ON FUNCTION runledger._ck_run_turns_turn(integer) TO PUBLIC;
GRANT EXECUTE ON FUNCTION runledger._ck_run_turns_calls_array(jsonb) TO PUBLIC;
GRANT EXECUTE ON FUNCTION runledger._ck_run_turns_record_object(jsonb) TO PUBLIC;
GRANT EXECUTE ON FUNCTION runledger._ck_run_turns_output_final(jsonb, jsonb) TO PUBLIC;
GRANT EXECUTE ON FUNCTION runledger._ck_run_calls_status(text) TO PUBLIC;
GRANT EXECUTE ON FUNCTION runledger._ck_run_calls_args_object(jsonb) TO PUBLIC;
GRANT EXECUTE ON FUNCTION runledger._ck_run_calls_attempts(integer) TO PUBLIC;
GRANT EXECUTE ON FUNCTION runledger._ck_run_calls_key(text, text, integer, text) TO PUBLIC;
GRANT EXECUTE ON FUNCTION runledger._ck_run_calls_approval(text) TO PUBLIC;
GRANT EXECUTE ON FUNCTION runledger._ck_run_calls_approval_status(text, text) TO PUBLIC;
GRANT EXECUTE ON FUNCTION runledger._ck_run_calls_approval_decided(text, text, timestamptz, text) TO PUBLIC;
GRANT EXECUTE ON FUNCTION runledger._ck_run_events_hash(bytea) TO PUBLIC;
-- what the guard triggers' WHEN clauses call
GRANT EXECUTE ON FUNCTION runledger._tw_runs_guard(bigint, bigint, bigint, bigint) TO PUBLIC;
GRANT EXECUTE ON FUNCTION runledger._tw_runs_guard_columns(text, text, bigint, bigint, jsonb, jsonb, text, text, text, text, jsonb, jsonb) TO PUBLIC;
GRANT EXECUTE ON FUNCTION runledger._tw_run_calls_guard(text, integer, integer, text, text) TO PUBLIC;
REVOKE ALL ON ALL TABLES IN SCHEMA runledger FROM PUBLIC;

-- runledger.prune_authorizations is granted to no one: it is written by prune_runs and read
-- by the guard triggers, both as the owner (06_wall.sql). The SELECT ON ALL TABLES below
-- would include it, so it is taken back at once.

DO $roles$
DECLARE
    v_role text;
BEGIN
    FOREACH v_role IN ARRAY ARRAY['runledger_worker', 'runledger_operator', 'runledger_auditor'] LOOP
        IF NOT EXISTS (SELECT 1 FROM pg_roles WHERE rolname = v_role) THEN
            BEGIN
                EXECUTE format('CREATE ROLE %I NOLOGIN', v_role);
            EXCEPTION WHEN insufficient_privilege OR duplicate_object THEN
                RAISE WARNING 'runledger: could not create role % (%); create it as an admin and run "runledger migrate" again, or grant privileges by hand',
                    v_role, SQLERRM;
            END;
        END IF;
    END LOOP;

    IF EXISTS (SELECT 1 FROM pg_roles WHERE rolname = 'runledger_auditor') THEN
        GRANT USAGE ON SCHEMA runledger TO runledger_auditor;
        GRANT SELECT ON ALL TABLES IN SCHEMA runledger TO runledger_auditor;
        REVOKE ALL ON runledger.prune_authorizations FROM runledger_auditor;
        -- the clock, which every read of the CLI judges by (read-only)
        GRANT EXECUTE ON FUNCTION runledger.now() TO runledger_auditor;
    END IF;
    IF EXISTS (SELECT 1 FROM pg_roles WHERE rolname = 'runledger_worker') THEN
        -- alembic_version: a worker checks the schema revision when it connects (and
        -- /readyz does); without it a worker logged in in this role cannot start.
        GRANT USAGE ON SCHEMA runledger TO runledger_worker;
        GRANT SELECT ON runledger.runs, runledger.run_turns, runledger.run_calls,
                        runledger.run_events, runledger.workers, runledger.settings,
                        runledger.timelines, runledger.failover_runs,
                        runledger.commit_guarantees,
                        runledger.event_checkpoints, runledger.event_checkpoint_heads,
                        runledger.event_chain_prunes, runledger.event_checkpoint_prunes,
                        runledger.run_timeline, runledger.effect_ledger, runledger.lease_history,
                        runledger.alembic_version
            TO runledger_worker;
        GRANT EXECUTE ON FUNCTION
            runledger.now(),
            runledger.submit_run(text, text, text, jsonb, int, timestamptz),
            runledger.submit_run_v2(text, text, text, jsonb, int, timestamptz, text),
            runledger.claim_runs_v4(text, text[], interval, int),
            runledger.renew_leases(text, text[], uuid[], interval),
            runledger.checkpoint(text, uuid, bigint, bigint, jsonb),
            runledger.record_turn_v4(text, uuid, bigint, int, jsonb, jsonb, jsonb, bigint, jsonb,
                                     boolean, text[]),
            runledger.finish_and_claim(text, uuid, bigint, int, jsonb, jsonb, bigint, jsonb, text,
                                       text[], interval, int),
            runledger.dispatch_call(text, uuid, bigint, text),
            runledger.complete_call(text, uuid, bigint, text, text, jsonb, jsonb),
            runledger.complete_call_v2(text, uuid, bigint, text, text, jsonb, jsonb, text),
            runledger.complete_calls(text, uuid, bigint, text[], text[], jsonb[], jsonb[], text),
            runledger.finish_run(text, uuid, bigint, text, jsonb, text),
            runledger.release_lease(text, uuid, bigint),
            runledger.release_lease(text, uuid, bigint, text, jsonb),
            runledger.release_stale_lease(text, uuid, bigint, text),
            runledger.report_stale_write(text, text, uuid, bigint, text, text),
            runledger.register_worker_v2(text, text, int, text[], boolean, text, uuid, boolean,
                                         interval, text),
            runledger.call_sender(text, uuid, bigint, text),
            runledger.release_call(text, uuid, bigint, text, text, jsonb),
            runledger.heartbeat_listener(text),
            runledger.heartbeat_worker(text, boolean, uuid, interval),
            runledger.checkpoint_events(text, interval)
        TO runledger_worker;
    END IF;
    IF EXISTS (SELECT 1 FROM pg_roles WHERE rolname = 'runledger_operator') THEN
        IF EXISTS (SELECT 1 FROM pg_roles WHERE rolname = 'runledger_worker')
           AND NOT pg_has_role('runledger_operator', 'runledger_worker', 'MEMBER') THEN
            BEGIN
                GRANT runledger_worker TO runledger_operator;
            EXCEPTION WHEN insufficient_privilege THEN
                RAISE WARNING 'runledger: could not make runledger_operator a member of runledger_worker (%); grant it as an admin',
                    SQLERRM;
            END;
        END IF;
        GRANT USAGE ON SCHEMA runledger TO runledger_operator;
        GRANT SELECT ON ALL TABLES IN SCHEMA runledger TO runledger_operator;
        REVOKE ALL ON runledger.prune_authorizations FROM runledger_operator;
        GRANT EXECUTE ON FUNCTION
            runledger.now(),
            runledger.submit_run(text, text, text, jsonb, int, timestamptz),
            runledger.submit_run_v2(text, text, text, jsonb, int, timestamptz, text),
            runledger.resolve_call(text, text, jsonb, text, text),
            runledger.approve_call(text, text, text),
            runledger.deny_call(text, text, text),
            runledger.cancel_run(text, text, text),
            runledger.retry_run(text, text),
            runledger.prune_runs(timestamptz, boolean),
            runledger.prune_runs_v2(timestamptz, boolean, integer),
            runledger.prune_records(timestamptz, boolean, integer)
        TO runledger_operator;
    END IF;
END
$roles$;
