-- Priority (issue 50 item 6): a record's `priority`, 0 to 9 (9 first),
-- given at enqueue, 5 when none is. Claims keep their fair share between
-- (pipeline, group) queues; within a queue they take the highest priority
-- first, then the oldest due. The queues' index gains the priority, so a
-- queue is read level by level: the loose scan finds each (pipeline,
-- group, priority) present (one probe each: a queue at the default costs
-- what it did), and each level's due records are read in due order.
-- `records_queue_due` goes: a node of the previous version, during a
-- rolling upgrade, finds its queues through this index's leading columns
-- and sorts each queue's due records itself (slower, not wrong); its
-- enqueues give no priority and get the default.
ALTER TABLE records ADD COLUMN priority SMALLINT NOT NULL DEFAULT 5
    CHECK (priority BETWEEN 0 AND 9);
CREATE INDEX records_queue_levels ON records (pipeline, group_key, priority, next_run_at, id)
    WHERE next_run_at IS NOT NULL;
DROP INDEX records_queue_due;

-- The enqueue function of migration 21 with the priority: the tenth cell
-- of each row (`batch::NEW_RECORD_COLS`); a row without it (a node of the
-- previous version) gets the default.
CREATE OR REPLACE FUNCTION ballast_insert_records(p_rows jsonb, p_actor text, p_shard integer, p_channel text)
RETURNS SETOF records
LANGUAGE plpgsql
SET plan_cache_mode = auto
AS $fn$
BEGIN
  RETURN QUERY
  WITH ins AS (INSERT INTO records (pipeline, pipeline_version, external_key, group_key, state, input, next_run_at, created_at, updated_at, priority) SELECT value->>0, CAST(value->>1 AS BIGINT), value->>2, value->>3, value->>4, value #> '{5,0}', CAST(value->>6 AS BIGINT), CAST(value->>7 AS BIGINT), CAST(value->>8 AS BIGINT), COALESCE(CAST(value->>9 AS BIGINT), 5) FROM jsonb_array_elements(p_rows) WITH ORDINALITY AS j(value, key) WHERE true ORDER BY key ON CONFLICT (pipeline, external_key) DO NOTHING RETURNING *),
  ev AS (INSERT INTO events (record_id, at, kind, actor, audit, to_state) SELECT id, created_at, 'created', p_actor, FALSE, 'pending' FROM ins ORDER BY id),
  rc AS (INSERT INTO record_counts (pipeline, state, shard, n) SELECT pipeline, 'pending', p_shard, count(*) FROM ins GROUP BY pipeline ORDER BY pipeline COLLATE "C" ON CONFLICT (pipeline, state, shard) DO UPDATE SET n = record_counts.n + excluded.n RETURNING 1),
  sc AS (INSERT INTO step_counts (pipeline, step, state, shard, n) SELECT pipeline, '', 'pending', p_shard, count(*) FROM ins CROSS JOIN (SELECT count(*) FROM rc) AS rc_first GROUP BY pipeline ORDER BY pipeline COLLATE "C" ON CONFLICT (pipeline, step, state, shard) DO UPDATE SET n = step_counts.n + excluded.n),
  wake AS (SELECT pg_notify(p_channel, '') FROM (SELECT 1 FROM ins LIMIT 1) one)
  SELECT ins.* FROM ins LEFT JOIN wake ON TRUE;
END
$fn$;
