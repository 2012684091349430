ALTER TABLE nodes DROP COLUMN config_version;
