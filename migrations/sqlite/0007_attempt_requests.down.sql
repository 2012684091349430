ALTER TABLE attempts DROP COLUMN request;
