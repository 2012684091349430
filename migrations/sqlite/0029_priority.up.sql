-- Priority (issue 50 item 6): a record's `priority`, 0 to 9 (9 first),
-- given at enqueue, 5 when none is. Claims keep their fair share between
-- (pipeline, group) queues; within a queue they take the highest priority
-- first, then the oldest due. The queues' index gains the priority: the
-- loose scan finds each (pipeline, group, priority) present, one seek
-- each, and each level's due records are read in due order.
ALTER TABLE records ADD COLUMN priority INTEGER NOT NULL DEFAULT 5
    CHECK (priority BETWEEN 0 AND 9);
CREATE INDEX records_queue_levels ON records (pipeline, group_key, priority, next_run_at, id)
    WHERE next_run_at IS NOT NULL;
DROP INDEX records_queue_due;
