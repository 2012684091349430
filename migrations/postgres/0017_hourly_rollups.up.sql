-- Step statistics per hour. Minute rows (`step_rollups`) are folded into
-- these once they are more than 61 minutes old (`Store::compact_rollups`,
-- run every minute by every node's housekeeping, one hour per
-- transaction), so a day's figures read 24 rows per step and node (and 61
-- minute rows) instead of 1,440. The columns are
-- those of `step_rollups`; `hour` is the hour's first millisecond.
CREATE TABLE step_rollup_hours (
    hour              BIGINT  NOT NULL,
    node              TEXT    NOT NULL,
    pipeline          TEXT    NOT NULL,
    step              TEXT    NOT NULL,
    provider          TEXT    NOT NULL,
    calls             BIGINT  NOT NULL,
    succeeded         BIGINT  NOT NULL,
    failed            BIGINT  NOT NULL,
    retried           BIGINT  NOT NULL,
    unknown           BIGINT  NOT NULL,
    records_succeeded BIGINT  NOT NULL,
    records_failed    BIGINT  NOT NULL,
    records_parked    BIGINT  NOT NULL,
    latency           TEXT    NOT NULL,
    runs_succeeded    BIGINT  NOT NULL,
    runs_failed       BIGINT  NOT NULL,
    run_latency       TEXT    NOT NULL,
    PRIMARY KEY (hour, node, pipeline, step, provider)
);
