-- The folded claims go with the columns: an older version's timeline
-- shows no `claimed` event for the passes claimed meanwhile.
ALTER TABLE events DROP COLUMN claimed_by;
ALTER TABLE events DROP COLUMN claimed_at;
ALTER TABLE records DROP COLUMN claimed_at;
