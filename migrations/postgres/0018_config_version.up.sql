-- The configuration version (`Config::version`: providers and pipelines)
-- each node runs, so the overview can say when nodes differ (NULL: a node
-- from before this migration, or one that has not said yet).
ALTER TABLE nodes ADD COLUMN config_version TEXT;
