-- runledger 0008 down: back to 0006 exactly. Drops the three functions of the fast path
-- (their grants go with them); nothing else changed.

DROP FUNCTION runledger.claim_runs_v2(text, text[], interval, int);
DROP FUNCTION runledger.record_turn_v3(text, uuid, bigint, int, jsonb, jsonb, jsonb, bigint,
                                       jsonb, boolean);
DROP FUNCTION runledger.complete_call_v2(text, uuid, bigint, text, text, jsonb, jsonb, text);
