-- Word search (issue 20 item 3): one document per record, the words of
-- its key, reason, error code and input values, and of each step's
-- output values, reason, error code and job id. The search indexer keeps
-- it (engine/search.rs), behind the commits, so claims and commits pay
-- nothing for it. Contentless: the words are indexed, the text is not
-- stored again; the rowid is the record's id.
CREATE VIRTUAL TABLE record_search USING fts5 (body, content = '', contentless_delete = 1);
-- How far the indexer has read `events`: every event up to `event_id`
-- has been indexed (or given up on: see domain::search::Progress).
CREATE TABLE search_progress (
    id       INTEGER PRIMARY KEY CHECK (id = 1),
    event_id INTEGER NOT NULL
);
INSERT INTO search_progress (id, event_id) VALUES (1, 0);
