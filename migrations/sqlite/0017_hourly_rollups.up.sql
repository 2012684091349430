-- Step statistics per hour. Minute rows (`step_rollups`) are folded into
-- these once they are more than 61 minutes old (`Store::compact_rollups`,
-- run every minute by every node's housekeeping, one hour per
-- transaction), so a day's figures read 24 rows per step and node (and 61
-- minute rows) instead of 1,440. The columns are
-- those of `step_rollups`; `hour` is the hour's first millisecond.
CREATE TABLE step_rollup_hours (
    hour              INTEGER NOT NULL,
    node              TEXT    NOT NULL,
    pipeline          TEXT    NOT NULL,
    step              TEXT    NOT NULL,
    provider          TEXT    NOT NULL,
    calls             INTEGER NOT NULL,
    succeeded         INTEGER NOT NULL,
    failed            INTEGER NOT NULL,
    retried           INTEGER NOT NULL,
    unknown           INTEGER NOT NULL,
    records_succeeded INTEGER NOT NULL,
    records_failed    INTEGER NOT NULL,
    records_parked    INTEGER NOT NULL,
    latency           TEXT    NOT NULL,
    runs_succeeded    INTEGER NOT NULL,
    runs_failed       INTEGER NOT NULL,
    run_latency       TEXT    NOT NULL,
    PRIMARY KEY (hour, node, pipeline, step, provider)
);
