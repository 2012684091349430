-- A throttled reply (the provider said "slow down") is an outcome of its
-- own: it spends no attempt. The new CHECK is added NOT VALID and then
-- validated, so existing rows are checked without blocking writes.
ALTER TABLE attempts DROP CONSTRAINT attempts_outcome_check;
ALTER TABLE attempts ADD CONSTRAINT attempts_outcome_check
    CHECK (outcome IN ('success', 'pending', 'retry', 'fail', 'unknown', 'throttled')) NOT VALID;
ALTER TABLE attempts VALIDATE CONSTRAINT attempts_outcome_check;
