ALTER TABLE step_rollups DROP COLUMN run_latency;
ALTER TABLE step_rollups DROP COLUMN runs_failed;
ALTER TABLE step_rollups DROP COLUMN runs_succeeded;
DROP TABLE step_counts;
