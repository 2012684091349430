-- Leases go back into their records, stored as `running` with the lease
-- in the record's columns, due when the lease ends, as an older version
-- keeps them (a lease left on a record at rest goes). Run with every
-- node of this version stopped.
ALTER TABLE records DROP CONSTRAINT records_never_running;
UPDATE records SET state = 'running', lease_owner = l.owner, lease_until = l.until,
    next_run_at = l.until, lease_token = l.token, claimed_at = l.claimed_at
    FROM leases l WHERE l.record_id = records.id AND records.state IN ('pending', 'waiting', 'retrying');
CREATE INDEX records_running ON records (id) WHERE state = 'running';
DROP TABLE leases;
DROP SEQUENCE lease_tokens;
