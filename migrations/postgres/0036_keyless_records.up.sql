-- A record's (pipeline, external_key) is unique among records with a key
-- (issue 51 item 2): the constraint's index held every record, keyless
-- ones too (a NULL key is indexed), so that each write of a keyless
-- record (its enqueue, claim and commit, none HOT) wrote an entry there
-- for nothing. A partial unique index replaces it; the enqueue function
-- names its predicate in its conflict target (otherwise the same as
-- migration 33's), as every statement relying on it must. Building the
-- index reads the whole `records` table, which stays locked meanwhile,
-- reads and writes alike: taken whole first, so that a worker holding a
-- row lock cannot deadlock with this lock's upgrade from the index
-- build's to the constraint drop's. Nothing on SQLite, whose constraint
-- stays (its updates rewrite only the indexes on the columns they set).
LOCK TABLE records IN ACCESS EXCLUSIVE MODE;
CREATE UNIQUE INDEX records_pipeline_key ON records (pipeline, external_key) WHERE external_key IS NOT NULL;
ALTER TABLE records DROP CONSTRAINT records_pipeline_external_key_key;
CREATE OR REPLACE FUNCTION ballast_insert_records(p_rows jsonb, p_actor text, p_shard integer, p_channel text)
RETURNS SETOF records
LANGUAGE plpgsql
SET plan_cache_mode = auto
AS $fn$
BEGIN
  RETURN QUERY
  WITH ins AS (INSERT INTO records (pipeline, pipeline_version, external_key, group_key, state, input, next_run_at, created_at, updated_at, priority) SELECT value->>0, CAST(value->>1 AS BIGINT), value->>2, value->>3, value->>4, value #> '{5,0}', CAST(value->>6 AS BIGINT), CAST(value->>7 AS BIGINT), CAST(value->>8 AS BIGINT), COALESCE(CAST(value->>9 AS BIGINT), 5) FROM jsonb_array_elements(p_rows) WITH ORDINALITY AS j(value, key) WHERE true ORDER BY key ON CONFLICT (pipeline, external_key) WHERE external_key IS NOT NULL DO NOTHING RETURNING *),
  ev AS (INSERT INTO events (record_id, at, kind, actor, audit, to_state) SELECT id, created_at, 'created', p_actor, FALSE, 'pending' FROM ins ORDER BY id),
  rc AS (INSERT INTO record_counts (pipeline, state, shard, n) SELECT pipeline, 'pending', p_shard, count(*) FROM ins GROUP BY pipeline ORDER BY pipeline COLLATE "C" ON CONFLICT (pipeline, state, shard) DO UPDATE SET n = record_counts.n + excluded.n RETURNING 1),
  sc AS (INSERT INTO step_counts (pipeline, step, state, shard, n) SELECT pipeline, '', 'pending', p_shard, count(*) FROM ins CROSS JOIN (SELECT count(*) FROM rc) AS rc_first GROUP BY pipeline ORDER BY pipeline COLLATE "C" ON CONFLICT (pipeline, step, state, shard) DO UPDATE SET n = step_counts.n + excluded.n RETURNING 1),
  gc AS (INSERT INTO group_counts (pipeline, group_key, state, shard, n) SELECT pipeline, group_key, 'pending', p_shard, count(*) FROM ins CROSS JOIN (SELECT count(*) FROM sc) AS sc_first WHERE group_key <> '' GROUP BY pipeline, group_key ORDER BY pipeline COLLATE "C", group_key COLLATE "C" ON CONFLICT (pipeline, group_key, state, shard) DO UPDATE SET n = group_counts.n + excluded.n),
  wake AS (SELECT pg_notify(p_channel, '') FROM (SELECT 1 FROM ins LIMIT 1) one)
  SELECT ins.* FROM ins LEFT JOIN wake ON TRUE;
END
$fn$;
