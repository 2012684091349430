DROP INDEX records_park_until_provider;
DROP INDEX records_park_until_at;
ALTER TABLE records DROP COLUMN park_until_provider;
ALTER TABLE records DROP COLUMN park_until_at;
