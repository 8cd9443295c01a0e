-- runledger 0023 downgrade: runledger._event as revision 0021 made it.


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
