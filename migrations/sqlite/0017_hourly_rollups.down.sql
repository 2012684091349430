-- The hours go back as one minute row each, so the figures of the day
-- survive the downgrade. Each is put one millisecond into its hour: minute
-- rows start on a minute, so none can hold that key already.
INSERT INTO step_rollups (minute, node, pipeline, step, provider, calls, succeeded,
    failed, retried, unknown, records_succeeded, records_failed, records_parked, latency,
    runs_succeeded, runs_failed, run_latency)
SELECT hour + 1, node, pipeline, step, provider, calls, succeeded,
    failed, retried, unknown, records_succeeded, records_failed, records_parked, latency,
    runs_succeeded, runs_failed, run_latency
FROM step_rollup_hours;
DROP TABLE step_rollup_hours;
