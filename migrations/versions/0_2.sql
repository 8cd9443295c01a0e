-- Revision 0.2 (open until the 0.2.0 release): a failover that lost no acknowledged
-- commit doubts nothing. runledger.commit_guarantees witnesses how the workers' commits
-- are acknowledged (every claim keeps it); the detection of a failover reads its last row
-- and records in runledger.timelines whether the failover was lossless and why
-- (docs/failover.md). A worker that fenced a run whose lease a failover made stale hands
-- it back (release_stale_lease).

ALTER TABLE runledger.timelines ADD COLUMN lossless boolean, ADD COLUMN evidence jsonb;

-- How the commits of the workers' sessions were acknowledged, as their claims saw it: a
-- row each time a claim finds synchronous_commit (the claiming session's) or
-- synchronous_standby_names (the server's) other than the last row says. Read when a
-- failover is detected, and judged then by runledger._synchronous: the evidence of
-- whether it could lose an acknowledged commit (docs/failover.md). Append-only, like
-- timelines.
CREATE TABLE runledger.commit_guarantees (
    position integer NOT NULL,
    synchronous_commit text NOT NULL,
    synchronous_standby_names text NOT NULL,
    timeline integer NOT NULL,
    seen_at timestamptz NOT NULL,
    seen_by text,
    CONSTRAINT pk_commit_guarantees PRIMARY KEY (position)
);

CREATE TRIGGER tg_commit_guarantees_guard BEFORE INSERT OR UPDATE OR DELETE
    ON runledger.commit_guarantees
    FOR EACH ROW EXECUTE FUNCTION runledger._guard_failover_record();
ALTER TABLE runledger.commit_guarantees ENABLE ALWAYS TRIGGER tg_commit_guarantees_guard;
CREATE TRIGGER tg_commit_guarantees_no_truncate BEFORE TRUNCATE ON runledger.commit_guarantees
    FOR EACH STATEMENT EXECUTE FUNCTION runledger._guard_failover_record();
ALTER TABLE runledger.commit_guarantees ENABLE ALWAYS TRIGGER tg_commit_guarantees_no_truncate;

-- Whether a commit acknowledged under these settings is on every standby
-- synchronous_standby_names lists, so that promoting any of them loses no acknowledged
-- commit: synchronous_commit waits for the standbys (on, remote_write, remote_apply), and
-- the list asks for as many standbys as it names ('n2'; 'FIRST 2 (n2, n3)'; 'ANY 2 (n2,
-- n3)'). Not so for an empty list, for '*', or for fewer than it names ('n2, n3' is
-- FIRST 1: n3 is only a candidate; 'ANY 1 (n2, n3)': either one may lack a commit).
CREATE FUNCTION runledger._synchronous(p_commit text, p_names text) RETURNS boolean
LANGUAGE plpgsql IMMUTABLE
AS $$
DECLARE
    v_names text := btrim(coalesce(p_names, ''));
    v_parts text[];
    v_count integer := 1;
BEGIN
    IF coalesce(p_commit, '') NOT IN ('on', 'remote_write', 'remote_apply') OR v_names = ''
       OR strpos(v_names, '*') > 0 THEN
        RETURN false;
    END IF;
    v_parts := regexp_match(v_names, '^(?:(?:any|first)\s+)?(\d+)\s*\((.*)\)$', 'i');
    IF v_parts IS NOT NULL THEN
        v_count := v_parts[1]::integer;
        v_names := v_parts[2];
    END IF;
    RETURN v_count >= 1 AND v_count = cardinality(string_to_array(v_names, ','));
END
$$;

-- The witness of how commits are acknowledged (runledger.commit_guarantees), kept by
-- every claim after its failover check: a row when the claiming session's
-- synchronous_commit or the server's synchronous_standby_names differ from the last row.
-- One read by primary key when nothing changed.
CREATE FUNCTION runledger._note_commit_guarantee(p_actor text, p_now timestamptz,
                                                 p_timeline integer) RETURNS void
LANGUAGE plpgsql
AS $$
DECLARE
    v_commit text := pg_catalog.current_setting('synchronous_commit');
    v_names text := pg_catalog.current_setting('synchronous_standby_names');
    v_last runledger.commit_guarantees;
BEGIN
    SELECT * INTO v_last FROM runledger.commit_guarantees g ORDER BY g.position DESC LIMIT 1;
    IF FOUND AND v_last.synchronous_commit = v_commit
       AND v_last.synchronous_standby_names = v_names THEN
        RETURN;
    END IF;
    -- one writer at a time; the others find its row
    LOCK TABLE runledger.commit_guarantees IN SHARE ROW EXCLUSIVE MODE;
    SELECT * INTO v_last FROM runledger.commit_guarantees g ORDER BY g.position DESC LIMIT 1;
    IF FOUND AND v_last.synchronous_commit = v_commit
       AND v_last.synchronous_standby_names = v_names THEN
        RETURN;
    END IF;
    INSERT INTO runledger.commit_guarantees (position, synchronous_commit,
                                             synchronous_standby_names, timeline, seen_at,
                                             seen_by)
    VALUES (coalesce(v_last.position, 0) + 1, v_commit, v_names, p_timeline, p_now, p_actor);
END
$$;

-- Failover. The current timeline, recorded: when the server is on another
-- timeline than the last one runledger.timelines names (a promoted standby, or a restore),
-- the first claim to see it records the new timeline and what it means for every run that
-- was not finished (docs/failover.md). Whether the promotion could lose an acknowledged
-- commit is decided from the last row of runledger.commit_guarantees: how the workers'
-- commits were acknowledged before it.
--   * Lossless (every acknowledged commit was on every synchronous standby, and the HA
--     manager promotes only one of them): nothing is doubted. The leases held end within
--     10 s (their tokens are under the new floor: their writes are refused), and each
--     running run gets a failover_detected event saying so; queued and paused runs are
--     left alone.
--   * Otherwise, for every unfinished run, what may have been lost with the commits of the
--     old timeline:
--     - a lease held then ends (as above);
--     - a planned call (not awaiting approval) may have been dispatched and sent on the
--       lost timeline: it is marked dispatched, so that whoever claims the run next
--       recovers it by its safety class (lookup, same key, or unknown) instead of sending
--       it as new;
--     - the run is listed in runledger.failover_runs with the turn from which its calls
--       are suspect, and gets a failover_detected event.
-- Claims on the old timeline's leases wait for this transaction (the run rows are locked).
-- An empty table (never seen) records the current timeline and nothing else.
CREATE OR REPLACE FUNCTION runledger._note_timeline(p_actor text, p_now timestamptz) RETURNS void
LANGUAGE plpgsql
AS $$
DECLARE
    v_timeline integer := runledger._timeline();
    v_last runledger.timelines;
    v_position integer;
    v_runs text[] := '{}';
    v_run record;
    v_guarantee runledger.commit_guarantees;
    v_lossless boolean;
    v_evidence jsonb;
BEGIN
    -- one detector at a time; the others find the row it wrote
    LOCK TABLE runledger.timelines IN SHARE ROW EXCLUSIVE MODE;
    SELECT * INTO v_last FROM runledger.timelines t ORDER BY t.position DESC LIMIT 1;
    IF FOUND AND v_last.timeline = v_timeline THEN
        RETURN;
    END IF;
    v_position := coalesce(v_last.position, 0) + 1;
    IF v_last.position IS NOT NULL THEN
        -- how the commits before the promotion were acknowledged (the claim that detects
        -- the failover notes the new timeline's guarantee only after this)
        SELECT * INTO v_guarantee FROM runledger.commit_guarantees g
        ORDER BY g.position DESC LIMIT 1;
        v_lossless := coalesce(runledger._synchronous(v_guarantee.synchronous_commit,
                                                      v_guarantee.synchronous_standby_names),
                               false);
        v_evidence := jsonb_build_object('commit_guarantee',
            CASE WHEN v_guarantee.position IS NOT NULL THEN to_jsonb(v_guarantee) END);
        -- the runs it affects, locked (in a fixed order) until the end of the claim: those
        -- holding a lease; after a failover that may have lost commits, every unfinished one
        SELECT coalesce(array_agg(u.run_id ORDER BY u.run_id), '{}') INTO v_runs
        FROM (SELECT r.run_id FROM runledger.runs r
              WHERE r.status = 'running'
                 OR (NOT v_lossless AND r.status IN ('queued', 'paused'))
              ORDER BY r.run_id FOR NO KEY UPDATE) u;
    END IF;
    -- the table is append-only (the wall): the row is written whole, once
    INSERT INTO runledger.timelines (position, timeline, previous_timeline, seen_at, seen_by,
                                     last_replay_at, last_event_id, max_token, affected_runs,
                                     lossless, evidence)
    VALUES (v_position, v_timeline, v_last.timeline, p_now, p_actor,
            pg_last_xact_replay_timestamp(),
            (SELECT max(e.event_id) FROM runledger.run_events e),
            (SELECT max(r.fencing_token) FROM runledger.runs r), cardinality(v_runs),
            v_lossless, v_evidence);
    IF v_last.position IS NULL THEN
        RETURN;  -- the first timeline seen: nothing to compare with
    END IF;

    IF v_lossless THEN
        -- Nothing acknowledged was lost: the runs are as their holders left them. Their
        -- leases end as below (the holders fence themselves; their calls in flight are
        -- released to the next holder or waited for), and nothing is doubted.
        UPDATE runledger.runs r
        SET lease_expires_at = least(r.lease_expires_at, p_now + interval '10 seconds'),
            lease_lock = NULL, updated_at = p_now
        WHERE r.run_id = ANY (v_runs);
    ELSE
        WITH affected AS (
            SELECT r.run_id, r.status, r.lease_owner, r.fencing_token,
                   coalesce((SELECT max(t.turn) FROM runledger.run_turns t
                             WHERE t.run_id = r.run_id), 0) AS turn
            FROM runledger.runs r
            WHERE r.run_id = ANY (v_runs)
        ), marked AS (
            UPDATE runledger.run_calls c
            -- an attempt under the run's last surviving token: the dispatch that may be lost
            SET status = 'dispatched', attempts = c.attempts + 1,
                dispatched_token = a.fencing_token, dispatched_by = 'failover',
                dispatched_at = p_now
            FROM affected a
            WHERE c.run_id = a.run_id AND c.status = 'planned'
              AND c.approval IS DISTINCT FROM 'pending'
            RETURNING c.run_id, c.idempotency_key
        ), ended AS (
            -- Not taken over at once. The holder, cut off with the old primary,
            -- may still have a call in flight at a provider; it fences itself within its
            -- listener's budget (5 s), so the run waits 10 s before anyone claims it, and a
            -- lookup by the next holder then sees that call's effect. Its session lock is
            -- cleared: that session never existed here, and its key would look free at once.
            UPDATE runledger.runs r
            SET lease_expires_at = p_now + interval '10 seconds', lease_lock = NULL,
                updated_at = p_now
            FROM affected a
            WHERE r.run_id = a.run_id AND r.status = 'running'
            RETURNING r.run_id
        ), delayed AS (
            -- a queued run may have been claimed on the lost timeline: the same wait
            UPDATE runledger.runs r
            SET available_at = greatest(r.available_at, p_now + interval '10 seconds'),
                updated_at = p_now
            FROM affected a
            WHERE r.run_id = a.run_id AND r.status = 'queued'
            RETURNING r.run_id
        )
        INSERT INTO runledger.failover_runs (run_id, position, status, lease_owner,
                                             fencing_token, turn, marked_calls)
        SELECT a.run_id, v_position, a.status, a.lease_owner, a.fencing_token, a.turn,
               ARRAY(SELECT m.idempotency_key FROM marked m WHERE m.run_id = a.run_id
                     ORDER BY m.idempotency_key)
        FROM affected a
        -- the lease UPDATE runs with the statement even where nothing reads it
        LEFT JOIN (SELECT count(*) AS n FROM ended) e ON true;
    END IF;

    -- an event per affected run, as it was (the updates above leave its status, holder
    -- and token); what is doubted of it, when anything is, from its failover_runs row
    FOR v_run IN
        SELECT r.run_id, r.status, r.lease_owner, r.fencing_token, r.state_version, f.turn,
               f.marked_calls
        FROM runledger.runs r
        LEFT JOIN runledger.failover_runs f ON f.run_id = r.run_id AND f.position = v_position
        WHERE r.run_id = ANY (v_runs) ORDER BY r.run_id
    LOOP
        PERFORM runledger._event(v_run.run_id, 'failover_detected', p_actor, NULL,
            v_run.state_version,
            jsonb_build_object('timeline', v_timeline, 'previous_timeline', v_last.timeline,
                               'status', v_run.status, 'lease_owner', v_run.lease_owner,
                               'fencing_token', v_run.fencing_token, 'lossless', v_lossless,
                               'suspect_from_turn', v_run.turn,
                               'marked_dispatched',
                               coalesce(to_jsonb(v_run.marked_calls), '[]'::jsonb),
                               'last_replay_at', pg_last_xact_replay_timestamp()),
            p_now);
    END LOOP;
END
$$;

-- The one body of the claim, which claim_runs_v4 and finish_and_claim select their
-- columns from (internal, granted to no one, like every helper). p_read: with each run the worker's per-run read (the journal unless
-- the run is stalled, failover_turn), in the claim statement itself; without it those
-- columns are NULL and nothing more is read.
CREATE OR REPLACE FUNCTION runledger._claim(p_worker_id text, p_flows text[], p_lease interval,
                                  p_max_runs int, p_read boolean)
RETURNS TABLE (run_id text, flow text, flow_version text, input jsonb, state jsonb,
               state_version bigint, fencing_token bigint, lease_id uuid,
               lease_expires_at timestamptz, takeover boolean, stalled_claims integer,
               turns json, calls json, failover_turn integer, traceparent text)
LANGUAGE plpgsql
AS $$
#variable_conflict use_column
DECLARE
    v_now timestamptz := runledger.now();
    v_flows record;
    v_claim record;
    v_timeline integer;
    v_floor bigint;
    -- session locks: the claimer's listener-session lock, stamped on each
    -- run it claims; the locks of holder sessions that ended (their runs are taken over
    -- before their leases expire)
    v_lock bigint;
    v_gone bigint[] := '{}';
    -- the claimer's process as its worker registered it (workers.process), recorded in
    -- each claim's event: the process that holds the lease, and sends under its token
    -- (call_sender)
    v_process jsonb;
    -- the planner settings of the claim statement, restored after it
    v_plan_cache_mode text := pg_catalog.current_setting('plan_cache_mode');
    v_jit text := pg_catalog.current_setting('jit');
    v_seqscan text := pg_catalog.current_setting('enable_seqscan');
    v_bitmapscan text := pg_catalog.current_setting('enable_bitmapscan');
    v_set text;
BEGIN
    PERFORM runledger._check_worker_id(p_worker_id);
    PERFORM runledger._check_lease(p_lease);
    IF p_max_runs IS NULL OR p_max_runs < 0 OR p_max_runs > 10000 THEN
        PERFORM runledger._raise('RL006', 'max runs must be 0-10000', NULL, NULL);
    END IF;
    v_flows := runledger._parse_flows(p_flows);
    -- failover: the token floor of this timeline, once it is recorded
    v_timeline := runledger._timeline();
    v_floor := (v_timeline - 1)::bigint << 32;  -- runledger._token_floor()
    IF (SELECT t.timeline FROM runledger.timelines t ORDER BY t.position DESC LIMIT 1)
       IS DISTINCT FROM v_timeline THEN
        PERFORM runledger._note_timeline(p_worker_id, v_now);
    END IF;
    -- how this session's commits are acknowledged, for the next failover to judge by
    PERFORM runledger._note_commit_guarantee(p_worker_id, v_now, v_timeline);
    -- session locks
    SELECT w.session_lock,
           CASE WHEN w.process IS NOT NULL THEN jsonb_build_object('process', w.process)
                ELSE '{}'::jsonb END
    INTO v_lock, v_process FROM runledger.workers w
    WHERE w.worker_id = p_worker_id AND w.stopped_at IS NULL;
    -- A claimer whose own listener session has ended claims nothing: its process died
    -- (or fenced itself) while this statement was on its way, and the server runs a
    -- statement to its end even when the client is gone. Its lock is free then; a live
    -- listener holds it, and the try fails. (A claim sent on the listener session itself
    -- would take its own lock again: that one is left alone.)
    IF v_lock IS NOT NULL AND p_max_runs > 0
       AND v_lock IS DISTINCT FROM
           nullif(pg_catalog.current_setting('runledger.session_lock', true), '')::bigint
       AND pg_catalog.pg_try_advisory_xact_lock(v_lock) THEN
        RETURN;
    END IF;
    IF p_max_runs > 0 THEN
        -- never the claimer's own key: its listener may end while this statement runs
        -- (the worker was killed after sending it), and its own runs are then no one's
        -- to take but the next worker's
        v_gone := array_remove(runledger._gone_sessions(), v_lock);
    END IF;
    -- end session locks

    -- Two index-ordered scans pick a few more ids than wanted (queued runs per pinned
    -- flow through ix_runs_claimable; expired leases through ix_runs_lease_expiry), so
    -- the cost does not grow with the backlog. The locking SELECT then re-states the
    -- whole condition and skips rows other claimers hold. The statement runs to completion
    -- (it modifies rows) before the loop below logs each claim.
    -- The statement is planned once per session, not at every call. With
    -- its parameters known (the clock, the limits, the gone sessions' keys) the planner's
    -- estimate of a custom plan always beats that of the generic one, so the plan cache
    -- planned it anew each time: ~0.9 ms of planning for ~0.3 ms of work. The generic
    -- plan has the same shape (index-ordered scans, rows fetched by key), so the cost stays
    -- flat with the backlog (bench/claim_scaling.py). Without JIT: not knowing the limits,
    -- the generic plan's estimate passes jit_above_cost from about a million queued runs
    -- on, and compiling it would cost ~70 ms a claim for well under a millisecond of work.
    -- Set for the transaction (the function's own SET clause is the search path alone, as
    -- every contract function's) and put back after the loop; an error undoes it anyway.
    -- And planned without sequential or bitmap scans. A generic plan is
    -- built from the statistics of the moment: a backlog submitted in one burst and
    -- claimed before autovacuum has analyzed runs got a plan that read the candidates
    -- through a bitmap of every claimable row, filtered by id (every queued run read at
    -- each claim, 33 ms at 20,000, until the next analyze). Without those two, the
    -- candidates are fetched by primary key and each scan above through its index,
    -- whatever the statistics say (tests/contract/test_claim_plan.py). For that, the
    -- candidates and the UPDATE state the claimable condition as a CASE on status, which
    -- the planner cannot match to the partial indexes' predicates: an OR of the same
    -- conditions let it read the candidates through a whole partial index (every queued
    -- run) when it took that index for small. Only the primary key is left to them.
    v_set := pg_catalog.set_config('plan_cache_mode', 'force_generic_plan', true);
    v_set := pg_catalog.set_config('jit', 'off', true);
    v_set := pg_catalog.set_config('enable_seqscan', 'off', true);
    v_set := pg_catalog.set_config('enable_bitmapscan', 'off', true);
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
        -- The flow is compared through an expression (c.flow || ''), which
        -- no index has: this scan can only go through ix_runs_lease_expiry (and orphaned
        -- below through ix_runs_lease_lock). With the plain columns, a generic plan built
        -- without statistics (a burst claimed before autovacuum's analyze) went through
        -- ix_runs_claimable by flow and filtered every queued row of the flow for a
        -- running one: 100,000 rows read per claim at 100,000 queued, 1.1 s at a million.
        SELECT c.run_id FROM runledger.runs c
        JOIN pinned p ON p.name = (c.flow || '') AND p.version = (c.flow_version || '')
        WHERE c.status = 'running' AND c.lease_expires_at <= v_now
        ORDER BY c.lease_expires_at
        LIMIT p_max_runs * 4 + 32
    ), orphaned AS (  -- session locks: the holder's session ended
        SELECT c.run_id FROM runledger.runs c
        JOIN pinned p ON p.name = (c.flow || '') AND p.version = (c.flow_version || '')
        WHERE c.status = 'running' AND c.lease_lock = ANY (v_gone)
        LIMIT p_max_runs * 4 + 32
    ), candidates AS (
        SELECT c.run_id, c.status AS old_status, c.lease_owner AS old_owner,
               c.fencing_token AS old_token, c.lease_expires_at AS old_expires_at
        FROM runledger.runs c
        -- an array, so the rows are fetched by primary key, not by a scan of the table
        WHERE c.run_id = ANY (ARRAY(SELECT x.run_id FROM queued x
                                    UNION ALL SELECT y.run_id FROM expired y
                                    UNION ALL SELECT z.run_id FROM orphaned z))
          -- the claimable condition as a CASE: see above
          AND CASE c.status WHEN 'queued' THEN c.available_at <= v_now
                              WHEN 'running' THEN c.lease_expires_at <= v_now
                                                  OR c.lease_lock = ANY (v_gone)
                              ELSE false END
        ORDER BY c.priority DESC, c.created_at, c.run_id
        LIMIT p_max_runs
        FOR NO KEY UPDATE OF c SKIP LOCKED
    ), claimed AS (
        UPDATE runledger.runs r
        SET status = 'running',
            fencing_token = greatest(r.fencing_token + 1, v_floor + 1),  -- failover floor
            lease_id = gen_random_uuid(),
            lease_owner = p_worker_id,
            lease_expires_at = v_now + p_lease,
            claims = r.claims + 1,
            stalled_claims = r.stalled_claims + 1,
            updated_at = v_now,
            lease_lock = v_lock  -- session locks
        FROM candidates c
        WHERE r.run_id = c.run_id
          -- the claimable condition as a CASE: see above
          AND CASE r.status WHEN 'queued' THEN r.available_at <= v_now
                              WHEN 'running' THEN r.lease_expires_at <= v_now
                                                  OR r.lease_lock = ANY (v_gone)
                              ELSE false END
        RETURNING r.run_id, r.flow, r.flow_version, r.input, r.state, r.state_version,
                  r.fencing_token, r.lease_id, r.lease_expires_at,
                  (c.old_status = 'running') AS takeover, c.old_owner, c.old_token,
                  c.old_expires_at, r.stalled_claims, r.traceparent
    )
    -- the worker's per-run read (p_read): the claim writes no
    -- turn, call or failover row, so the statement's own snapshot has them as they are
    SELECT k.run_id, k.flow, k.flow_version, k.input, k.state, k.state_version,
           k.fencing_token, k.lease_id, k.lease_expires_at, k.takeover, k.old_owner, k.old_token,
           k.old_expires_at, k.stalled_claims, k.traceparent,
           CASE WHEN p_read AND k.stalled_claims <= 1 THEN (
               SELECT coalesce(json_agg(json_build_object('turn', t.turn, 'calls', t.calls,
                                                          'record', t.record,
                                                          'output', t.output)
                                        ORDER BY t.turn), '[]'::json)
               FROM runledger.run_turns t WHERE t.run_id = k.run_id) END AS turns,
           CASE WHEN p_read AND k.stalled_claims <= 1 THEN (
               SELECT coalesce(json_agg(c ORDER BY c.turn, c.position), '[]'::json)
               FROM runledger.run_calls c WHERE c.run_id = k.run_id) END AS calls,
           CASE WHEN p_read THEN (SELECT min(f.turn) FROM runledger.failover_runs f
                                  WHERE f.run_id = k.run_id) END AS failover_turn
    FROM claimed k
    LOOP
        IF v_claim.takeover THEN
            -- holder: why the run could be taken, 'expired' or
            -- 'session_ended' (the lease still ran, the holder's session had ended);
            -- process (both kinds): the claimer's, when its worker registered one
            PERFORM runledger._event(v_claim.run_id, 'takeover', p_worker_id,
                v_claim.fencing_token, v_claim.state_version,
                jsonb_build_object('lease_id', v_claim.lease_id,
                                   'lease_expires_at', v_claim.lease_expires_at,
                                   'previous_owner', v_claim.old_owner,
                                   'previous_token', v_claim.old_token,
                                   'holder', CASE WHEN v_claim.old_expires_at <= v_now
                                                  THEN 'expired' ELSE 'session_ended' END,
                                   'previous_lease_expires_at', v_claim.old_expires_at)
                || coalesce(v_process, '{}'::jsonb),
                v_now);
        ELSE
            PERFORM runledger._event(v_claim.run_id, 'claimed', p_worker_id,
                v_claim.fencing_token, v_claim.state_version,
                jsonb_build_object('lease_id', v_claim.lease_id,
                                   'lease_expires_at', v_claim.lease_expires_at)
                || coalesce(v_process, '{}'::jsonb),
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
        stalled_claims := v_claim.stalled_claims;
        turns := v_claim.turns;
        calls := v_claim.calls;
        failover_turn := v_claim.failover_turn;
        traceparent := v_claim.traceparent;
        RETURN NEXT;
    END LOOP;
    v_set := pg_catalog.set_config('plan_cache_mode', v_plan_cache_mode, true);
    v_set := pg_catalog.set_config('jit', v_jit, true);
    v_set := pg_catalog.set_config('enable_seqscan', v_seqscan, true);
    v_set := pg_catalog.set_config('enable_bitmapscan', v_bitmapscan, true);
END
$$;

-- A worker that fenced a run whose lease was granted before a failover hands it back once
-- nothing of the run is in flight any more (its tools ended, their sends released): the
-- run is queued at once instead of when the failover's wait on that lease ends
-- (_note_timeline). Only such a lease: its token is at most this timeline's floor, so
-- every write of it is refused, and only its holder (p_worker_id the lease owner) says it
-- is done with it. True when the run was handed back; false, writing nothing, when the
-- lease is not the run's current one, has expired, or was granted on this timeline
-- (release_lease is for that). Like the clean hand-back, the claim's stalled count is
-- undone: a failover is not the run's fault. Refuses: RL006 (a bad worker id), RL003 (no
-- such run).
CREATE FUNCTION runledger.release_stale_lease(p_run_id text, p_lease_id uuid,
                                              p_fencing_token bigint, p_worker_id text)
RETURNS boolean
LANGUAGE plpgsql SECURITY DEFINER
SET search_path = pg_catalog, runledger, pg_temp
AS $$
DECLARE
    r runledger.runs;
    v_now timestamptz;
BEGIN
    PERFORM runledger._check_worker_id(p_worker_id);
    r := runledger._lock_run(p_run_id);
    v_now := runledger.now();  -- after the lock, as the lease check
    IF r.status <> 'running' OR r.lease_id IS DISTINCT FROM p_lease_id
       OR r.fencing_token IS DISTINCT FROM p_fencing_token
       OR r.lease_owner IS DISTINCT FROM p_worker_id OR r.lease_expires_at <= v_now
       OR p_fencing_token > runledger._token_floor() THEN
        RETURN false;
    END IF;
    UPDATE runledger.runs
    SET status = 'queued', lease_id = NULL, lease_expires_at = NULL, lease_owner = NULL,
        stalled_claims = greatest(stalled_claims - 1, 0),
        available_at = v_now, updated_at = v_now
    WHERE run_id = p_run_id;
    PERFORM runledger._event(p_run_id, 'lease_released', p_worker_id, p_fencing_token,
        r.state_version, jsonb_build_object('reason', 'fenced after a failover'), v_now);
    PERFORM runledger._notify_queued(r.flow, r.flow_version);
    RETURN true;
END
$$;

REVOKE ALL ON FUNCTION runledger._synchronous(text, text),
    runledger._note_commit_guarantee(text, timestamptz, integer),
    runledger.release_stale_lease(text, uuid, bigint, text) FROM PUBLIC;
REVOKE ALL ON runledger.commit_guarantees FROM PUBLIC;

DO $$
BEGIN
    IF EXISTS (SELECT 1 FROM pg_roles WHERE rolname = 'runledger_worker') THEN
        GRANT SELECT ON runledger.commit_guarantees TO runledger_worker;
        GRANT EXECUTE ON FUNCTION runledger.release_stale_lease(text, uuid, bigint, text)
            TO runledger_worker;
    END IF;
    IF EXISTS (SELECT 1 FROM pg_roles WHERE rolname = 'runledger_operator') THEN
        GRANT SELECT ON runledger.commit_guarantees TO runledger_operator;
    END IF;
    IF EXISTS (SELECT 1 FROM pg_roles WHERE rolname = 'runledger_auditor') THEN
        GRANT SELECT ON runledger.commit_guarantees TO runledger_auditor;
    END IF;
END
$$;

-- ---------------------------------------------------------------------------------
-- The sender's process of a call in flight: the process that claimed the run under
-- the sender's token, recorded in the claim's event (_claim, call_sender)
-- ---------------------------------------------------------------------------------

-- Who sent a call that is in flight, for the run's current holder before it recovers the
-- call: the sender (worker id, token, the attempt), until when it may still be sending
-- (NULL: it can no longer be; see _sender_until), what it said when it released the call
-- (the 'send_released' event's detail, or NULL), and the sender's process with the time
-- it was recorded, for a peer on the same host to check. That process is the one that
-- claimed the run under the sender's token (the 'process' of that claim's event, at the
-- claim's time): the lease is that process's, and only it sends under the token, even
-- when its worker id has been registered again since (the worker restarted under its own
-- id). A claim recorded without one (its worker registered no process) leaves the
-- process as the sender's worker registered it, with the time of that registration
-- (workers.process, started_at). One row; none for a call that is not dispatched.
CREATE OR REPLACE FUNCTION runledger.call_sender(p_run_id text, p_lease_id uuid, p_fencing_token bigint,
                                      p_idempotency_key text)
RETURNS TABLE (sender text, sender_token bigint, attempt integer, dispatched_at timestamptz,
               until timestamptz, released jsonb, process text, registered_at timestamptz,
               now timestamptz)
LANGUAGE plpgsql SECURITY DEFINER
SET search_path = pg_catalog, runledger, pg_temp
AS $$
DECLARE
    v_lock record;
    c runledger.run_calls;
BEGIN
    v_lock := runledger._lock_leased_run_at(p_run_id, p_lease_id, p_fencing_token);
    c := runledger._lock_call(p_run_id, p_idempotency_key);
    IF c.status <> 'dispatched' THEN
        RETURN;
    END IF;
    sender := c.dispatched_by;
    sender_token := c.dispatched_token;
    attempt := c.attempts;
    dispatched_at := c.dispatched_at;
    now := v_lock.at;
    SELECT e.detail INTO released FROM runledger.run_events e
    WHERE e.run_id = p_run_id AND e.kind = 'send_released'
      AND e.detail ->> 'idempotency_key' = p_idempotency_key
      AND e.detail ->> 'attempt' = c.attempts::text
    ORDER BY e.event_id LIMIT 1;
    -- released: no sender is sending it (the release is what _sender_until looks for first)
    IF released IS NULL AND c.dispatched_token < p_fencing_token THEN
        until := runledger._sender_until(p_run_id, p_idempotency_key, c.dispatched_token,
                                         c.attempts, v_lock.at);
    END IF;
    -- the claim that granted the sender's token (a failover's dispatch is no claimer's)
    SELECT e.detail ->> 'process', e.at INTO process, registered_at
    FROM runledger.run_events e
    WHERE e.run_id = p_run_id AND e.kind IN ('claimed', 'takeover')
      AND e.fencing_token = c.dispatched_token AND e.actor = c.dispatched_by
    ORDER BY e.event_id LIMIT 1;
    IF process IS NULL THEN
        SELECT w.process, w.started_at INTO process, registered_at
        FROM runledger.workers w WHERE w.worker_id = c.dispatched_by;
    END IF;
    RETURN NEXT;
END
$$;


-- ---------------------------------------------------------------------------------
-- One clock: each worker says how far its host's clock is from the database's
-- (workers.clock_offset, written by heartbeat_worker's p_clock_offset), for doctor and
-- `runledger workers` to show and warn about.

ALTER TABLE runledger.workers ADD COLUMN clock_offset interval;

DROP FUNCTION runledger.heartbeat_worker(text, boolean, uuid);
-- An unknown worker id is a no-op: the worker may have been registered in another
-- database, or its row removed by hand. With p_incarnation, only the
-- process that holds the registration heartbeats (or says it stopped); another one (the
-- id was taken over while it was silent, or after its process was found gone) is
-- refused with RL008, and stops. p_clock_offset: how far the worker's host clock is ahead
-- of the database's (negative: behind), as the worker measured it (workers.clock_offset;
-- NULL leaves the last one).
CREATE FUNCTION runledger.heartbeat_worker(p_worker_id text, p_stopped boolean DEFAULT false,
                                           p_incarnation uuid DEFAULT NULL,
                                           p_clock_offset interval DEFAULT NULL)
RETURNS void
LANGUAGE plpgsql SECURITY DEFINER
SET search_path = pg_catalog, runledger, pg_temp
AS $$
DECLARE
    v_now timestamptz := runledger.now();
    w runledger.workers;
BEGIN
    PERFORM runledger._check_worker_id(p_worker_id);
    UPDATE runledger.workers
    SET heartbeat_at = v_now,
        stopped_at = CASE WHEN p_stopped THEN v_now ELSE stopped_at END,
        clock_offset = coalesce(p_clock_offset, clock_offset)
    WHERE worker_id = p_worker_id
      AND (p_incarnation IS NULL OR incarnation IS NOT DISTINCT FROM p_incarnation);
    IF NOT FOUND AND p_incarnation IS NOT NULL THEN
        SELECT * INTO w FROM runledger.workers x WHERE x.worker_id = p_worker_id;
        IF FOUND THEN
            PERFORM runledger._raise('RL008',
                format('worker id %s was taken over by another worker', p_worker_id),
                format('registered by host %s pid %s since %s',
                       coalesce(nullif(w.hostname, ''), '?'), w.pid, w.started_at),
                'this worker stops; start it with another --worker-id to run both');
        END IF;
    END IF;
END
$$;

REVOKE ALL ON FUNCTION runledger.heartbeat_worker(text, boolean, uuid, interval) FROM PUBLIC;
DO $$
BEGIN
    IF EXISTS (SELECT 1 FROM pg_roles WHERE rolname = 'runledger_worker') THEN
        GRANT EXECUTE ON FUNCTION runledger.heartbeat_worker(text, boolean, uuid, interval)
            TO runledger_worker;
    END IF;
END
$$;

-- ---------------------------------------------------------------------------------
-- Retention of the records the runs leave behind (runledger.prune_records): the oldest
-- checkpoints of the event chains and their heads (the heads still needed carried into a
-- new checkpoint), the records of pruned chains and of pruned checkpoints, workers gone
-- long ago, old commit_guarantees rows. Deletes go through the pruning authorization.
-- ---------------------------------------------------------------------------------

-- the heads of one run (runledger.prune_records: is a head the run's newest, is a
-- pruned chain's record still needed)
CREATE INDEX ix_event_checkpoint_heads_run_id
    ON runledger.event_checkpoint_heads (run_id, event_id);
CREATE INDEX ix_event_chain_prunes_pruned_at ON runledger.event_chain_prunes (pruned_at);
-- The checkpoints runledger.prune_records deleted, one row per call that deleted some:
-- every checkpoint from 1 through through_checkpoint_id is gone, and digest is that
-- checkpoint's digest, the previous_digest of the oldest checkpoint kept after
-- checkpoint 0 (audit checks the chain from there). through_at: when that checkpoint was
-- made. The heads it deleted that still pinned a chain left in run_events were carried
-- into a new checkpoint, carried_into (NULL: none to carry). Written and deleted only by
-- prune_records (the pruning authorization), which keeps the newest row and those
-- younger than its cutoff.
CREATE TABLE runledger.event_checkpoint_prunes (
    through_checkpoint_id bigint NOT NULL,
    digest bytea NOT NULL,
    through_at timestamptz NOT NULL,
    checkpoints integer NOT NULL,
    heads integer NOT NULL,
    carried integer NOT NULL,
    carried_into bigint,
    pruned_at timestamptz NOT NULL,
    pruned_by text,  -- the database login
    CONSTRAINT pk_event_checkpoint_prunes PRIMARY KEY (through_checkpoint_id)
);

CREATE OR REPLACE FUNCTION runledger._guard_failover_record() RETURNS trigger
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

CREATE OR REPLACE FUNCTION runledger._guard_event_chain() RETURNS trigger
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
CREATE TRIGGER tg_event_checkpoint_prunes_guard BEFORE INSERT OR UPDATE OR DELETE
    ON runledger.event_checkpoint_prunes
    FOR EACH ROW EXECUTE FUNCTION runledger._guard_event_chain();
ALTER TABLE runledger.event_checkpoint_prunes ENABLE ALWAYS TRIGGER tg_event_checkpoint_prunes_guard;
CREATE TRIGGER tg_event_checkpoint_prunes_no_truncate BEFORE TRUNCATE
    ON runledger.event_checkpoint_prunes
    FOR EACH STATEMENT EXECUTE FUNCTION runledger._guard_event_chain();
ALTER TABLE runledger.event_checkpoint_prunes
    ENABLE ALWAYS TRIGGER tg_event_checkpoint_prunes_no_truncate;

-- prune_records: retention of what the runs leave behind, in batches. Through the same
-- authorization as prune_runs_v2 (its own row in prune_authorizations, removed before it
-- returns), in one short transaction:
--   * the checkpoints of the event chains made before p_before, oldest first, with their
--     heads, at most p_limit heads a call (at least one checkpoint): never checkpoint 0
--     (where the chains start: the events up to its through_event_id carry no hash) nor
--     the newest (where the next checkpoint starts). A deleted head that is still the
--     newest head of its run, of a chain no event_chain_prunes row covers, still pins a
--     chain in run_events: with p_keep_events false, a chain whose run is gone (its events
--     kept by an earlier prune) and whose last event is that head and older than p_before
--     is deleted, recorded in event_chain_prunes as prune_runs_v2 does; every other such
--     head is carried: copied into a checkpoint this call makes after the newest one (the
--     same through_event_id, the digest formula of checkpoint_events, actor
--     'runledger prune'), so every chain left stays pinned, and a tampered head stays
--     visible. The deleted range and its last digest (the previous_digest of the oldest
--     checkpoint kept after checkpoint 0) go to event_checkpoint_prunes;
--   * at most p_limit event_checkpoint_prunes rows older than p_before, but the newest
--     (audit reads it);
--   * at most p_limit event_chain_prunes rows older than p_before that no checkpoint head
--     needs any more;
--   * at most p_limit workers whose last heartbeat (and stop) is older than p_before,
--     holding no running run and no call in flight of an unfinished run (a sender's row
--     tells the next holder whether its process is gone);
--   * at most p_limit commit_guarantees rows older than p_before, but the newest: the next
--     failover is judged by it (a timelines row keeps a copy of the row it was judged by).
-- It holds the checkpointer's lock (key 'runledger checkpoint') for the call: a worker's
-- checkpoint_events skips meanwhile, and a checkpoint being made is waited for. timelines
-- and failover_runs are not touched: a timeline is added only by a failover or a restore,
-- and failover_runs rows go with their runs (prune_runs_v2). Returns how many of each were
-- deleted, how many heads were carried, and whether more is left to delete (more: call
-- again). Safe to repeat.
CREATE FUNCTION runledger.prune_records(p_before timestamptz, p_keep_events boolean,
                                        p_limit integer)
RETURNS TABLE (checkpoints integer, heads integer, carried integer, chains integer,
               checkpoint_prunes integer, chain_prunes integer, workers integer,
               commit_guarantees integer, more boolean)
LANGUAGE plpgsql SECURITY DEFINER
SET search_path = pg_catalog, runledger, pg_temp
AS $$
DECLARE
    v_txid bigint;
    v_now timestamptz := runledger.now();
    v_last runledger.event_checkpoints;
    v_through runledger.event_checkpoints;
    v_runs text[];
    v_events bigint[];
    v_hashes bytea[];
    v_gone text[] := '{}';
BEGIN
    IF p_before IS NULL THEN
        PERFORM runledger._raise('RL006', 'before must not be null', NULL, NULL);
    END IF;
    IF p_keep_events IS NULL THEN
        PERFORM runledger._raise('RL006', 'keep events must be true or false', NULL, NULL);
    END IF;
    IF p_limit IS NULL OR p_limit < 1 OR p_limit > 10000 THEN
        PERFORM runledger._raise('RL006',
            format('limit must be 1-10000, got %s', coalesce(p_limit::text, 'NULL')), NULL,
            'prune in batches: call again while more is true');
    END IF;
    checkpoints := 0; heads := 0; carried := 0; chains := 0; checkpoint_prunes := 0;
    chain_prunes := 0; workers := 0; commit_guarantees := 0;
    v_txid := txid_current();
    INSERT INTO runledger.prune_authorizations (txid) VALUES (v_txid) ON CONFLICT DO NOTHING;

    -- the checkpoints: no other checkpoint is made until this transaction ends
    PERFORM pg_advisory_xact_lock(hashtextextended('runledger checkpoint', 0));
    SELECT * INTO v_last FROM runledger.event_checkpoints k
    ORDER BY k.checkpoint_id DESC LIMIT 1;
    -- the batch: the oldest checkpoints after 0 (and before the newest), every one made
    -- before p_before, with at most p_limit heads in all (at least one checkpoint)
    SELECT k.* INTO v_through FROM runledger.event_checkpoints k
    WHERE k.checkpoint_id = (
        SELECT max(b.checkpoint_id) FROM (
            SELECT o.checkpoint_id, bool_and(o.at < p_before) OVER w AS old,
                   sum(o.runs) OVER w AS heads, row_number() OVER w AS n
            FROM (SELECT x.checkpoint_id, x.at, x.runs FROM runledger.event_checkpoints x
                  WHERE x.checkpoint_id > 0 AND x.checkpoint_id < v_last.checkpoint_id
                  ORDER BY x.checkpoint_id LIMIT p_limit) o
            WINDOW w AS (ORDER BY o.checkpoint_id)) b
        WHERE b.old AND (b.heads <= p_limit OR b.n = 1));
    IF v_through.checkpoint_id IS NOT NULL THEN
        -- the heads that still pin a chain: each run's newest in the batch, with no later
        -- head, of a chain no record of a pruned chain covers
        SELECT coalesce(array_agg(n.run_id ORDER BY n.run_id), '{}'),
               coalesce(array_agg(n.event_id ORDER BY n.run_id), '{}'),
               coalesce(array_agg(n.hash ORDER BY n.run_id), '{}')
        INTO v_runs, v_events, v_hashes
        FROM (SELECT DISTINCT ON (h.run_id) h.run_id, h.event_id, h.hash
              FROM runledger.event_checkpoint_heads h
              WHERE h.checkpoint_id > 0 AND h.checkpoint_id <= v_through.checkpoint_id
              ORDER BY h.run_id, h.checkpoint_id DESC) n
        WHERE NOT EXISTS (SELECT 1 FROM runledger.event_checkpoint_heads l
                          WHERE l.run_id = n.run_id
                            AND l.checkpoint_id > v_through.checkpoint_id)
          AND NOT EXISTS (SELECT 1 FROM runledger.event_chain_prunes p
                          WHERE p.run_id = n.run_id AND p.last_event_id >= n.event_id);
        IF NOT p_keep_events THEN
            -- the chains kept without their run, that ended with that head before p_before
            SELECT coalesce(array_agg(c.run_id), '{}') INTO v_gone
            FROM unnest(v_runs, v_events, v_hashes) AS c(run_id, event_id, hash)
            WHERE NOT EXISTS (SELECT 1 FROM runledger.runs r WHERE r.run_id = c.run_id)
              AND EXISTS (SELECT 1 FROM (SELECT e.event_id, e.hash, e.at
                                         FROM runledger.run_events e
                                         WHERE e.run_id = c.run_id
                                         ORDER BY e.event_id DESC LIMIT 1) l
                          WHERE l.event_id = c.event_id AND l.hash = c.hash
                            AND l.at < p_before);
            WITH events AS (
                DELETE FROM runledger.run_events e
                WHERE e.run_id = ANY (v_gone)
                  AND NOT EXISTS (SELECT 1 FROM runledger.runs r WHERE r.run_id = e.run_id)
                RETURNING e.run_id, e.event_id, e.hash
            )
            INSERT INTO runledger.event_chain_prunes (run_id, last_event_id, last_hash, events,
                                                      pruned_at, pruned_by)
            SELECT DISTINCT ON (d.run_id) d.run_id, d.event_id, d.hash,
                   count(*) OVER (PARTITION BY d.run_id), v_now, session_user
            FROM events d ORDER BY d.run_id, d.event_id DESC;
            GET DIAGNOSTICS chains = ROW_COUNT;
        END IF;
        WITH carry AS (
            SELECT c.run_id, c.event_id, c.hash
            FROM unnest(v_runs, v_events, v_hashes) AS c(run_id, event_id, hash)
            WHERE NOT (c.run_id = ANY (v_gone))
        ), made AS (
            INSERT INTO runledger.event_checkpoints (checkpoint_id, at, actor,
                through_event_id, runs, previous_digest, digest)
            SELECT v_last.checkpoint_id + 1, v_now, 'runledger prune',
                   v_last.through_event_id, count(*), v_last.digest,
                   runledger._checkpoint_digest(v_last.digest, v_last.checkpoint_id + 1,
                       v_last.through_event_id,
                       string_agg(c.run_id || ' ' || c.event_id || ' '
                                  || encode(c.hash, 'hex'), E'\n'
                                  ORDER BY c.run_id COLLATE "C"))
            FROM carry c
            HAVING count(*) > 0
            RETURNING 1
        )
        INSERT INTO runledger.event_checkpoint_heads (checkpoint_id, run_id, event_id, hash)
        SELECT v_last.checkpoint_id + 1, c.run_id, c.event_id, c.hash
        FROM carry c;  -- (made runs too: a WITH that writes always runs)
        GET DIAGNOSTICS carried = ROW_COUNT;
        DELETE FROM runledger.event_checkpoint_heads h
        WHERE h.checkpoint_id > 0 AND h.checkpoint_id <= v_through.checkpoint_id;
        GET DIAGNOSTICS heads = ROW_COUNT;
        DELETE FROM runledger.event_checkpoints k
        WHERE k.checkpoint_id > 0 AND k.checkpoint_id <= v_through.checkpoint_id;
        GET DIAGNOSTICS checkpoints = ROW_COUNT;
        -- the database login that pruned (session_user: this function runs as its owner)
        INSERT INTO runledger.event_checkpoint_prunes (through_checkpoint_id, digest,
            through_at, checkpoints, heads, carried, carried_into, pruned_at, pruned_by)
        VALUES (v_through.checkpoint_id, v_through.digest, v_through.at, checkpoints, heads,
                carried, CASE WHEN carried > 0 THEN v_last.checkpoint_id + 1 END, v_now,
                session_user);
    END IF;
    DELETE FROM runledger.event_checkpoint_prunes p
    WHERE p.through_checkpoint_id IN (
        SELECT x.through_checkpoint_id FROM runledger.event_checkpoint_prunes x
        WHERE x.pruned_at < p_before
          AND x.through_checkpoint_id < (SELECT max(y.through_checkpoint_id)
                                         FROM runledger.event_checkpoint_prunes y)
        ORDER BY x.through_checkpoint_id LIMIT p_limit);
    GET DIAGNOSTICS checkpoint_prunes = ROW_COUNT;

    -- the records of pruned chains no head needs: audit passes a head whose event is gone
    -- when such a row covers it (checkpoint_head_changed)
    DELETE FROM runledger.event_chain_prunes p
    USING (SELECT x.run_id, x.last_event_id FROM runledger.event_chain_prunes x
           WHERE x.pruned_at < p_before
             AND NOT EXISTS (SELECT 1 FROM runledger.event_checkpoint_heads h
                             WHERE h.run_id = x.run_id AND h.event_id <= x.last_event_id)
           ORDER BY x.pruned_at LIMIT p_limit) d
    WHERE p.run_id = d.run_id AND p.last_event_id = d.last_event_id;
    GET DIAGNOSTICS chain_prunes = ROW_COUNT;

    -- workers gone since before the cutoff; a worker heartbeating now is skipped
    IF EXISTS (SELECT 1 FROM runledger.workers x
               WHERE x.heartbeat_at < p_before
                 AND (x.stopped_at IS NULL OR x.stopped_at < p_before)) THEN
        WITH busy AS (
            SELECT r.lease_owner AS worker_id FROM runledger.runs r
            WHERE r.status = 'running' AND r.lease_owner IS NOT NULL
            UNION
            SELECT c.dispatched_by FROM runledger.runs r
            JOIN runledger.run_calls c ON c.run_id = r.run_id
            WHERE r.status IN ('queued', 'running', 'paused') AND c.status = 'dispatched'
              AND c.dispatched_by IS NOT NULL
        )
        DELETE FROM runledger.workers w
        USING (SELECT x.worker_id FROM runledger.workers x
               WHERE x.heartbeat_at < p_before
                 AND (x.stopped_at IS NULL OR x.stopped_at < p_before)
                 AND x.worker_id NOT IN (SELECT b.worker_id FROM busy b)
               ORDER BY x.heartbeat_at LIMIT p_limit
               FOR UPDATE SKIP LOCKED) d
        WHERE w.worker_id = d.worker_id;
        GET DIAGNOSTICS workers = ROW_COUNT;
    END IF;

    -- last: a claim that records a new guarantee waits for this transaction's end
    IF EXISTS (SELECT 1 FROM runledger.commit_guarantees x WHERE x.seen_at < p_before
               AND x.position < (SELECT max(y.position) FROM runledger.commit_guarantees y)) THEN
        DELETE FROM runledger.commit_guarantees g
        WHERE g.position IN (
            SELECT x.position FROM runledger.commit_guarantees x
            WHERE x.seen_at < p_before
              AND x.position < (SELECT max(y.position) FROM runledger.commit_guarantees y)
            ORDER BY x.position LIMIT p_limit);
        GET DIAGNOSTICS commit_guarantees = ROW_COUNT;
    END IF;

    -- more: an old checkpoint is left (the oldest after 0, not the newest), or a limit
    -- was reached
    more := EXISTS (SELECT 1 FROM (SELECT x.checkpoint_id, x.at
                                   FROM runledger.event_checkpoints x
                                   WHERE x.checkpoint_id > 0
                                   ORDER BY x.checkpoint_id LIMIT 1) f
                    WHERE f.at < p_before
                      AND f.checkpoint_id < (SELECT max(y.checkpoint_id)
                                             FROM runledger.event_checkpoints y))
            OR greatest(checkpoint_prunes, chain_prunes, workers, commit_guarantees) >= p_limit;
    DELETE FROM runledger.prune_authorizations a WHERE a.txid = v_txid;
    RETURN NEXT;
END
$$;

REVOKE ALL ON FUNCTION runledger.prune_records(timestamptz, boolean, integer) FROM PUBLIC;
REVOKE ALL ON runledger.event_checkpoint_prunes FROM PUBLIC;

DO $$
BEGIN
    IF EXISTS (SELECT 1 FROM pg_roles WHERE rolname = 'runledger_worker') THEN
        GRANT SELECT ON runledger.event_checkpoint_prunes TO runledger_worker;
    END IF;
    IF EXISTS (SELECT 1 FROM pg_roles WHERE rolname = 'runledger_operator') THEN
        GRANT SELECT ON runledger.event_checkpoint_prunes TO runledger_operator;
        GRANT EXECUTE ON FUNCTION runledger.prune_records(timestamptz, boolean, integer)
            TO runledger_operator;
    END IF;
    IF EXISTS (SELECT 1 FROM pg_roles WHERE rolname = 'runledger_auditor') THEN
        GRANT SELECT ON runledger.event_checkpoint_prunes TO runledger_auditor;
    END IF;
END
$$;
-- end of the retention of the records
