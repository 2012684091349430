DROP INDEX records_parent;
ALTER TABLE records DROP COLUMN parent_step;
ALTER TABLE records DROP COLUMN parent_id;
