-- Encryption at rest (issue 49 item 4): every data key values were ever
-- sealed with, by id, with a check value that shows a node holds the same
-- key under that id without revealing it. A node refuses to start (or a
-- reload is refused) while a key not yet retired is missing from its
-- configuration; `ballast rotate-data-key` retires a key once no value is
-- sealed with it.
CREATE TABLE data_keys (
    id          TEXT    PRIMARY KEY,
    check_value TEXT    NOT NULL,
    added_at    INTEGER NOT NULL,
    retired_at  INTEGER
);

-- The key each node seals new values with ('' for none), said with its
-- heartbeat: `rotate-data-key` retires a key only when no live node
-- still seals with it.
ALTER TABLE nodes ADD COLUMN data_key TEXT;
