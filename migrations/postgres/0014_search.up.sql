-- Word search (issue 20 item 3): one document per record, the words of
-- its key, reason, error code and input values, and of each step's
-- output values, reason, error code and job id, as a tsvector of the
-- `simple` configuration (no stemming, no stop words: names, ids and
-- codes are what operators look for). Positions are kept: a query word
-- the parser cuts in two (`ch_0001`) matches only as those parts side by
-- side, as on SQLite. The search
-- indexer keeps it (engine/search.rs), behind the commits, so claims and
-- commits pay nothing for it; a purged record's document goes with it.
CREATE TABLE record_search (
    record_id BIGINT PRIMARY KEY REFERENCES records (id) ON DELETE CASCADE,
    doc       tsvector NOT NULL
);
-- New entries wait in the index's pending list until it holds 256 kB
-- (not the default 4 MB): every search reads the whole list, so a long
-- one costs each search milliseconds until (auto)vacuum merges it.
CREATE INDEX record_search_doc ON record_search USING GIN (doc) WITH (gin_pending_list_limit = 256);
-- How far the indexer has read `events`: every event up to `event_id`
-- has been indexed (or given up on: see domain::search::Progress).
CREATE TABLE search_progress (
    id       INTEGER PRIMARY KEY CHECK (id = 1),
    event_id BIGINT NOT NULL
);
INSERT INTO search_progress (id, event_id) VALUES (1, 0);
