CREATE INDEX records_due ON records (next_run_at, id) WHERE next_run_at IS NOT NULL;
