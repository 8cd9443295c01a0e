-- hot_sql.py --step (an experiment, not a change to make): the CHECK constraints on columns
-- that never change after the INSERT (their triggers refuse it), dropped. PostgreSQL
-- deserializes, plans and evaluates every CHECK of a table at each UPDATE statement.
ALTER TABLE runledger.runs DROP CONSTRAINT ck_runs_run_id, DROP CONSTRAINT ck_runs_input_object;
ALTER TABLE runledger.run_calls DROP CONSTRAINT ck_run_calls_args_object, DROP CONSTRAINT ck_run_calls_key;
ALTER TABLE runledger.run_turns DROP CONSTRAINT ck_run_turns_turn, DROP CONSTRAINT ck_run_turns_calls_array;
