-- Permissions per pipeline: a user or an API token may be limited to some
-- pipelines (names or patterns, joined by commas; NULL: every pipeline,
-- as every account made before).
ALTER TABLE users ADD COLUMN pipelines TEXT;
ALTER TABLE api_tokens ADD COLUMN pipelines TEXT;
