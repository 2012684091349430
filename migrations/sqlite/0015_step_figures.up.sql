-- Records per (pipeline, step they are at, state), maintained with every
-- state change like `record_counts`, for the pipelines page: "records in
-- this step now". A record that has not reached a step yet counts under ''.
CREATE TABLE step_counts (
    pipeline TEXT    NOT NULL,
    step     TEXT    NOT NULL,
    state    TEXT    NOT NULL,
    shard    INTEGER NOT NULL,
    n        INTEGER NOT NULL,
    PRIMARY KEY (pipeline, step, state, shard)
);
INSERT INTO step_counts (pipeline, step, state, shard, n)
SELECT pipeline, COALESCE(step, ''), state, 0, COUNT(*)
FROM records GROUP BY pipeline, COALESCE(step, ''), state;

-- Step runs (all attempts and polls of one step of one record) that ended
-- in the minute, by result, and how long each took from its first call to
-- its end, per bucket of `engine::stats::RUN_BUCKETS_MS`. Runs that parked
-- their record are `records_parked`.
ALTER TABLE step_rollups ADD COLUMN runs_succeeded INTEGER NOT NULL DEFAULT 0;
ALTER TABLE step_rollups ADD COLUMN runs_failed INTEGER NOT NULL DEFAULT 0;
ALTER TABLE step_rollups ADD COLUMN run_latency TEXT NOT NULL DEFAULT '[]';
