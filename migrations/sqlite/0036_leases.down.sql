-- Leases go back into their records, stored as `running` with the lease
-- in the record's columns, due when the lease ends, as an older version
-- keeps them (a lease left on a record at rest goes).
UPDATE records SET state = 'running',
    lease_owner = (SELECT owner FROM leases l WHERE l.record_id = records.id),
    lease_until = (SELECT until FROM leases l WHERE l.record_id = records.id),
    next_run_at = (SELECT until FROM leases l WHERE l.record_id = records.id),
    lease_token = (SELECT token FROM leases l WHERE l.record_id = records.id),
    claimed_at = (SELECT claimed_at FROM leases l WHERE l.record_id = records.id)
    WHERE id IN (SELECT record_id FROM leases) AND state IN ('pending', 'waiting', 'retrying');
DROP TABLE lease_tokens;
DROP TABLE leases;
