-- A step run for each item of a for-each step (`for_each`): its name is
-- `STEP#INDEX`, and these say which step and which item it is, so a
-- pass reads only the items it runs (their counts from the index),
-- never every item of a record with its other steps.
ALTER TABLE step_runs ADD COLUMN item_of TEXT;
ALTER TABLE step_runs ADD COLUMN item_no BIGINT;
CREATE INDEX step_runs_items ON step_runs (record_id, item_of, item_no) WHERE item_of IS NOT NULL;
