-- Records per (pipeline, group, state) for `/metrics` (issue 50 item 7):
-- maintained with every state change like `record_counts`, for records
-- that have a group and are not finished (pending, running, waiting,
-- retrying, parked): a pipeline without groups writes nothing here, and
-- the table holds the groups with work, not every group that ever had a
-- record (housekeeping deletes the keys that add up to nothing). Filled
-- once from `records` (one read of the records not finished).
CREATE TABLE group_counts (
    pipeline  TEXT    NOT NULL,
    group_key TEXT    NOT NULL,
    state     TEXT    NOT NULL,
    shard     INTEGER NOT NULL,
    n         INTEGER NOT NULL,
    PRIMARY KEY (pipeline, group_key, state, shard)
);
INSERT INTO group_counts (pipeline, group_key, state, shard, n)
SELECT pipeline, group_key, state, 0, COUNT(*)
FROM records
WHERE group_key <> '' AND state IN ('pending', 'running', 'waiting', 'retrying', 'parked')
GROUP BY pipeline, group_key, state;
