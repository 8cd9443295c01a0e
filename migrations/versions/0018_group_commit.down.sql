-- runledger 0018 down: back to 0015 exactly (no complete_calls).

DROP FUNCTION runledger.complete_calls(text, uuid, bigint, text[], text[], jsonb[], jsonb[], text);
