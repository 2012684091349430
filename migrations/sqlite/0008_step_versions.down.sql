DROP TABLE step_versions;
ALTER TABLE step_runs DROP COLUMN cause;
