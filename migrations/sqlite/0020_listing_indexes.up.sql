-- Fewer indexes to keep per pass (issue 22). `records_due` has served
-- nothing since the claims read the queues (migration 6);
-- `records_pipeline_state` goes: a pipeline and a state together are
-- searched through `records_state` in id windows, as every other pair of
-- filters is. (SQLite rewrites only the indexes whose columns an update
-- changes, so the listing indexes stay whole here; on PostgreSQL they
-- leave running records out.)
DROP INDEX records_due;
DROP INDEX records_pipeline_state;
