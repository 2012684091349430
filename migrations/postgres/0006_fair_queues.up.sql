-- Fair share between queues (issue 18 item 6): a record belongs to the
-- queue (pipeline, group_key); `group_key` is the optional group given at
-- enqueue (a tenant, say), '' for none. Claims take an even share from each
-- queue with due work (domain::fair), so a backlog in one queue cannot
-- starve another. The queues are found by a loose scan of this index (one
-- probe per queue that has records needing a worker, none for finished
-- ones) and each queue's due records read from it in due order.
-- `records_due` stays while nodes of the previous version may still run
-- against this schema (their claims scan it); a later migration drops it.
ALTER TABLE records ADD COLUMN group_key TEXT NOT NULL DEFAULT '';
CREATE INDEX records_queue_due ON records (pipeline, group_key, next_run_at, id)
    WHERE next_run_at IS NOT NULL;
