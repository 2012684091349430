-- A claim writes a narrow lease, not the record (issue 51 item 1): one
-- row per leased record here, inserted by the claim, renewed in place,
-- deleted by the write that ends the pass, which proves the lease (owner
-- and token). `running` is no longer stored: a record is running while
-- it has a lease, and its stored state is the one it was claimed from.
-- `pipeline` and `group_key` copy the record's, for the caps that count
-- a group's leases. Tokens come from `lease_tokens` (one row, the last
-- token given), so a lease taken again never repeats an old one. Only
-- records that are not finished are leased, and only finished records
-- are purged.
CREATE TABLE leases (
    record_id  INTEGER PRIMARY KEY,
    owner      TEXT    NOT NULL,
    until      INTEGER NOT NULL,
    token      INTEGER NOT NULL,
    claimed_at INTEGER NOT NULL,
    pipeline   TEXT    NOT NULL,
    group_key  TEXT    NOT NULL
);
CREATE TABLE lease_tokens (
    id   INTEGER PRIMARY KEY CHECK (id = 1),
    last INTEGER NOT NULL
);
INSERT INTO lease_tokens (id, last) SELECT 1, COALESCE(max(lease_token), 0) FROM records WHERE state = 'running';
-- Records leased by an older version keep their lease here; their
-- stored state becomes `pending` (the state a lapsed lease goes back
-- to), due when the lease ends, as before.
INSERT INTO leases (record_id, owner, until, token, claimed_at, pipeline, group_key)
    SELECT id, lease_owner, lease_until, lease_token, COALESCE(claimed_at, updated_at), pipeline, group_key
    FROM records WHERE state = 'running';
UPDATE records SET state = 'pending', lease_owner = NULL, lease_until = NULL WHERE state = 'running';
