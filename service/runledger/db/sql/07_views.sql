-- ---------------------------------------------------------------------------------
-- Audit views
-- ---------------------------------------------------------------------------------

CREATE VIEW runledger.run_timeline AS
SELECT e.run_id, e.event_id, e.at, e.kind, e.actor, e.fencing_token, e.state_version, e.detail
FROM runledger.run_events e;

CREATE VIEW runledger.effect_ledger AS
SELECT c.idempotency_key, c.run_id, c.turn, c.call_id, c.tool, c.status, c.attempts,
       c.args, c.result, c.receipt, c.error,
       c.dispatched_by, c.dispatched_token, c.dispatched_at,
       c.completed_by, c.completed_token, c.completed_at,
       c.resolved_by, c.resolved_at, c.resolution_note,
       r.flow, r.flow_version
FROM runledger.run_calls c JOIN runledger.runs r USING (run_id);

CREATE VIEW runledger.lease_history AS
SELECT e.run_id, e.event_id, e.at, e.kind, e.actor AS worker_id, e.fencing_token,
       (e.detail ->> 'lease_id')::uuid AS lease_id,
       (e.detail ->> 'lease_expires_at')::timestamptz AS lease_expires_at,
       e.detail ->> 'previous_owner' AS previous_owner,
       (e.detail ->> 'previous_token')::bigint AS previous_token
FROM runledger.run_events e
WHERE e.kind IN ('claimed', 'takeover', 'lease_released', 'renewal_failed',
                 'stale_write_rejected', 'run_succeeded', 'run_failed', 'run_paused',
                 'run_cancelled');
