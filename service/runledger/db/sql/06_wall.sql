-- ---------------------------------------------------------------------------------
-- The second wall: triggers that hold even for the owner's direct UPDATE
-- ---------------------------------------------------------------------------------
-- The guard functions are SECURITY DEFINER so that a refusal is always RL007 naming the
-- invariant: run as the writer, a role granted UPDATE on a table (a DBA role) would get
-- "permission denied for function _raise" instead, since helpers are not granted.
--
-- A DELETE passes only inside runledger.prune_runs (or prune_records, for the records the
-- runs leave behind): it writes the id of its transaction to
-- runledger.prune_authorizations (granted to no one) and removes it before returning.
-- No session setting stands in for that row. Who can still get past the wall: the owner
-- of the tables and superusers (they can write the authorization themselves, or disable,
-- drop or replace a trigger); docs/design.md, "The trigger wall", says what catches them.

-- True inside a prune_runs call of the current transaction (the guards' only door).
-- A helper, called by the guards and prune_runs (all pinned): no SET.
CREATE FUNCTION runledger._prune_authorized() RETURNS boolean
LANGUAGE sql STABLE
AS $$
    SELECT EXISTS (SELECT 1 FROM runledger.prune_authorizations a
                   WHERE a.txid = txid_current_if_assigned())
$$;

-- The authorization itself: written only by its owner's code (prune_runs), for the
-- current transaction. SECURITY INVOKER on purpose, to see who writes: a role that was
-- granted INSERT anyway (GRANT ... ON ALL TABLES IN SCHEMA runledger TO a DBA role) is
-- refused, and so is a row for another transaction id. RAISE directly: the writer may not
-- execute _raise.
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

-- The WHEN of each guard trigger that the contract functions' UPDATEs fire
-- (tg_runs_guard, tg_runs_guard_columns, tg_run_calls_guard) calls a PL/pgSQL function of
-- the values it reads, whose body is the condition, as the CHECKs do (01_tables.sql):
-- PostgreSQL reads and prepares a trigger's WHEN again in every statement that fires it,
-- and a function call is a small node to read, its body compiled once per session. The
-- same rows fire the guard, so the same refusals. A WHEN runs with the writer's rights, so
-- these are executable by PUBLIC (a role granted UPDATE on a table meets the guard's
-- RL007, not a permission error), pure functions of their arguments. An inline condition
-- is bound when the trigger is created; a function's body is parsed in the writer's
-- session, with the writer's search path, so every operator in them is schema-qualified.
CREATE FUNCTION runledger._tw_runs_guard(old_token bigint, new_token bigint,
                                         old_version bigint, new_version bigint)
RETURNS boolean LANGUAGE plpgsql IMMUTABLE PARALLEL SAFE
AS $$ BEGIN
    RETURN new_token OPERATOR(pg_catalog.<) old_token
           OR new_version OPERATOR(pg_catalog.<) old_version
           OR new_version OPERATOR(pg_catalog.>) (old_version OPERATOR(pg_catalog.+) 1);
END $$;

-- The columns one by one, not the rows: a whole row would be built (every value stored
-- out of line fetched) for each call. state IS DISTINCT FROM is spelled with pg_catalog's =
-- (IS DISTINCT FROM would look = up in the writer's path); the state is compared only
-- when the version did not move by one, as before.
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

CREATE FUNCTION runledger._guard_runs() RETURNS trigger
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
-- The guard is called only for a row it refuses, not for every write. Its
-- refusals are split over the WHEN clauses of two UPDATE triggers (together, every IF of
-- the function: false exactly when those IFs are, NULL included; kept short, since a
-- WHEN is prepared again in every statement), and DELETE has a trigger of its own. Both
-- UPDATE triggers run the whole function, so the refusal (the first failed check, in the
-- function's order) is the same as when it ran for every row.
-- tg_runs_guard_columns watches the columns no contract function writes, and state
-- (checkpoint): UPDATE OF skips it, and its jsonb comparisons, when the statement sets
-- none of them (a column left out of SET keeps its value: no other trigger of the table
-- changes NEW).
CREATE TRIGGER tg_runs_guard BEFORE UPDATE ON runledger.runs
    FOR EACH ROW
    WHEN (runledger._tw_runs_guard(OLD.fencing_token, NEW.fencing_token, OLD.state_version,
                                   NEW.state_version))
    EXECUTE FUNCTION runledger._guard_runs();
ALTER TABLE runledger.runs ENABLE ALWAYS TRIGGER tg_runs_guard;
CREATE TRIGGER tg_runs_guard_columns
    BEFORE UPDATE OF run_id, state, flow, flow_version, input ON runledger.runs
    FOR EACH ROW
    WHEN (runledger._tw_runs_guard_columns(OLD.run_id, NEW.run_id, OLD.state_version,
                                           NEW.state_version, OLD.state, NEW.state, OLD.flow,
                                           NEW.flow, OLD.flow_version, NEW.flow_version,
                                           OLD.input, NEW.input))
    EXECUTE FUNCTION runledger._guard_runs();
ALTER TABLE runledger.runs ENABLE ALWAYS TRIGGER tg_runs_guard_columns;
CREATE TRIGGER tg_runs_guard_delete BEFORE DELETE ON runledger.runs
    FOR EACH ROW EXECUTE FUNCTION runledger._guard_runs();
ALTER TABLE runledger.runs ENABLE ALWAYS TRIGGER tg_runs_guard_delete;

CREATE FUNCTION runledger._guard_run_calls() RETURNS trigger
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
       OR NEW.args <> OLD.args OR NEW.provider_id IS DISTINCT FROM OLD.provider_id THEN
        PERFORM runledger._raise('RL007',
            format('call %s: key, tool, args and provider id are immutable', OLD.idempotency_key),
            NULL, NULL);
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
    -- an approval moves pending -> approved or pending -> denied, once; who
    -- decided, when and why never change afterwards
    IF NEW.approval IS DISTINCT FROM OLD.approval
       AND NOT coalesce(OLD.approval = 'pending' AND NEW.approval IN ('approved', 'denied'),
                        false) THEN
        PERFORM runledger._raise('RL007',
            format('approval of call %s cannot move from %s to %s', OLD.idempotency_key,
                   coalesce(OLD.approval, 'NULL'), coalesce(NEW.approval, 'NULL')),
            NULL, 'a pending approval is decided once, by approve_call or deny_call');
    END IF;
    IF OLD.approval IN ('approved', 'denied')
       AND (NEW.approval_by IS DISTINCT FROM OLD.approval_by
            OR NEW.approval_note IS DISTINCT FROM OLD.approval_note
            OR NEW.approval_at IS DISTINCT FROM OLD.approval_at) THEN
        PERFORM runledger._raise('RL007',
            format('call %s was %s by %s: the decision cannot be rewritten', OLD.idempotency_key,
                   OLD.approval, OLD.approval_by), NULL, NULL);
    END IF;
    RETURN NEW;
END
$$;
-- As the guard of runs, but its WHEN is a short superset of the refusals:
-- a call that succeeded, attempts going down, or any approval (so approve_call, deny_call
-- and the writes of an approved call still run the function, which decides). A trigger's
-- WHEN is read and prepared again in every statement, so the guard's whole condition
-- there cost more than the call it saved. The immutable columns, which no contract
-- function sets, are watched by tg_run_calls_guard_columns.
CREATE TRIGGER tg_run_calls_guard BEFORE UPDATE ON runledger.run_calls
    FOR EACH ROW
    WHEN (runledger._tw_run_calls_guard(OLD.status, OLD.attempts, NEW.attempts, OLD.approval,
                                        NEW.approval))
    EXECUTE FUNCTION runledger._guard_run_calls();
ALTER TABLE runledger.run_calls ENABLE ALWAYS TRIGGER tg_run_calls_guard;
CREATE TRIGGER tg_run_calls_guard_columns
    BEFORE UPDATE OF idempotency_key, run_id, turn, call_id, tool, args, provider_id
    ON runledger.run_calls
    FOR EACH ROW
    WHEN (NEW.idempotency_key <> OLD.idempotency_key OR NEW.run_id <> OLD.run_id
          OR NEW.turn <> OLD.turn OR NEW.call_id <> OLD.call_id OR NEW.tool <> OLD.tool
          OR NEW.args <> OLD.args OR NEW.provider_id IS DISTINCT FROM OLD.provider_id)
    EXECUTE FUNCTION runledger._guard_run_calls();
ALTER TABLE runledger.run_calls ENABLE ALWAYS TRIGGER tg_run_calls_guard_columns;
CREATE TRIGGER tg_run_calls_guard_delete BEFORE DELETE ON runledger.run_calls
    FOR EACH ROW EXECUTE FUNCTION runledger._guard_run_calls();
ALTER TABLE runledger.run_calls ENABLE ALWAYS TRIGGER tg_run_calls_guard_delete;

CREATE FUNCTION runledger._guard_run_turns() RETURNS trigger
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
CREATE TRIGGER tg_run_turns_guard BEFORE UPDATE OR DELETE ON runledger.run_turns
    FOR EACH ROW EXECUTE FUNCTION runledger._guard_run_turns();
ALTER TABLE runledger.run_turns ENABLE ALWAYS TRIGGER tg_run_turns_guard;

CREATE FUNCTION runledger._guard_run_events() RETURNS trigger
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
CREATE TRIGGER tg_run_events_guard BEFORE UPDATE OR DELETE ON runledger.run_events
    FOR EACH ROW EXECUTE FUNCTION runledger._guard_run_events();
ALTER TABLE runledger.run_events ENABLE ALWAYS TRIGGER tg_run_events_guard;
CREATE TRIGGER tg_run_events_no_truncate BEFORE TRUNCATE ON runledger.run_events
    FOR EACH STATEMENT EXECUTE FUNCTION runledger._guard_run_events();
ALTER TABLE runledger.run_events ENABLE ALWAYS TRIGGER tg_run_events_no_truncate;

-- TRUNCATE fires no row trigger: without these, one statement by the owner would wipe
-- the journal that the DELETE guards above protect.
CREATE FUNCTION runledger._guard_truncate() RETURNS trigger
LANGUAGE plpgsql SECURITY DEFINER
SET search_path = pg_catalog, runledger, pg_temp
AS $$
BEGIN
    PERFORM runledger._raise('RL007',
        format('%s.%s cannot be truncated', TG_TABLE_SCHEMA, TG_TABLE_NAME), NULL,
        'runs, turns and calls are removed only by runledger.prune_runs');
    RETURN NULL;
END
$$;
CREATE TRIGGER tg_runs_no_truncate BEFORE TRUNCATE ON runledger.runs
    FOR EACH STATEMENT EXECUTE FUNCTION runledger._guard_truncate();
ALTER TABLE runledger.runs ENABLE ALWAYS TRIGGER tg_runs_no_truncate;
CREATE TRIGGER tg_run_turns_no_truncate BEFORE TRUNCATE ON runledger.run_turns
    FOR EACH STATEMENT EXECUTE FUNCTION runledger._guard_truncate();
ALTER TABLE runledger.run_turns ENABLE ALWAYS TRIGGER tg_run_turns_no_truncate;
CREATE TRIGGER tg_run_calls_no_truncate BEFORE TRUNCATE ON runledger.run_calls
    FOR EACH STATEMENT EXECUTE FUNCTION runledger._guard_truncate();
ALTER TABLE runledger.run_calls ENABLE ALWAYS TRIGGER tg_run_calls_no_truncate;


-- The record of failovers. runledger.timelines and commit_guarantees are append-only and
-- runledger.failover_runs too (its rows leave with their run, in prune_runs): without
-- them a failover would be forgotten, and with it the doubt on the calls of its runs. Both
-- are written only by their owner's code (the claim that detects a failover runs as the
-- owner): SECURITY INVOKER, to see who writes, and RAISE directly, as for the pruning
-- authorization (the writer may not execute _raise or _prune_authorized).
CREATE FUNCTION runledger._guard_failover_record() RETURNS trigger
LANGUAGE plpgsql
SET search_path = pg_catalog, runledger, pg_temp
AS $$
BEGIN
    IF NOT pg_has_role(current_user,
                       (SELECT c.relowner FROM pg_class c WHERE c.oid = TG_RELID), 'USAGE') THEN
        RAISE EXCEPTION USING ERRCODE = 'RL007',
            MESSAGE = format('%s is written only by runledger''s claims (%s refused for %s)',
                             TG_TABLE_NAME, TG_OP, current_user);
    END IF;
    IF TG_OP = 'INSERT' THEN
        RETURN NEW;
    END IF;
    IF TG_OP = 'DELETE' AND TG_TABLE_NAME = 'failover_runs' THEN
        IF runledger._prune_authorized() THEN
            RETURN OLD;
        END IF;
    END IF;
    -- retention (prune_records): never the newest row, which the next failover is judged by
    IF TG_OP = 'DELETE' AND TG_TABLE_NAME = 'commit_guarantees' THEN
        IF runledger._prune_authorized()
           AND OLD.position < (SELECT max(g.position) FROM runledger.commit_guarantees g) THEN
            RETURN OLD;
        END IF;
    END IF;
    RAISE EXCEPTION USING ERRCODE = 'RL007',
        MESSAGE = format('%s is append-only (%s refused)', TG_TABLE_NAME, TG_OP),
        HINT = 'failover_runs rows are removed with their run, by runledger.prune_runs; '
               'old commit_guarantees rows by runledger.prune_records';
END
$$;
CREATE TRIGGER tg_timelines_guard BEFORE INSERT OR UPDATE OR DELETE ON runledger.timelines
    FOR EACH ROW EXECUTE FUNCTION runledger._guard_failover_record();
ALTER TABLE runledger.timelines ENABLE ALWAYS TRIGGER tg_timelines_guard;
CREATE TRIGGER tg_timelines_no_truncate BEFORE TRUNCATE ON runledger.timelines
    FOR EACH STATEMENT EXECUTE FUNCTION runledger._guard_failover_record();
ALTER TABLE runledger.timelines ENABLE ALWAYS TRIGGER tg_timelines_no_truncate;
CREATE TRIGGER tg_commit_guarantees_guard BEFORE INSERT OR UPDATE OR DELETE
    ON runledger.commit_guarantees
    FOR EACH ROW EXECUTE FUNCTION runledger._guard_failover_record();
ALTER TABLE runledger.commit_guarantees ENABLE ALWAYS TRIGGER tg_commit_guarantees_guard;
CREATE TRIGGER tg_commit_guarantees_no_truncate BEFORE TRUNCATE ON runledger.commit_guarantees
    FOR EACH STATEMENT EXECUTE FUNCTION runledger._guard_failover_record();
ALTER TABLE runledger.commit_guarantees ENABLE ALWAYS TRIGGER tg_commit_guarantees_no_truncate;
CREATE TRIGGER tg_failover_runs_guard BEFORE INSERT OR UPDATE OR DELETE
    ON runledger.failover_runs
    FOR EACH ROW EXECUTE FUNCTION runledger._guard_failover_record();
ALTER TABLE runledger.failover_runs ENABLE ALWAYS TRIGGER tg_failover_runs_guard;
CREATE TRIGGER tg_failover_runs_no_truncate BEFORE TRUNCATE ON runledger.failover_runs
    FOR EACH STATEMENT EXECUTE FUNCTION runledger._guard_failover_record();
ALTER TABLE runledger.failover_runs ENABLE ALWAYS TRIGGER tg_failover_runs_no_truncate;


-- The checkpoints of the event chains are append-only but for retention, the record of
-- pruned chains is written only by prune_runs, and the record of pruned checkpoints only
-- by prune_records; rows of all four are deleted only by prune_records (checkpoint 0,
-- where the chains start, never). No role may write these tables directly; the guards
-- stop their owner too (a superuser who disables them is caught by audit against a
-- digest kept outside the database: docs/audit.md).
CREATE FUNCTION runledger._guard_event_chain() RETURNS trigger
LANGUAGE plpgsql SECURITY DEFINER
SET search_path = pg_catalog, runledger, pg_temp
AS $$
BEGIN
    IF TG_OP = 'INSERT' AND (TG_TABLE_NAME NOT IN ('event_chain_prunes', 'event_checkpoint_prunes')
                             OR runledger._prune_authorized()) THEN
        RETURN NEW;
    END IF;
    IF TG_OP = 'DELETE' AND runledger._prune_authorized() THEN
        IF TG_TABLE_NAME <> 'event_checkpoints' THEN
            RETURN OLD;
        END IF;
        IF OLD.checkpoint_id <> 0 THEN
            RETURN OLD;
        END IF;
    END IF;
    PERFORM runledger._raise('RL007',
        format('%s is append-only (%s refused)', TG_TABLE_NAME, TG_OP), NULL,
        CASE WHEN TG_TABLE_NAME = 'event_chain_prunes'
             THEN 'rows are written by runledger.prune_runs only'
             WHEN TG_TABLE_NAME = 'event_checkpoint_prunes'
             THEN 'rows are written by runledger.prune_records only'
             ELSE 'checkpoints are written by runledger.checkpoint_events only' END
        || '; old rows are deleted by runledger.prune_records, checkpoint 0 never');
    RETURN NULL;
END
$$;
CREATE TRIGGER tg_event_checkpoints_guard BEFORE UPDATE OR DELETE
    ON runledger.event_checkpoints
    FOR EACH ROW EXECUTE FUNCTION runledger._guard_event_chain();
ALTER TABLE runledger.event_checkpoints ENABLE ALWAYS TRIGGER tg_event_checkpoints_guard;
CREATE TRIGGER tg_event_checkpoints_no_truncate BEFORE TRUNCATE ON runledger.event_checkpoints
    FOR EACH STATEMENT EXECUTE FUNCTION runledger._guard_event_chain();
ALTER TABLE runledger.event_checkpoints ENABLE ALWAYS TRIGGER tg_event_checkpoints_no_truncate;
CREATE TRIGGER tg_event_checkpoint_heads_guard BEFORE UPDATE OR DELETE
    ON runledger.event_checkpoint_heads
    FOR EACH ROW EXECUTE FUNCTION runledger._guard_event_chain();
ALTER TABLE runledger.event_checkpoint_heads ENABLE ALWAYS TRIGGER tg_event_checkpoint_heads_guard;
CREATE TRIGGER tg_event_checkpoint_heads_no_truncate BEFORE TRUNCATE
    ON runledger.event_checkpoint_heads
    FOR EACH STATEMENT EXECUTE FUNCTION runledger._guard_event_chain();
ALTER TABLE runledger.event_checkpoint_heads
    ENABLE ALWAYS TRIGGER tg_event_checkpoint_heads_no_truncate;
CREATE TRIGGER tg_event_chain_prunes_guard BEFORE INSERT OR UPDATE OR DELETE
    ON runledger.event_chain_prunes
    FOR EACH ROW EXECUTE FUNCTION runledger._guard_event_chain();
ALTER TABLE runledger.event_chain_prunes ENABLE ALWAYS TRIGGER tg_event_chain_prunes_guard;
CREATE TRIGGER tg_event_chain_prunes_no_truncate BEFORE TRUNCATE
    ON runledger.event_chain_prunes
    FOR EACH STATEMENT EXECUTE FUNCTION runledger._guard_event_chain();
ALTER TABLE runledger.event_chain_prunes ENABLE ALWAYS TRIGGER tg_event_chain_prunes_no_truncate;
CREATE TRIGGER tg_event_checkpoint_prunes_guard BEFORE INSERT OR UPDATE OR DELETE
    ON runledger.event_checkpoint_prunes
    FOR EACH ROW EXECUTE FUNCTION runledger._guard_event_chain();
ALTER TABLE runledger.event_checkpoint_prunes ENABLE ALWAYS TRIGGER tg_event_checkpoint_prunes_guard;
CREATE TRIGGER tg_event_checkpoint_prunes_no_truncate BEFORE TRUNCATE
    ON runledger.event_checkpoint_prunes
    FOR EACH STATEMENT EXECUTE FUNCTION runledger._guard_event_chain();
ALTER TABLE runledger.event_checkpoint_prunes
    ENABLE ALWAYS TRIGGER tg_event_checkpoint_prunes_no_truncate;
