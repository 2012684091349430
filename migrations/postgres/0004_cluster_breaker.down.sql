ALTER TABLE providers DROP COLUMN probe_until;
ALTER TABLE providers DROP COLUMN probes_ok;
ALTER TABLE providers DROP COLUMN probes_out;
