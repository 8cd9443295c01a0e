-- runledger 0005 down: back to 0004 exactly. Drops record_turn_v2, the columns
-- run_turns.record, run_turns.output and run_calls.provider_id (and what they held), and
-- restores _cap and _guard_run_calls as 0004 left them.

DROP FUNCTION runledger.record_turn_v2(text, uuid, bigint, int, jsonb, jsonb, jsonb);

CREATE OR REPLACE FUNCTION runledger._cap(p_name text) RETURNS integer
LANGUAGE sql IMMUTABLE
SET search_path = pg_catalog, runledger, pg_temp
AS $$
    SELECT CASE p_name
        WHEN 'worker_id' THEN 200
        WHEN 'hostname' THEN 255
        WHEN 'actor' THEN 200
        WHEN 'release_reason' THEN 200
        WHEN 'reason' THEN 1000
        WHEN 'note' THEN 4000
        WHEN 'operation' THEN 100
        WHEN 'message' THEN 4000
        WHEN 'idempotency_key' THEN 300
        WHEN 'flows' THEN 1000
        WHEN 'run_ids' THEN 10000
    END
$$;

CREATE OR REPLACE FUNCTION runledger._guard_run_calls() RETURNS trigger
LANGUAGE plpgsql SECURITY DEFINER
SET search_path = pg_catalog, runledger, pg_temp
AS $$
BEGIN
    IF TG_OP = 'DELETE' THEN
        IF NOT runledger._prune_authorized() THEN
            PERFORM runledger._raise('RL007',
                format('calls are deleted only by runledger.prune_runs (%s)', OLD.idempotency_key),
                NULL, 'a session setting does not authorize a delete');
        END IF;
        RETURN OLD;
    END IF;
    IF NEW.idempotency_key <> OLD.idempotency_key OR NEW.run_id <> OLD.run_id
       OR NEW.turn <> OLD.turn OR NEW.call_id <> OLD.call_id OR NEW.tool <> OLD.tool
       OR NEW.args <> OLD.args THEN
        PERFORM runledger._raise('RL007',
            format('call %s: key, tool and args are immutable', OLD.idempotency_key), NULL, NULL);
    END IF;
    IF OLD.status = 'succeeded' AND (NEW.status <> OLD.status
        OR NEW.result IS DISTINCT FROM OLD.result OR NEW.receipt IS DISTINCT FROM OLD.receipt) THEN
        PERFORM runledger._raise('RL007',
            format('call %s succeeded; its result and receipt cannot be overwritten',
                   OLD.idempotency_key),
            format('receipt %s', OLD.receipt), NULL);
    END IF;
    IF NEW.attempts < OLD.attempts THEN
        PERFORM runledger._raise('RL007',
            format('attempts of call %s cannot decrease', OLD.idempotency_key), NULL, NULL);
    END IF;
    RETURN NEW;
END
$$;

ALTER TABLE runledger.run_calls DROP COLUMN provider_id;
ALTER TABLE runledger.run_turns DROP CONSTRAINT ck_run_turns_output_final;
ALTER TABLE runledger.run_turns DROP CONSTRAINT ck_run_turns_record_object;
ALTER TABLE runledger.run_turns DROP COLUMN output;
ALTER TABLE runledger.run_turns DROP COLUMN record;
