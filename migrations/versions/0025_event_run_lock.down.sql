-- runledger 0025 down: _event of 0023, renew_leases of 0010, report_stale_write of 0003.

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

CREATE OR REPLACE FUNCTION runledger.renew_leases(p_worker_id text, p_run_ids text[], p_lease_ids uuid[],
                                       p_lease interval)
RETURNS TABLE (run_id text, lease_expires_at timestamptz)
LANGUAGE plpgsql SECURITY DEFINER
SET search_path = pg_catalog, runledger, pg_temp
AS $$
#variable_conflict use_column
DECLARE
    v_now timestamptz := runledger.now();
    v_row record;
    v_run_id text;
    -- revision 0010: a lease of an earlier timeline is not renewed (its writes are refused)
    v_floor bigint := runledger._token_floor();
BEGIN
    PERFORM runledger._check_worker_id(p_worker_id);
    PERFORM runledger._check_lease(p_lease);
    IF coalesce(cardinality(p_run_ids), 0) <> coalesce(cardinality(p_lease_ids), 0) THEN
        PERFORM runledger._raise('RL006', 'run ids and lease ids must be arrays of one length',
            NULL, NULL);
    END IF;
    IF cardinality(p_run_ids) > runledger._cap('run_ids') THEN
        PERFORM runledger._raise('RL006',
            format('run ids has %s elements, over the cap of %s', cardinality(p_run_ids),
                   runledger._cap('run_ids')), NULL, NULL);
    END IF;
    FOREACH v_run_id IN ARRAY coalesce(p_run_ids, '{}') LOOP
        PERFORM runledger._check_run_id(v_run_id);
    END LOOP;
    -- One statement (one snapshot) finds the renewed leases and the failed ones; it runs
    -- to completion before the loop returns the first and logs the others.
    FOR v_row IN
    WITH wanted AS (
        SELECT u.run_id, u.lease_id FROM unnest(p_run_ids, p_lease_ids) AS u(run_id, lease_id)
    ), locked AS (
        -- lock in a fixed order so two renewals never wait on each other in a cycle
        SELECT l.run_id FROM runledger.runs l JOIN wanted w ON w.run_id = l.run_id
        WHERE l.lease_id = w.lease_id AND l.lease_owner = p_worker_id
          AND l.status = 'running' AND l.lease_expires_at > v_now AND l.fencing_token > v_floor
        ORDER BY l.run_id
        FOR NO KEY UPDATE OF l
    ), renewed AS (
        UPDATE runledger.runs r
        SET lease_expires_at = v_now + p_lease
        FROM locked k JOIN wanted w ON w.run_id = k.run_id
        WHERE r.run_id = k.run_id AND r.lease_id = w.lease_id AND r.lease_owner = p_worker_id
          AND r.status = 'running' AND r.lease_expires_at > v_now AND r.fencing_token > v_floor
        RETURNING r.run_id, r.lease_expires_at
    )
    SELECT n.run_id, n.lease_expires_at, true AS renewed, NULL::uuid AS lease_id,
           NULL::uuid AS current_lease_id, NULL::text AS current_owner, NULL::text AS status
    FROM renewed n
    UNION ALL
    SELECT w.run_id, NULL, false, w.lease_id, x.lease_id, x.lease_owner, x.status
    FROM wanted w JOIN runledger.runs x ON x.run_id = w.run_id
    WHERE NOT EXISTS (SELECT 1 FROM renewed n WHERE n.run_id = w.run_id)
      -- a run that left 'running' (finished, released, cancelled) has its own event:
      -- only a lease that expired or was taken over is a renewal failure
      AND x.status = 'running'
    LOOP
        IF v_row.renewed THEN
            run_id := v_row.run_id;
            lease_expires_at := v_row.lease_expires_at;
            RETURN NEXT;
        ELSE
            PERFORM runledger._event(v_row.run_id, 'renewal_failed', p_worker_id, NULL, NULL,
                jsonb_build_object('lease_id', v_row.lease_id,
                                   'current_lease_id', v_row.current_lease_id,
                                   'current_owner', v_row.current_owner, 'status', v_row.status),
                v_now);
        END IF;
    END LOOP;
END
$$;

CREATE OR REPLACE FUNCTION runledger.report_stale_write(p_run_id text, p_worker_id text, p_lease_id uuid,
                                             p_fencing_token bigint, p_operation text,
                                             p_message text)
RETURNS void
LANGUAGE plpgsql SECURITY DEFINER
SET search_path = pg_catalog, runledger, pg_temp
AS $$
DECLARE
    r runledger.runs;
BEGIN
    PERFORM runledger._check_run_id(p_run_id);
    PERFORM runledger._check_worker_id(p_worker_id);
    PERFORM runledger._check_text('operation', p_operation, 1, runledger._cap('operation'));
    PERFORM runledger._check_text('message', p_message, 0, runledger._cap('message'));
    SELECT * INTO r FROM runledger.runs x WHERE x.run_id = p_run_id;
    IF NOT FOUND THEN
        PERFORM runledger._raise('RL003', format('run %s not found', p_run_id),
            'a stale write is reported only for a run that exists', NULL);
    END IF;
    PERFORM runledger._event(p_run_id, 'stale_write_rejected', p_worker_id, NULL, NULL,
        jsonb_build_object('operation', p_operation, 'stale_lease_id', p_lease_id,
                           'stale_token', p_fencing_token, 'current_token', r.fencing_token,
                           'current_owner', r.lease_owner, 'message', p_message));
END
$$;
