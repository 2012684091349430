-- A claim writes a narrow lease, not the record (issue 51 item 1): one
-- row per leased record here, inserted by the claim, its `until` renewed
-- in place (a HOT update: nothing indexed changes), deleted by the write
-- that ends the pass, which proves the lease (owner and token) under the
-- record's row lock. `running` is no longer stored: a record is running
-- while it has a lease, and its stored state is the one it was claimed
-- from. The claim locks the record's row before it writes the lease, and
-- every write that takes a lease away (a commit, a release, an operator's
-- action) holds the record's row first. `pipeline` and `group_key` copy
-- the record's, for the caps that count a group's leases. Tokens come
-- from one sequence, so a lease taken again never repeats an old one.
-- No foreign key, as on the other hot tables (migration 19): only
-- records that are not finished are leased, and only finished records
-- are purged.
CREATE SEQUENCE lease_tokens;
-- Past every token a pass still holds (those of running records).
SELECT setval('lease_tokens', COALESCE((SELECT max(lease_token) FROM records WHERE state = 'running'), 0) + 1, false);
CREATE TABLE leases (
    record_id  BIGINT PRIMARY KEY,
    owner      TEXT   NOT NULL,
    until      BIGINT NOT NULL,
    token      BIGINT NOT NULL,
    claimed_at BIGINT NOT NULL,
    pipeline   TEXT   NOT NULL,
    group_key  TEXT   NOT NULL
) WITH (fillfactor = 80, autovacuum_vacuum_scale_factor = 0, autovacuum_vacuum_threshold = 2000);
-- Rows come and go with every pass: every read on a hot path goes
-- through an index (the key, or the queues' below, for the caps' count),
-- never a scan of a table that holds dead rows until it is vacuumed (hence
-- the vacuum settings above: as soon as 2,000 rows are dead).
CREATE INDEX leases_queues ON leases (pipeline, group_key);
-- Records an older version leased keep their lease here; their stored
-- state becomes `pending` (the state a lapsed lease goes back to), due
-- when the lease ends, as before. An older node's commit of such a pass
-- finds no lease in the record and is refused (its work runs again once
-- the lease ends, as after any lapsed lease), and an older node can
-- claim no more: no record may be stored as `running`.
INSERT INTO leases (record_id, owner, until, token, claimed_at, pipeline, group_key)
    SELECT id, lease_owner, lease_until, lease_token, COALESCE(claimed_at, updated_at), pipeline, group_key
    FROM records WHERE state = 'running';
UPDATE records SET state = 'pending', lease_owner = NULL, lease_until = NULL WHERE state = 'running';
DROP INDEX records_running;
ALTER TABLE records ADD CONSTRAINT records_never_running CHECK (state <> 'running');
