-- When a notice's `retry_for` began, where not at its change: its last
-- redelivery, or its subscription turned on again (NULL: at `at`).
ALTER TABLE notices ADD COLUMN since BIGINT;
