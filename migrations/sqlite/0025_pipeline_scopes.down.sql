-- A binary without permissions per pipeline would let the accounts limited
-- to pipelines see every one: they are disabled (users) and revoked
-- (tokens) before the limits go, and their sessions ended.
UPDATE users SET disabled = 1 WHERE pipelines IS NOT NULL;
UPDATE sessions SET revoked_at = CAST(strftime('%s', 'now') AS INTEGER) * 1000
    WHERE revoked_at IS NULL AND user_id IN (SELECT id FROM users WHERE pipelines IS NOT NULL);
UPDATE api_tokens SET revoked_at = CAST(strftime('%s', 'now') AS INTEGER) * 1000
    WHERE revoked_at IS NULL AND pipelines IS NOT NULL;
ALTER TABLE api_tokens DROP COLUMN pipelines;
ALTER TABLE users DROP COLUMN pipelines;
