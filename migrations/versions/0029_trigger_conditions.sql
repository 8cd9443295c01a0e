-- runledger 0029: the WHEN of each guard trigger that the contract functions' UPDATEs fire
-- (tg_runs_guard, tg_runs_guard_columns, tg_run_calls_guard) calls a PL/pgSQL function
-- (runledger._tw_<trigger>) whose body is the condition as before: a small node for
-- PostgreSQL to read and prepare in every statement that fires the trigger, instead of
-- the whole condition. The same rows fire the same guards, with the same refusals. The
-- functions are executable by PUBLIC (a WHEN runs with the writer's rights), pure, every
-- operator schema-qualified.
-- Frozen once merged: change things in a new revision (and in the living files).

CREATE FUNCTION runledger._tw_runs_guard(old_token bigint, new_token bigint,
                                         old_version bigint, new_version bigint)
RETURNS boolean LANGUAGE plpgsql IMMUTABLE PARALLEL SAFE
AS $$ BEGIN
    RETURN new_token OPERATOR(pg_catalog.<) old_token
           OR new_version OPERATOR(pg_catalog.<) old_version
           OR new_version OPERATOR(pg_catalog.>) (old_version OPERATOR(pg_catalog.+) 1);
END $$;

CREATE FUNCTION runledger._tw_runs_guard_columns(old_run_id text, new_run_id text,
                                                 old_version bigint, new_version bigint,
                                                 old_state jsonb, new_state jsonb,
                                                 old_flow text, new_flow text,
                                                 old_flow_version text, new_flow_version text,
                                                 old_input jsonb, new_input jsonb)
RETURNS boolean LANGUAGE plpgsql IMMUTABLE PARALLEL SAFE
AS $$ BEGIN
    RETURN new_run_id OPERATOR(pg_catalog.<>) old_run_id
           OR (new_version OPERATOR(pg_catalog.<>) (old_version OPERATOR(pg_catalog.+) 1)
               AND CASE WHEN new_state IS NULL OR old_state IS NULL
                        THEN (new_state IS NULL) OPERATOR(pg_catalog.<>) (old_state IS NULL)
                        ELSE NOT (new_state OPERATOR(pg_catalog.=) old_state) END)
           OR new_flow OPERATOR(pg_catalog.<>) old_flow
           OR new_flow_version OPERATOR(pg_catalog.<>) old_flow_version
           OR new_input OPERATOR(pg_catalog.<>) old_input;
END $$;

CREATE FUNCTION runledger._tw_run_calls_guard(old_status text, old_attempts integer,
                                              new_attempts integer, old_approval text,
                                              new_approval text)
RETURNS boolean LANGUAGE plpgsql IMMUTABLE PARALLEL SAFE
AS $$ BEGIN
    RETURN old_status OPERATOR(pg_catalog.=) 'succeeded'
           OR new_attempts OPERATOR(pg_catalog.<) old_attempts
           OR old_approval IS NOT NULL OR new_approval IS NOT NULL;
END $$;

REVOKE ALL ON FUNCTION runledger._tw_runs_guard(bigint, bigint, bigint, bigint) FROM PUBLIC;
REVOKE ALL ON FUNCTION runledger._tw_runs_guard_columns(text, text, bigint, bigint, jsonb, jsonb, text, text, text, text, jsonb, jsonb) FROM PUBLIC;
REVOKE ALL ON FUNCTION runledger._tw_run_calls_guard(text, integer, integer, text, text) FROM PUBLIC;
GRANT EXECUTE ON FUNCTION runledger._tw_runs_guard(bigint, bigint, bigint, bigint) TO PUBLIC;
GRANT EXECUTE ON FUNCTION runledger._tw_runs_guard_columns(text, text, bigint, bigint, jsonb, jsonb, text, text, text, text, jsonb, jsonb) TO PUBLIC;
GRANT EXECUTE ON FUNCTION runledger._tw_run_calls_guard(text, integer, integer, text, text) TO PUBLIC;

DROP TRIGGER tg_runs_guard ON runledger.runs;
CREATE TRIGGER tg_runs_guard BEFORE UPDATE ON runledger.runs
    FOR EACH ROW
    WHEN (runledger._tw_runs_guard(OLD.fencing_token, NEW.fencing_token, OLD.state_version,
                                   NEW.state_version))
    EXECUTE FUNCTION runledger._guard_runs();
ALTER TABLE runledger.runs ENABLE ALWAYS TRIGGER tg_runs_guard;
DROP TRIGGER tg_runs_guard_columns ON runledger.runs;
CREATE TRIGGER tg_runs_guard_columns
    BEFORE UPDATE OF run_id, state, flow, flow_version, input ON runledger.runs
    FOR EACH ROW
    WHEN (runledger._tw_runs_guard_columns(OLD.run_id, NEW.run_id, OLD.state_version,
                                           NEW.state_version, OLD.state, NEW.state, OLD.flow,
                                           NEW.flow, OLD.flow_version, NEW.flow_version,
                                           OLD.input, NEW.input))
    EXECUTE FUNCTION runledger._guard_runs();
ALTER TABLE runledger.runs ENABLE ALWAYS TRIGGER tg_runs_guard_columns;
DROP TRIGGER tg_run_calls_guard ON runledger.run_calls;
CREATE TRIGGER tg_run_calls_guard BEFORE UPDATE ON runledger.run_calls
    FOR EACH ROW
    WHEN (runledger._tw_run_calls_guard(OLD.status, OLD.attempts, NEW.attempts, OLD.approval,
                                        NEW.approval))
    EXECUTE FUNCTION runledger._guard_run_calls();
ALTER TABLE runledger.run_calls ENABLE ALWAYS TRIGGER tg_run_calls_guard;
