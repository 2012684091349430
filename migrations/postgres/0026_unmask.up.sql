-- Sensitive fields (a pipeline's or a provider's) are shown masked to
-- every user and token but those given `unmask` (none, at first).
ALTER TABLE users ADD COLUMN unmask BOOLEAN NOT NULL DEFAULT FALSE;
ALTER TABLE api_tokens ADD COLUMN unmask BOOLEAN NOT NULL DEFAULT FALSE;
