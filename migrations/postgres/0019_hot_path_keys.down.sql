-- Rows the keys would refuse (none, unless written outside Ballast) go
-- first, as a cascade would have taken them.
DELETE FROM attempts a WHERE NOT EXISTS (SELECT 1 FROM records r WHERE r.id = a.record_id);
DELETE FROM step_runs s WHERE NOT EXISTS (SELECT 1 FROM records r WHERE r.id = s.record_id);
ALTER TABLE records ADD CONSTRAINT records_pipeline_version_fkey
    FOREIGN KEY (pipeline_version) REFERENCES pipeline_versions (id);
ALTER TABLE attempts ADD CONSTRAINT attempts_record_id_fkey
    FOREIGN KEY (record_id) REFERENCES records (id) ON DELETE CASCADE;
ALTER TABLE step_runs ADD CONSTRAINT step_runs_record_id_fkey
    FOREIGN KEY (record_id) REFERENCES records (id) ON DELETE CASCADE;
