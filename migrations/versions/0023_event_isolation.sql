-- runledger 0023: a run's event chain is extended in READ COMMITTED transactions only
-- (RL006 otherwise). Under REPEATABLE READ or SERIALIZABLE, _event's check that the event
-- it locked is still the run's last reads the transaction's first snapshot, and the new
-- event could chain to the same event as one committed since (a fork that runledger audit
-- reports as tampering). A run's first event (a submit in the caller's own transaction)
-- is written under any isolation.
-- Frozen once merged: change things in a new revision (and in the living files).


CREATE OR REPLACE FUNCTION runledger._event(p_run_id text, p_kind text, p_actor text,
                                 p_fencing_token bigint, p_state_version bigint,
                                 p_detail jsonb, p_at timestamptz DEFAULT NULL) RETURNS void
LANGUAGE plpgsql
AS $$
DECLARE
    v_id bigint;
    v_at timestamptz := coalesce(p_at, runledger.now());
    v_detail jsonb := coalesce(p_detail, '{}'::jsonb);
    v_last bigint;
    v_previous bytea;
BEGIN
    -- Revision 0021: the row locked must still be the run's last event once the lock is
    -- held. A writer that waited for it may find that the holder appended a newer one,
    -- and a third writer, come later, may already hold that one: chaining to the event
    -- it locked, or to the newest it sees, would fork the chain. The INSERT checks, in
    -- its own snapshot (taken after the lock), that no newer event exists; when one does
    -- it inserts nothing, and the writer locks the newer one and tries again.
    LOOP
        SELECT e.event_id, e.hash INTO v_last, v_previous FROM runledger.run_events e
        WHERE e.run_id = p_run_id ORDER BY e.event_id DESC LIMIT 1 FOR UPDATE;
        -- Revision 0023: that check needs a snapshot newer than the lock, which only READ
        -- COMMITTED (and READ UNCOMMITTED, the same in PostgreSQL) takes. Under
        -- REPEATABLE READ or SERIALIZABLE the INSERT sees the transaction's first
        -- snapshot: an event committed since is not seen, and the new one would chain to
        -- the same event as it (a fork). So a run's chain is extended only in READ
        -- COMMITTED; its first event (a submit inside the caller's own transaction) is
        -- written under any isolation.
        IF v_last IS NOT NULL
           AND pg_catalog.current_setting('transaction_isolation')
               IN ('repeatable read', 'serializable') THEN
            PERFORM runledger._raise('RL006',
                format('events of run %s are written in READ COMMITTED transactions only, not %s',
                       p_run_id, upper(pg_catalog.current_setting('transaction_isolation'))),
                'a transaction with one snapshot does not see the events committed since it'
                || ' began, and the run''s hash chain would fork',
                'call the contract functions in autocommit or in a READ COMMITTED transaction,'
                || ' with default_transaction_isolation read committed');
        END IF;
        INSERT INTO runledger.run_events (event_id, run_id, at, kind, actor, fencing_token,
                                          state_version, detail, hash)
        SELECT n.id, p_run_id, v_at, p_kind, p_actor, p_fencing_token, p_state_version,
               v_detail,
               runledger._event_hash(v_previous, n.id, p_run_id, v_at, p_kind, p_actor,
                                     p_fencing_token, p_state_version, v_detail)
        FROM (SELECT pg_catalog.nextval('runledger.run_events_event_id_seq'::regclass) AS id) n
        WHERE NOT EXISTS (SELECT 1 FROM runledger.run_events e
                          WHERE e.run_id = p_run_id AND e.event_id > v_last)
        RETURNING event_id INTO v_id;
        EXIT WHEN FOUND;
    END LOOP;
    IF p_kind NOT IN ('call_dispatched', 'call_succeeded', 'call_failed', 'call_not_applied',
                      'turn_recorded', 'checkpoint', 'claimed') THEN
        PERFORM pg_notify('runledger_events', v_id || ' ' || p_run_id || ' ' || p_kind);
    END IF;
END
$$;
