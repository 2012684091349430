-- A pass's claim is no row of its own: the claim keeps its time in the
-- record (`claimed_at`, which nothing else writes), and the event that
-- ends the pass (worked, released, or the lease_expired a later claim
-- writes) keeps when the pass was claimed, and by which node (its lease
-- owner) when that is not its actor. Reading a record's events puts a
-- `claimed` event back before it. NULL on every other event, and on the
-- events of passes claimed by an older version (which wrote a `claimed`
-- row). Nullable columns: no table is rewritten.
ALTER TABLE records ADD COLUMN claimed_at BIGINT;
ALTER TABLE events ADD COLUMN claimed_at BIGINT;
ALTER TABLE events ADD COLUMN claimed_by TEXT;
