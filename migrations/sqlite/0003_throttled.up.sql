-- A throttled reply (the provider said "slow down") is an outcome of its
-- own: it spends no attempt. SQLite cannot change a CHECK in place, so the
-- attempts table is rebuilt with the same columns, rows, ids and index.
CREATE TABLE attempts_new (
    id          INTEGER PRIMARY KEY AUTOINCREMENT,
    record_id   INTEGER NOT NULL REFERENCES records (id) ON DELETE CASCADE,
    step        TEXT    NOT NULL,
    provider    TEXT,
    attempt_no  INTEGER NOT NULL,
    node        TEXT,
    started_at  INTEGER NOT NULL,
    duration_ms INTEGER NOT NULL,
    http_status INTEGER,
    outcome     TEXT    NOT NULL CHECK (outcome IN ('success', 'pending', 'retry', 'fail', 'unknown', 'throttled')),
    error_code  TEXT,
    excerpt     TEXT
);
INSERT INTO attempts_new (id, record_id, step, provider, attempt_no, node, started_at,
                          duration_ms, http_status, outcome, error_code, excerpt)
    SELECT id, record_id, step, provider, attempt_no, node, started_at,
           duration_ms, http_status, outcome, error_code, excerpt
    FROM attempts;
-- Ids are never reused: the new table continues the old one's sequence
-- (past rows since deleted, not just the highest kept).
-- (An empty new table has no sequence row yet: it gets the old one's.)
INSERT INTO sqlite_sequence (name, seq)
    SELECT 'attempts_new', 0 WHERE NOT EXISTS (SELECT 1 FROM sqlite_sequence WHERE name = 'attempts_new');
UPDATE sqlite_sequence
    SET seq = (SELECT seq FROM sqlite_sequence WHERE name = 'attempts')
    WHERE name = 'attempts_new' AND EXISTS (SELECT 1 FROM sqlite_sequence WHERE name = 'attempts');
DROP TABLE attempts;
ALTER TABLE attempts_new RENAME TO attempts;
CREATE INDEX attempts_record ON attempts (record_id, id);

-- A provider's "slow down" pause (its Retry-After) is the cluster's: kept
-- here, so every node holds its calls until it ends.
ALTER TABLE providers ADD COLUMN throttled_until INTEGER;
