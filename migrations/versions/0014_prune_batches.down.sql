-- runledger 0014 down: back to 0013 exactly (its grant goes with the function).

DROP FUNCTION runledger.prune_runs_v2(timestamptz, boolean, integer);
DROP INDEX runledger.ix_runs_finished_at;
