-- Nothing on SQLite: its (pipeline, external_key) constraint stays (an
-- update there rewrites only the indexes on the columns it sets, so a
-- keyless record's claim and commit write nothing to it). PostgreSQL's
-- becomes a partial unique index.
SELECT 1;
