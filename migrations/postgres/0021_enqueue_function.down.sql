DROP FUNCTION ballast_insert_records(jsonb, text, integer, text);
