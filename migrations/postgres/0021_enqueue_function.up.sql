-- Issue 22: a single enqueue spent about a third of its time planning.
-- Ballast's sessions plan every statement on each execution
-- (`plan_cache_mode = force_custom_plan`, src/store/postgres.rs: a generic
-- plan made on small tables went on scanning them as they grew), and the
-- enqueue statement (five `WITH` parts writing records, events and two
-- counters, on a table with fourteen indexes) takes about 0.25 ms to
-- plan: as long as the rest of the statement. It only inserts, through
-- unique indexes, so its plan cannot go stale: as a function with
-- `plan_cache_mode = auto`, each connection plans it a few times and then
-- keeps the plan.
--
-- The same statement as `PgStore::insert_records_at_once` built in Rust
-- until version 20: rows are JSON arrays of the cells of
-- `batch::NEW_RECORD_COLS`, in that order (a test checks the two agree);
-- a change to those columns is a new migration replacing this function.
-- The `WITH` parts nobody reads run last-first: `sc` reads `rc`, so the
-- counter rows are locked in the order every writer locks them.
CREATE FUNCTION ballast_insert_records(p_rows jsonb, p_actor text, p_shard integer, p_channel text)
RETURNS SETOF records
LANGUAGE plpgsql
SET plan_cache_mode = auto
AS $fn$
BEGIN
  RETURN QUERY
  WITH ins AS (INSERT INTO records (pipeline, pipeline_version, external_key, group_key, state, input, next_run_at, created_at, updated_at) SELECT value->>0, CAST(value->>1 AS BIGINT), value->>2, value->>3, value->>4, value #> '{5,0}', CAST(value->>6 AS BIGINT), CAST(value->>7 AS BIGINT), CAST(value->>8 AS BIGINT) FROM jsonb_array_elements(p_rows) WITH ORDINALITY AS j(value, key) WHERE true ORDER BY key ON CONFLICT (pipeline, external_key) DO NOTHING RETURNING *),
  ev AS (INSERT INTO events (record_id, at, kind, actor, audit, to_state) SELECT id, created_at, 'created', p_actor, FALSE, 'pending' FROM ins ORDER BY id),
  rc AS (INSERT INTO record_counts (pipeline, state, shard, n) SELECT pipeline, 'pending', p_shard, count(*) FROM ins GROUP BY pipeline ORDER BY pipeline COLLATE "C" ON CONFLICT (pipeline, state, shard) DO UPDATE SET n = record_counts.n + excluded.n RETURNING 1),
  sc AS (INSERT INTO step_counts (pipeline, step, state, shard, n) SELECT pipeline, '', 'pending', p_shard, count(*) FROM ins CROSS JOIN (SELECT count(*) FROM rc) AS rc_first GROUP BY pipeline ORDER BY pipeline COLLATE "C" ON CONFLICT (pipeline, step, state, shard) DO UPDATE SET n = step_counts.n + excluded.n),
  wake AS (SELECT pg_notify(p_channel, '') FROM (SELECT 1 FROM ins LIMIT 1) one)
  SELECT ins.* FROM ins LEFT JOIN wake ON TRUE;
END
$fn$;
