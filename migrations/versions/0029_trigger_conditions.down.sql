-- runledger 0029 down: the guard triggers' WHEN clauses inline again.

DROP TRIGGER tg_runs_guard ON runledger.runs;
CREATE TRIGGER tg_runs_guard BEFORE UPDATE ON runledger.runs
    FOR EACH ROW
    WHEN (NEW.fencing_token < OLD.fencing_token
          OR NEW.state_version < OLD.state_version
          OR NEW.state_version > OLD.state_version + 1)
    EXECUTE FUNCTION runledger._guard_runs();
ALTER TABLE runledger.runs ENABLE ALWAYS TRIGGER tg_runs_guard;
DROP TRIGGER tg_runs_guard_columns ON runledger.runs;
CREATE TRIGGER tg_runs_guard_columns
    BEFORE UPDATE OF run_id, state, flow, flow_version, input ON runledger.runs
    FOR EACH ROW
    WHEN (NEW.run_id <> OLD.run_id
          OR (NEW.state_version <> OLD.state_version + 1 AND NEW.state IS DISTINCT FROM OLD.state)
          OR NEW.flow <> OLD.flow OR NEW.flow_version <> OLD.flow_version
          OR NEW.input <> OLD.input)
    EXECUTE FUNCTION runledger._guard_runs();
ALTER TABLE runledger.runs ENABLE ALWAYS TRIGGER tg_runs_guard_columns;
DROP TRIGGER tg_run_calls_guard ON runledger.run_calls;
CREATE TRIGGER tg_run_calls_guard BEFORE UPDATE ON runledger.run_calls
    FOR EACH ROW
    WHEN (OLD.status = 'succeeded' OR NEW.attempts < OLD.attempts
          OR OLD.approval IS NOT NULL OR NEW.approval IS NOT NULL)
    EXECUTE FUNCTION runledger._guard_run_calls();
ALTER TABLE runledger.run_calls ENABLE ALWAYS TRIGGER tg_run_calls_guard;

DROP FUNCTION runledger._tw_runs_guard(bigint, bigint, bigint, bigint);
DROP FUNCTION runledger._tw_runs_guard_columns(text, text, bigint, bigint, jsonb, jsonb, text, text, text, text, jsonb, jsonb);
DROP FUNCTION runledger._tw_run_calls_guard(text, integer, integer, text, text);
