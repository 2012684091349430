-- An older binary reads a sealed value as the text it is: going down is
-- refused while a key is in use (`ballast rotate-data-key` with no
-- `database.encryption.key` opens every value and retires the keys).
CREATE TEMP TABLE down_27 (
    keys_in_use INTEGER CONSTRAINT run_rotate_data_key_without_a_key_first CHECK (keys_in_use = 0)
);
INSERT INTO down_27 SELECT count(*) FROM data_keys WHERE retired_at IS NULL;
DROP TABLE down_27;
DROP TABLE data_keys;
ALTER TABLE nodes DROP COLUMN data_key;
