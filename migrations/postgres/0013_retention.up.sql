-- Retention (issue 20 item 1). Finished records by pipeline and the moment
-- they finished, oldest first: what the purge deletes, found without
-- reading the records that stay (only finished records are in it).
CREATE INDEX records_finished ON records (pipeline, finished_at, id) WHERE finished_at IS NOT NULL;
-- A purged record's callbacks go with it (ON DELETE CASCADE): found by
-- record, not by scanning every callback.
CREATE INDEX callbacks_record ON callbacks (record_id) WHERE record_id IS NOT NULL;
-- How far the stripping of attempts' excerpts and requests has come, per
-- pipeline: every finished record before (finished_at, record_id) is done.
CREATE TABLE retention_progress (
    pipeline       TEXT PRIMARY KEY,
    finished_at    BIGINT NOT NULL,
    record_id      BIGINT NOT NULL
);
-- Work one node does at a time (the purge): held by `owner` until
-- `until` (unix ms); another node takes it once that has passed.
CREATE TABLE task_leases (
    name  TEXT PRIMARY KEY,
    owner TEXT NOT NULL,
    until BIGINT NOT NULL
);
