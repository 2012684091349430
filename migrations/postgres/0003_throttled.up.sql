-- A throttled reply (the provider said "slow down") is an outcome of its
-- own: it spends no attempt. The CHECK on attempts admits it. (The
-- migration runs in one transaction holding the table's lock while the
-- existing rows are checked: a scan of attempts, once.)
ALTER TABLE attempts DROP CONSTRAINT attempts_outcome_check;
ALTER TABLE attempts ADD CONSTRAINT attempts_outcome_check
    CHECK (outcome IN ('success', 'pending', 'retry', 'fail', 'unknown', 'throttled'));
