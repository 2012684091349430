-- Cron schedules (issue 20 item 4): one row per scheduled pipeline, shared
-- by every node. Every tick at or before `watermark` (unix ms) has been
-- dealt with; a node advances it only from the value it read, so two
-- nodes never both move it (and a fired record is keyed by its tick, so
-- two nodes firing one tick make one record). `last_tick` and
-- `last_record_id` are what the overview shows as the last run.
CREATE TABLE schedules (
    pipeline TEXT PRIMARY KEY,
    cron TEXT NOT NULL,
    watermark BIGINT NOT NULL,
    last_tick BIGINT,
    last_record_id BIGINT,
    updated_at BIGINT NOT NULL
);
