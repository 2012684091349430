-- An older binary reads a sealed value as the text it is: going down is
-- refused while a key is in use (`ballast rotate-data-key` with no
-- `database.encryption.key` opens every value and retires the keys).
DO $$
BEGIN
  IF EXISTS (SELECT 1 FROM data_keys WHERE retired_at IS NULL) THEN
    RAISE EXCEPTION 'values are sealed with a data key: run ballast rotate-data-key without database.encryption.key first';
  END IF;
END $$;
DROP TABLE data_keys;
ALTER TABLE nodes DROP COLUMN data_key;
