-- runledger 0010: failover (issue #10, "Leases across real failures", deliverable 3).
-- A failover that loses commits must not cause a second effect or a reused token:
--   * tables timelines (the timelines the schema saw, in order) and failover_runs (the runs
--     that were unfinished when a claim saw a new timeline);
--   * helpers _timeline() (the server's current timeline, from its current WAL file name)
--     and _token_floor() ((timeline - 1) << 32); _note_timeline records a new timeline and
--     what it may have lost (ends the old leases, marks planned calls dispatched, lists the
--     affected runs, a failover_detected event each);
--   * claim_runs grants greatest(token + 1, floor + 1) and records a new timeline first;
--     _lock_leased_run refuses a token granted on an earlier timeline (RL001), and
--     renew_leases does not renew one;
--   * claim_runs_v3: claim_runs_v2 with failover_turn (granted to runledger_worker);
--   * the two tables are append-only and written by their owner only (the wall).
-- The current timeline is recorded as position 1. Frozen once merged: change things in a
-- new revision (and in the living files).

-- Revision 0010 (failover): the timelines this database was seen on, in the order the
-- schema saw them (position 1: where it was installed or migrated to 0010). A row is
-- added by the first claim that finds the server on another timeline than the last row
-- says: a promotion (or a restore) that may have lost commits. It records what survived
-- (the last event, the greatest token, the last commit replayed before the promotion) and
-- how many unfinished runs were affected. See docs/failover.md.
CREATE TABLE runledger.timelines (
    position integer NOT NULL,
    timeline integer NOT NULL,
    previous_timeline integer,
    seen_at timestamptz NOT NULL,
    seen_by text,
    last_replay_at timestamptz,
    last_event_id bigint,
    max_token bigint,
    affected_runs integer NOT NULL DEFAULT 0,
    CONSTRAINT pk_timelines PRIMARY KEY (position),
    CONSTRAINT ck_timelines_timeline CHECK (timeline >= 1)
);

-- Revision 0010: each run that was unfinished when a failover was detected, as it was
-- then. Calls of `turn` and later turns that were never dispatched on this timeline may
-- still have been sent on the lost one: the worker recovers them by safety class before
-- it sends them (docs/failover.md). marked_calls: planned calls that the detection marked
-- dispatched (their dispatch may be lost).
CREATE TABLE runledger.failover_runs (
    run_id text NOT NULL,
    position integer NOT NULL,
    status text NOT NULL,
    lease_owner text,
    fencing_token bigint NOT NULL,
    turn integer NOT NULL,
    marked_calls text[] NOT NULL,
    CONSTRAINT pk_failover_runs PRIMARY KEY (run_id, position),
    CONSTRAINT fk_failover_runs_run_id_runs FOREIGN KEY (run_id)
        REFERENCES runledger.runs (run_id) ON DELETE CASCADE,
    CONSTRAINT fk_failover_runs_position_timelines FOREIGN KEY (position)
        REFERENCES runledger.timelines (position)
);

-- The server's timeline: that of the WAL it writes now, from the name of the current WAL
-- file (a primary's new timeline shows there at once after a promotion, whereas
-- pg_control_checkpoint() names it only after the next checkpoint). Fails on a standby
-- (WAL control functions cannot run during recovery), as any write would. SQL, so that it
-- is inlined where it is called.
CREATE FUNCTION runledger._timeline() RETURNS integer
LANGUAGE sql VOLATILE
AS $$
    SELECT ('x' || substr(pg_walfile_name(pg_current_wal_lsn()), 1, 8))::bit(32)::integer
$$;

-- The fencing tokens of timeline N are over (N - 1) << 32, and a claim grants
-- greatest(token + 1, floor + 1): on timeline 1 tokens count 1, 2, ... as before, and
-- every token granted on a later timeline exceeds every token of an earlier one, those a
-- failover lost included (a run is claimed fewer than 2^32 times per timeline).
CREATE FUNCTION runledger._token_floor() RETURNS bigint
LANGUAGE sql VOLATILE
AS $$
    SELECT (runledger._timeline() - 1)::bigint << 32
$$;

-- _lock_leased_run: a lease is good only on the timeline that granted it (the check at
-- its end is new)
CREATE OR REPLACE FUNCTION runledger._lock_leased_run(p_run_id text, p_lease_id uuid, p_fencing_token bigint)
RETURNS runledger.runs
LANGUAGE plpgsql
AS $$
DECLARE
    r runledger.runs;
    v_now timestamptz;
BEGIN
    -- _lock_run, inline (revision 0007): one indexed SELECT ... FOR NO KEY UPDATE
    SELECT * INTO r FROM runledger.runs x WHERE x.run_id = p_run_id FOR NO KEY UPDATE;
    IF NOT FOUND THEN
        PERFORM runledger._check_run_id(p_run_id);
        PERFORM runledger._raise('RL003', format('run %s not found', p_run_id), NULL, NULL);
    END IF;
    -- The clock is read once the row lock is held: a write that waited on the lock past
    -- the lease's expiry is refused. runledger.now() is VOLATILE, so under READ COMMITTED
    -- its query takes a new snapshot and sees a clock_offset committed during the wait.
    v_now := runledger.now();
    IF r.status <> 'running' OR r.lease_id IS DISTINCT FROM p_lease_id
       OR r.fencing_token IS DISTINCT FROM p_fencing_token THEN
        PERFORM runledger._raise('RL001',
            format('lease lost on run %s: token %s is not the current lease', p_run_id,
                   coalesce(p_fencing_token::text, 'NULL')),
            format('run %s is %s; seen lease %s token %s; current lease %s token %s held by %s',
                   p_run_id, r.status, coalesce(p_lease_id::text, 'NULL'),
                   coalesce(p_fencing_token::text, 'NULL'), coalesce(r.lease_id::text, 'none'),
                   r.fencing_token, coalesce(r.lease_owner, 'nobody')),
            'another worker took the run over, or an operator finished it: drop it and do not retry');
    END IF;
    IF r.lease_expires_at <= v_now THEN
        PERFORM runledger._raise('RL001',
            format('lease expired on run %s: token %s', p_run_id, p_fencing_token),
            format('run %s is %s; seen lease %s token %s; current lease %s token %s held by %s '
                   'expired at %s, database clock is %s',
                   p_run_id, r.status, p_lease_id, p_fencing_token, r.lease_id, r.fencing_token,
                   coalesce(r.lease_owner, 'nobody'), r.lease_expires_at, v_now),
            'renew leases more often than the lease length; the run will be claimed again');
    END IF;
    -- Revision 0010: a lease is good only on the timeline that granted it. After a
    -- promotion its token is at most the new timeline's floor (claims grant more), even
    -- before a claim has recorded the failover and ended the old leases.
    IF p_fencing_token <= runledger._token_floor() THEN
        PERFORM runledger._raise('RL001',
            format('lease lost on run %s: token %s was granted before a failover', p_run_id,
                   p_fencing_token),
            format('the server is on timeline %s; leases of this timeline have tokens over %s',
                   runledger._timeline(), runledger._token_floor()),
            'the database was promoted: drop the run, it will be claimed again');
    END IF;
    RETURN r;
END
$$;

-- Revision 0010 (failover). The current timeline, recorded: when the server is on another
-- timeline than the last one runledger.timelines names (a promoted standby, or a restore),
-- the first claim to see it records the new timeline and, for every run that was not
-- finished, what may have been lost with the commits of the old one (docs/failover.md):
--   * a lease held then ends now (its holder may hold state that no longer exists here;
--     its writes are refused anyway: its token is under the new timeline's floor);
--   * a planned call (not awaiting approval) may have been dispatched and sent on the lost
--     timeline: it is marked dispatched, so that whoever claims the run next recovers it
--     by its safety class (lookup, same key, or unknown) instead of sending it as new;
--   * the run is listed in runledger.failover_runs with the turn from which its calls are
--     suspect, and gets a failover_detected event.
-- Claims on the old timeline's leases wait for this transaction (the run rows are locked).
-- An empty table (never seen) records the current timeline and nothing else.
CREATE FUNCTION runledger._note_timeline(p_actor text, p_now timestamptz) RETURNS void
LANGUAGE plpgsql
AS $$
DECLARE
    v_timeline integer := runledger._timeline();
    v_last runledger.timelines;
    v_position integer;
    v_runs text[] := '{}';
    v_run record;
BEGIN
    -- one detector at a time; the others find the row it wrote
    LOCK TABLE runledger.timelines IN SHARE ROW EXCLUSIVE MODE;
    SELECT * INTO v_last FROM runledger.timelines t ORDER BY t.position DESC LIMIT 1;
    IF FOUND AND v_last.timeline = v_timeline THEN
        RETURN;
    END IF;
    v_position := coalesce(v_last.position, 0) + 1;
    IF v_last.position IS NOT NULL THEN
        -- the unfinished runs, locked (in a fixed order) until the end of the claim
        SELECT coalesce(array_agg(u.run_id ORDER BY u.run_id), '{}') INTO v_runs
        FROM (SELECT r.run_id FROM runledger.runs r
              WHERE r.status IN ('queued', 'running', 'paused')
              ORDER BY r.run_id FOR NO KEY UPDATE) u;
    END IF;
    -- the table is append-only (the wall): the row is written whole, once
    INSERT INTO runledger.timelines (position, timeline, previous_timeline, seen_at, seen_by,
                                     last_replay_at, last_event_id, max_token, affected_runs)
    VALUES (v_position, v_timeline, v_last.timeline, p_now, p_actor,
            pg_last_xact_replay_timestamp(),
            (SELECT max(e.event_id) FROM runledger.run_events e),
            (SELECT max(r.fencing_token) FROM runledger.runs r), cardinality(v_runs));
    IF v_last.position IS NULL THEN
        RETURN;  -- the first timeline seen: nothing to compare with
    END IF;

    WITH affected AS (
        SELECT r.run_id, r.status, r.lease_owner, r.fencing_token,
               coalesce((SELECT max(t.turn) FROM runledger.run_turns t
                         WHERE t.run_id = r.run_id), 0) AS turn
        FROM runledger.runs r
        WHERE r.run_id = ANY (v_runs)
    ), marked AS (
        UPDATE runledger.run_calls c
        -- an attempt under the run's last surviving token: the dispatch that may be lost
        SET status = 'dispatched', attempts = c.attempts + 1, dispatched_token = a.fencing_token,
            dispatched_by = 'failover', dispatched_at = p_now
        FROM affected a
        WHERE c.run_id = a.run_id AND c.status = 'planned'
          AND c.approval IS DISTINCT FROM 'pending'
        RETURNING c.run_id, c.idempotency_key
    ), ended AS (
        UPDATE runledger.runs r
        SET lease_expires_at = p_now, updated_at = p_now
        FROM affected a
        WHERE r.run_id = a.run_id AND r.status = 'running' AND r.lease_expires_at > p_now
        RETURNING r.run_id
    )
    INSERT INTO runledger.failover_runs (run_id, position, status, lease_owner, fencing_token,
                                         turn, marked_calls)
    SELECT a.run_id, v_position, a.status, a.lease_owner, a.fencing_token, a.turn,
           ARRAY(SELECT m.idempotency_key FROM marked m WHERE m.run_id = a.run_id
                 ORDER BY m.idempotency_key)
    FROM affected a
    -- the lease UPDATE runs with the statement even where nothing reads it
    LEFT JOIN (SELECT count(*) AS n FROM ended) e ON true;

    FOR v_run IN
        SELECT f.run_id, f.status, f.lease_owner, f.fencing_token, f.turn, f.marked_calls,
               r.state_version
        FROM runledger.failover_runs f JOIN runledger.runs r ON r.run_id = f.run_id
        WHERE f.position = v_position
    LOOP
        PERFORM runledger._event(v_run.run_id, 'failover_detected', p_actor, NULL,
            v_run.state_version,
            jsonb_build_object('timeline', v_timeline, 'previous_timeline', v_last.timeline,
                               'status', v_run.status, 'lease_owner', v_run.lease_owner,
                               'fencing_token', v_run.fencing_token,
                               'suspect_from_turn', v_run.turn,
                               'marked_dispatched', to_jsonb(v_run.marked_calls),
                               'last_replay_at', pg_last_xact_replay_timestamp()),
            p_now);
    END LOOP;
END
$$;

-- claim_runs: the token floor of the timeline, and a new timeline recorded first
CREATE OR REPLACE FUNCTION runledger.claim_runs(p_worker_id text, p_flows text[], p_lease interval,
                                     p_max_runs int)
RETURNS TABLE (run_id text, flow text, flow_version text, input jsonb, state jsonb,
               state_version bigint, fencing_token bigint, lease_id uuid,
               lease_expires_at timestamptz, takeover boolean)
LANGUAGE plpgsql SECURITY DEFINER
SET search_path = pg_catalog, runledger, pg_temp
AS $$
#variable_conflict use_column
DECLARE
    v_now timestamptz := runledger.now();
    v_flows record;
    v_claim record;
    v_timeline integer;
    v_floor bigint;
BEGIN
    PERFORM runledger._check_worker_id(p_worker_id);
    PERFORM runledger._check_lease(p_lease);
    IF p_max_runs IS NULL OR p_max_runs < 0 OR p_max_runs > 10000 THEN
        PERFORM runledger._raise('RL006', 'max runs must be 0-10000', NULL, NULL);
    END IF;
    v_flows := runledger._parse_flows(p_flows);
    -- failover (revision 0010): the token floor of this timeline, once it is recorded
    v_timeline := runledger._timeline();
    v_floor := (v_timeline - 1)::bigint << 32;  -- runledger._token_floor()
    IF (SELECT t.timeline FROM runledger.timelines t ORDER BY t.position DESC LIMIT 1)
       IS DISTINCT FROM v_timeline THEN
        PERFORM runledger._note_timeline(p_worker_id, v_now);
    END IF;

    -- Two index-ordered scans pick a few more ids than wanted (queued runs per pinned
    -- flow through ix_runs_claimable; expired leases through ix_runs_lease_expiry), so
    -- the cost does not grow with the backlog. The locking SELECT then re-states the
    -- whole condition and skips rows other claimers hold. The statement runs to completion
    -- (it modifies rows) before the loop below logs each claim.
    FOR v_claim IN
    WITH pinned AS (
        SELECT u.name, u.version FROM unnest(v_flows.names, v_flows.versions) AS u(name, version)
    ), queued AS (
        SELECT q.run_id FROM pinned p CROSS JOIN LATERAL (
            SELECT c.run_id FROM runledger.runs c
            WHERE c.flow = p.name AND c.flow_version = p.version
              AND c.status = 'queued' AND c.available_at <= v_now
            ORDER BY c.priority DESC, c.created_at
            LIMIT p_max_runs * 4 + 32
        ) q
    ), expired AS (
        SELECT c.run_id FROM runledger.runs c
        JOIN pinned p ON p.name = c.flow AND p.version = c.flow_version
        WHERE c.status = 'running' AND c.lease_expires_at <= v_now
        ORDER BY c.lease_expires_at
        LIMIT p_max_runs * 4 + 32
    ), candidates AS (
        SELECT c.run_id, c.status AS old_status, c.lease_owner AS old_owner,
               c.fencing_token AS old_token
        FROM runledger.runs c
        -- an array, so the rows are fetched by primary key, not by a scan of the table
        WHERE c.run_id = ANY (ARRAY(SELECT x.run_id FROM queued x
                                    UNION ALL SELECT y.run_id FROM expired y))
          AND ((c.status = 'queued' AND c.available_at <= v_now)
               OR (c.status = 'running' AND c.lease_expires_at <= v_now))
        ORDER BY c.priority DESC, c.created_at, c.run_id
        LIMIT p_max_runs
        FOR NO KEY UPDATE OF c SKIP LOCKED
    ), claimed AS (
        UPDATE runledger.runs r
        SET status = 'running',
            fencing_token = greatest(r.fencing_token + 1, v_floor + 1),  -- revision 0010
            lease_id = gen_random_uuid(),
            lease_owner = p_worker_id,
            lease_expires_at = v_now + p_lease,
            claims = r.claims + 1,
            stalled_claims = r.stalled_claims + 1,
            updated_at = v_now
        FROM candidates c
        WHERE r.run_id = c.run_id
          AND ((r.status = 'queued' AND r.available_at <= v_now)
               OR (r.status = 'running' AND r.lease_expires_at <= v_now))
        RETURNING r.run_id, r.flow, r.flow_version, r.input, r.state, r.state_version,
                  r.fencing_token, r.lease_id, r.lease_expires_at,
                  (c.old_status = 'running') AS takeover, c.old_owner, c.old_token
    )
    SELECT k.run_id, k.flow, k.flow_version, k.input, k.state, k.state_version,
           k.fencing_token, k.lease_id, k.lease_expires_at, k.takeover, k.old_owner, k.old_token
    FROM claimed k
    LOOP
        IF v_claim.takeover THEN
            PERFORM runledger._event(v_claim.run_id, 'takeover', p_worker_id,
                v_claim.fencing_token, v_claim.state_version,
                jsonb_build_object('lease_id', v_claim.lease_id,
                                   'lease_expires_at', v_claim.lease_expires_at,
                                   'previous_owner', v_claim.old_owner,
                                   'previous_token', v_claim.old_token),
                v_now);
        ELSE
            PERFORM runledger._event(v_claim.run_id, 'claimed', p_worker_id,
                v_claim.fencing_token, v_claim.state_version,
                jsonb_build_object('lease_id', v_claim.lease_id,
                                   'lease_expires_at', v_claim.lease_expires_at),
                v_now);
        END IF;
        run_id := v_claim.run_id;
        flow := v_claim.flow;
        flow_version := v_claim.flow_version;
        input := v_claim.input;
        state := v_claim.state;
        state_version := v_claim.state_version;
        fencing_token := v_claim.fencing_token;
        lease_id := v_claim.lease_id;
        lease_expires_at := v_claim.lease_expires_at;
        takeover := v_claim.takeover;
        RETURN NEXT;
    END LOOP;
END
$$;

-- claim_runs_v3 (revision 0010): claim_runs_v2, and with each run failover_turn: the
-- earliest turn from which a failover (runledger.failover_runs) makes its never-dispatched
-- calls suspect of having been sent on a lost timeline, NULL for a run no failover
-- affected. claim_runs_v2's body with one more column in its per-run read (not a wrapper
-- of it: a layer of RETURN NEXT and a statement per run less). claim_runs_v2 stays for
-- workers of the previous release.
CREATE FUNCTION runledger.claim_runs_v3(p_worker_id text, p_flows text[], p_lease interval,
                                        p_max_runs int)
RETURNS TABLE (run_id text, flow text, flow_version text, input jsonb, state jsonb,
               state_version bigint, fencing_token bigint, lease_id uuid,
               lease_expires_at timestamptz, takeover boolean, stalled_claims integer,
               turns json, calls json, failover_turn integer)
LANGUAGE plpgsql SECURITY DEFINER
SET search_path = pg_catalog, runledger, pg_temp
AS $$
#variable_conflict use_column
DECLARE
    v_claim record;
BEGIN
    -- each statement of the loop sees what claim_runs wrote (a later command)
    FOR v_claim IN SELECT * FROM runledger.claim_runs(p_worker_id, p_flows, p_lease, p_max_runs)
    LOOP
        SELECT r.stalled_claims,
               CASE WHEN r.stalled_claims <= 1 THEN (
                   SELECT coalesce(json_agg(json_build_object('turn', t.turn, 'calls', t.calls,
                                                              'record', t.record,
                                                              'output', t.output)
                                            ORDER BY t.turn), '[]'::json)
                   FROM runledger.run_turns t WHERE t.run_id = r.run_id) END,
               CASE WHEN r.stalled_claims <= 1 THEN (
                   SELECT coalesce(json_agg(c ORDER BY c.turn, c.position), '[]'::json)
                   FROM runledger.run_calls c WHERE c.run_id = r.run_id) END,
               (SELECT min(f.turn) FROM runledger.failover_runs f WHERE f.run_id = r.run_id)
        INTO stalled_claims, turns, calls, failover_turn
        FROM runledger.runs r WHERE r.run_id = v_claim.run_id;
        run_id := v_claim.run_id;
        flow := v_claim.flow;
        flow_version := v_claim.flow_version;
        input := v_claim.input;
        state := v_claim.state;
        state_version := v_claim.state_version;
        fencing_token := v_claim.fencing_token;
        lease_id := v_claim.lease_id;
        lease_expires_at := v_claim.lease_expires_at;
        takeover := v_claim.takeover;
        RETURN NEXT;
    END LOOP;
END
$$;

-- renew_leases: a lease of an earlier timeline is not renewed
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

-- Revision 0010: the record of failovers. runledger.timelines is append-only and
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
    RAISE EXCEPTION USING ERRCODE = 'RL007',
        MESSAGE = format('%s is append-only (%s refused)', TG_TABLE_NAME, TG_OP),
        HINT = 'failover_runs rows are removed with their run, by runledger.prune_runs';
END
$$;
CREATE TRIGGER tg_timelines_guard BEFORE INSERT OR UPDATE OR DELETE ON runledger.timelines
    FOR EACH ROW EXECUTE FUNCTION runledger._guard_failover_record();
ALTER TABLE runledger.timelines ENABLE ALWAYS TRIGGER tg_timelines_guard;
CREATE TRIGGER tg_timelines_no_truncate BEFORE TRUNCATE ON runledger.timelines
    FOR EACH STATEMENT EXECUTE FUNCTION runledger._guard_failover_record();
ALTER TABLE runledger.timelines ENABLE ALWAYS TRIGGER tg_timelines_no_truncate;
CREATE TRIGGER tg_failover_runs_guard BEFORE INSERT OR UPDATE OR DELETE
    ON runledger.failover_runs
    FOR EACH ROW EXECUTE FUNCTION runledger._guard_failover_record();
ALTER TABLE runledger.failover_runs ENABLE ALWAYS TRIGGER tg_failover_runs_guard;
CREATE TRIGGER tg_failover_runs_no_truncate BEFORE TRUNCATE ON runledger.failover_runs
    FOR EACH STATEMENT EXECUTE FUNCTION runledger._guard_failover_record();
ALTER TABLE runledger.failover_runs ENABLE ALWAYS TRIGGER tg_failover_runs_no_truncate;

REVOKE ALL ON FUNCTION runledger._timeline() FROM PUBLIC;
REVOKE ALL ON FUNCTION runledger._token_floor() FROM PUBLIC;
REVOKE ALL ON FUNCTION runledger._note_timeline(text, timestamptz) FROM PUBLIC;
REVOKE ALL ON FUNCTION runledger.claim_runs_v3(text, text[], interval, int) FROM PUBLIC;
REVOKE ALL ON FUNCTION runledger._guard_failover_record() FROM PUBLIC;
DO $roles$
BEGIN
    IF EXISTS (SELECT 1 FROM pg_roles WHERE rolname = 'runledger_worker') THEN
        GRANT EXECUTE ON FUNCTION runledger.claim_runs_v3(text, text[], interval, int)
        TO runledger_worker;
        GRANT SELECT ON runledger.timelines, runledger.failover_runs TO runledger_worker;
    ELSE
        RAISE WARNING 'runledger: role runledger_worker does not exist; grant EXECUTE on runledger.claim_runs_v3 by hand';
    END IF;
    IF EXISTS (SELECT 1 FROM pg_roles WHERE rolname = 'runledger_auditor') THEN
        GRANT SELECT ON runledger.timelines, runledger.failover_runs TO runledger_auditor;
    END IF;
    IF EXISTS (SELECT 1 FROM pg_roles WHERE rolname = 'runledger_operator') THEN
        GRANT SELECT ON runledger.timelines, runledger.failover_runs TO runledger_operator;
    END IF;
END
$roles$;

-- the timeline the schema is migrated on (position 1)
SELECT runledger._note_timeline(NULL, runledger.now());
