-- Parked until a condition (issue 19 item 7): a parked record may resume
-- by itself at a moment (`park_until_at`, unix ms) or once its provider
-- takes calls again (`park_until_provider`). Both NULL: it waits for a
-- human, as every parked record did before. Set only while parked; any
-- move out of `parked` clears them.
ALTER TABLE records ADD COLUMN park_until_at INTEGER;
ALTER TABLE records ADD COLUMN park_until_provider TEXT;
-- The resumer's two questions: which records' time has come, and which
-- wait for a provider. Only records with a condition are in them.
CREATE INDEX records_park_until_at ON records (park_until_at, id) WHERE park_until_at IS NOT NULL;
CREATE INDEX records_park_until_provider ON records (park_until_provider, id) WHERE park_until_provider IS NOT NULL;
