-- Nothing on SQLite: PostgreSQL drops the hot path's foreign keys here
-- (their row-by-row checks are queries run by triggers there). SQLite
-- checks a key with one lookup in the same process, and dropping one
-- would rebuild the tables. Retention deletes a record's attempts and
-- step runs itself on both backends.
SELECT 1;
