-- The hot path's foreign keys go (issue 22's profile: on PostgreSQL each
-- key is checked row by row, a query per row run by a trigger, which was
-- three quarters of the time of inserting a pass's step run and attempt,
-- and of a record's enqueue). Integrity is kept by the writers instead:
-- a pass writes its step run and attempt in the transaction that holds
-- its record's row locked (`FOR NO KEY UPDATE`, then the lease checked),
-- an operator's action likewise, and attempts kept after a lost lease
-- only while the record's row is locked; retention deletes a record's
-- attempts and step runs itself, in the transaction that deletes the
-- record. Pipeline versions are never deleted.
ALTER TABLE step_runs DROP CONSTRAINT step_runs_record_id_fkey;
ALTER TABLE attempts DROP CONSTRAINT attempts_record_id_fkey;
ALTER TABLE records DROP CONSTRAINT records_pipeline_version_fkey;
