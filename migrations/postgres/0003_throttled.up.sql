-- A throttled reply (the provider said "slow down") is an outcome of its
-- own: it spends no attempt. The CHECK on attempts admits it. (The
-- migration runs in one transaction holding the table's lock while the
-- existing rows are checked: a scan of attempts, once.)
ALTER TABLE attempts DROP CONSTRAINT attempts_outcome_check;
ALTER TABLE attempts ADD CONSTRAINT attempts_outcome_check
    CHECK (outcome IN ('success', 'pending', 'retry', 'fail', 'unknown', 'throttled'));

-- A provider's "slow down" pause (its Retry-After) is the cluster's: kept
-- here, so every node holds its calls until it ends.
ALTER TABLE providers ADD COLUMN throttled_until BIGINT;
