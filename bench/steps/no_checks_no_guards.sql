-- hot_sql.py --step, after no_immutable_checks.sql (an experiment): every other CHECK of
-- runs, run_calls, run_turns and run_events, and the BEFORE UPDATE guard triggers of runs
-- and run_calls (their WHEN clauses are prepared at each UPDATE too), dropped.
ALTER TABLE runledger.runs DROP CONSTRAINT ck_runs_status;
ALTER TABLE runledger.runs DROP CONSTRAINT ck_runs_state_object;
ALTER TABLE runledger.runs DROP CONSTRAINT ck_runs_lease_complete;
ALTER TABLE runledger.runs DROP CONSTRAINT ck_runs_running_has_lease;
ALTER TABLE runledger.runs DROP CONSTRAINT ck_runs_finished_at;
ALTER TABLE runledger.run_calls DROP CONSTRAINT ck_run_calls_status;
ALTER TABLE runledger.run_calls DROP CONSTRAINT ck_run_calls_attempts;
ALTER TABLE runledger.run_turns DROP CONSTRAINT ck_run_turns_record_object;
ALTER TABLE runledger.run_turns DROP CONSTRAINT ck_run_turns_output_final;
ALTER TABLE runledger.run_calls DROP CONSTRAINT ck_run_calls_approval;
ALTER TABLE runledger.run_calls DROP CONSTRAINT ck_run_calls_approval_status;
ALTER TABLE runledger.run_calls DROP CONSTRAINT ck_run_calls_approval_decided;
ALTER TABLE runledger.run_events DROP CONSTRAINT ck_run_events_hash;
ALTER TABLE runledger.runs DROP CONSTRAINT ck_runs_traceparent;
DROP TRIGGER tg_runs_guard ON runledger.runs;
DROP TRIGGER tg_runs_guard_columns ON runledger.runs;
DROP TRIGGER tg_run_calls_guard ON runledger.run_calls;
DROP TRIGGER tg_run_calls_guard_columns ON runledger.run_calls;
