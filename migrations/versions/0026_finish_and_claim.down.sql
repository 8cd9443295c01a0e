-- runledger 0026 down: no finish_and_claim.

DROP FUNCTION runledger.finish_and_claim(text, uuid, bigint, int, jsonb, jsonb, bigint, jsonb,
                                         text, text[], interval, int);
