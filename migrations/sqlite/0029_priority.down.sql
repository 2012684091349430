CREATE INDEX records_queue_due ON records (pipeline, group_key, next_run_at, id)
    WHERE next_run_at IS NOT NULL;
DROP INDEX records_queue_levels;
ALTER TABLE records DROP COLUMN priority;
