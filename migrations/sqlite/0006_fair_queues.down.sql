DROP INDEX records_queue_due;
ALTER TABLE records DROP COLUMN group_key;
