-- runledger 0015: live updates (issue "The operator console"). _event also sends the
-- events an operator watches (not the per-call and per-turn ones, nor claims) on NOTIFY channel
-- runledger_events, payload '<event_id> <run_id> <kind>'.
-- Frozen once merged: change things in a new revision (and in the living files).

-- The only INSERT into run_events. Callers pass the event kind as a literal, so a grep
-- for it finds the writer. p_at: the function's one reading of the clock when the event
-- belongs to a set-based statement (claims, renewals); otherwise the clock now.
-- PL/pgSQL since revision 0007: a SQL function that is not inlined (an INSERT never is)
-- parses and plans its body at every call site in every transaction; PL/pgSQL plans the
-- INSERT once per session.
-- Revision 0015: an event that changes what an operator sees of a run (not the per-call
-- and per-turn ones) is also sent on NOTIFY channel runledger_events, payload
-- '<event_id> <run_id> <kind>', at commit (a rolled-back event sends nothing). Nor
-- 'claimed': a commit that notifies wakes every listening session of the database (each
-- worker's listener reads the queue in a transaction of its own), and a claim's commit
-- notifies nothing else; a run's end, a pause or an operator's act is what is sent.
-- 'submitted' costs no wake-up: its commit wakes the claimers (runledger_runs) anyway.
CREATE OR REPLACE FUNCTION runledger._event(p_run_id text, p_kind text, p_actor text,
                                 p_fencing_token bigint, p_state_version bigint,
                                 p_detail jsonb, p_at timestamptz DEFAULT NULL) RETURNS void
LANGUAGE plpgsql
AS $$
DECLARE
    v_id bigint;
BEGIN
    INSERT INTO runledger.run_events (run_id, at, kind, actor, fencing_token, state_version, detail)
    VALUES (p_run_id, coalesce(p_at, runledger.now()), p_kind, p_actor, p_fencing_token,
            p_state_version, coalesce(p_detail, '{}'::jsonb))
    RETURNING event_id INTO v_id;
    IF p_kind NOT IN ('call_dispatched', 'call_succeeded', 'call_failed', 'call_not_applied',
                      'turn_recorded', 'checkpoint', 'claimed') THEN
        PERFORM pg_notify('runledger_events', v_id || ' ' || p_run_id || ' ' || p_kind);
    END IF;
END
$$;

