-- runledger 0004: the delete guards cannot be switched off by a session setting.
-- Before: the guards of runs, run_turns, run_calls and run_events let a DELETE through
-- when the transaction-local setting runledger.pruning was 'on', which any session may
-- set. Now prune_runs writes the id of its transaction to the new table
-- runledger.prune_authorizations (granted to no one; its own guard refuses a writer that
-- is not the owner and a row for another transaction) and removes it before returning;
-- the guards look for that row. The guard of runs also refuses to delete a run that is
-- not finished. Frozen once merged: change things in a new revision (and in the living
-- files).

CREATE TABLE runledger.prune_authorizations (
    txid bigint NOT NULL,
    CONSTRAINT pk_prune_authorizations PRIMARY KEY (txid)
);

REVOKE ALL ON TABLE runledger.prune_authorizations FROM PUBLIC;

CREATE FUNCTION runledger._prune_authorized() RETURNS boolean
LANGUAGE sql STABLE
SET search_path = pg_catalog, runledger, pg_temp
AS $$
    SELECT EXISTS (SELECT 1 FROM runledger.prune_authorizations a
                   WHERE a.txid = txid_current_if_assigned())
$$;

CREATE FUNCTION runledger._guard_prune_authorizations() RETURNS trigger
LANGUAGE plpgsql
SET search_path = pg_catalog, runledger, pg_temp
AS $$
BEGIN
    IF NOT pg_has_role(current_user,
                       (SELECT c.relowner FROM pg_class c WHERE c.oid = TG_RELID), 'USAGE') THEN
        RAISE EXCEPTION USING ERRCODE = 'RL007',
            MESSAGE = format('prune authorizations are written only by runledger.prune_runs (%s refused for %s)',
                             TG_OP, current_user),
            HINT = 'call runledger.prune_runs(before, keep_events)';
    END IF;
    IF NEW.txid IS DISTINCT FROM txid_current() THEN
        RAISE EXCEPTION USING ERRCODE = 'RL007',
            MESSAGE = format('a prune authorization is for the current transaction only (%s, not %s)',
                             txid_current(), NEW.txid);
    END IF;
    RETURN NEW;
END
$$;
CREATE TRIGGER tg_prune_authorizations_guard BEFORE INSERT OR UPDATE
    ON runledger.prune_authorizations
    FOR EACH ROW EXECUTE FUNCTION runledger._guard_prune_authorizations();
ALTER TABLE runledger.prune_authorizations ENABLE ALWAYS TRIGGER tg_prune_authorizations_guard;

REVOKE ALL ON FUNCTION runledger._prune_authorized() FROM PUBLIC;
REVOKE ALL ON FUNCTION runledger._guard_prune_authorizations() FROM PUBLIC;

-- Changed bodies (grants and triggers stay as they are).

CREATE OR REPLACE FUNCTION runledger._guard_runs() RETURNS trigger
LANGUAGE plpgsql SECURITY DEFINER
SET search_path = pg_catalog, runledger, pg_temp
AS $$
BEGIN
    IF TG_OP = 'DELETE' THEN
        IF NOT runledger._prune_authorized() THEN
            PERFORM runledger._raise('RL007',
                format('runs are deleted only by runledger.prune_runs (run %s)', OLD.run_id),
                NULL, 'a session setting does not authorize a delete');
        END IF;
        IF OLD.status NOT IN ('succeeded', 'failed', 'cancelled') THEN
            PERFORM runledger._raise('RL007',
                format('run %s is %s: only finished runs are pruned', OLD.run_id, OLD.status),
                NULL, NULL);
        END IF;
        RETURN OLD;
    END IF;
    IF NEW.run_id <> OLD.run_id THEN
        PERFORM runledger._raise('RL007', format('run id %s cannot change', OLD.run_id), NULL, NULL);
    END IF;
    IF NEW.fencing_token < OLD.fencing_token THEN
        PERFORM runledger._raise('RL007',
            format('fencing_token of run %s cannot decrease', OLD.run_id),
            format('from %s to %s', OLD.fencing_token, NEW.fencing_token), NULL);
    END IF;
    IF NEW.state_version < OLD.state_version THEN
        PERFORM runledger._raise('RL007',
            format('state_version of run %s cannot decrease', OLD.run_id),
            format('from %s to %s', OLD.state_version, NEW.state_version), NULL);
    END IF;
    IF NEW.state_version > OLD.state_version + 1 THEN
        PERFORM runledger._raise('RL007',
            format('state_version of run %s moves by one at a time', OLD.run_id),
            format('from %s to %s', OLD.state_version, NEW.state_version), NULL);
    END IF;
    IF NEW.state IS DISTINCT FROM OLD.state AND NEW.state_version <> OLD.state_version + 1 THEN
        PERFORM runledger._raise('RL007',
            format('a change of state on run %s must bump state_version by exactly one', OLD.run_id),
            format('state_version %s -> %s', OLD.state_version, NEW.state_version), NULL);
    END IF;
    IF NEW.flow <> OLD.flow OR NEW.flow_version <> OLD.flow_version OR NEW.input <> OLD.input THEN
        PERFORM runledger._raise('RL007',
            format('flow, version and input of run %s are pinned', OLD.run_id), NULL, NULL);
    END IF;
    RETURN NEW;
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

CREATE OR REPLACE FUNCTION runledger._guard_run_turns() RETURNS trigger
LANGUAGE plpgsql SECURITY DEFINER
SET search_path = pg_catalog, runledger, pg_temp
AS $$
BEGIN
    IF TG_OP = 'DELETE' AND runledger._prune_authorized() THEN
        RETURN OLD;
    END IF;
    PERFORM runledger._raise('RL007',
        format('turn %s of run %s is a recorded decision and cannot change', OLD.turn, OLD.run_id),
        NULL, NULL);
    RETURN NULL;
END
$$;

CREATE OR REPLACE FUNCTION runledger._guard_run_events() RETURNS trigger
LANGUAGE plpgsql SECURITY DEFINER
SET search_path = pg_catalog, runledger, pg_temp
AS $$
BEGIN
    IF TG_OP = 'DELETE' AND runledger._prune_authorized() THEN
        RETURN OLD;
    END IF;
    PERFORM runledger._raise('RL007',
        format('run_events is append-only (%s refused)', TG_OP), NULL,
        'events are removed only by runledger.prune_runs');
    RETURN NULL;
END
$$;

CREATE OR REPLACE FUNCTION runledger.prune_runs(p_before timestamptz, p_keep_events boolean)
RETURNS integer
LANGUAGE plpgsql SECURITY DEFINER
SET search_path = pg_catalog, runledger, pg_temp
AS $$
DECLARE
    v_count integer;
    v_txid bigint;
BEGIN
    IF p_before IS NULL THEN
        PERFORM runledger._raise('RL006', 'before must not be null', NULL, NULL);
    END IF;
    v_txid := txid_current();
    INSERT INTO runledger.prune_authorizations (txid) VALUES (v_txid) ON CONFLICT DO NOTHING;
    WITH gone AS (
        DELETE FROM runledger.runs x
        WHERE x.status IN ('succeeded', 'failed', 'cancelled') AND x.finished_at < p_before
        RETURNING x.run_id
    ), events AS (
        DELETE FROM runledger.run_events e
        WHERE NOT coalesce(p_keep_events, false) AND e.run_id IN (SELECT g.run_id FROM gone g)
    )
    SELECT count(*) INTO v_count FROM gone;
    DELETE FROM runledger.prune_authorizations a WHERE a.txid = v_txid;
    RETURN v_count;
END
$$;
