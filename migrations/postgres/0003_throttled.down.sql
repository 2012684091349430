-- Back to the five outcomes: a throttled attempt reads as a retry.
ALTER TABLE attempts DROP CONSTRAINT attempts_outcome_check;
UPDATE attempts SET outcome = 'retry' WHERE outcome = 'throttled';
ALTER TABLE attempts ADD CONSTRAINT attempts_outcome_check
    CHECK (outcome IN ('success', 'pending', 'retry', 'fail', 'unknown'));

ALTER TABLE providers DROP COLUMN throttled_until;
