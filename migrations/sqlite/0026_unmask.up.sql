-- Sensitive fields (a pipeline's or a provider's) are shown masked to
-- every user and token but those given `unmask` (none, at first).
ALTER TABLE users ADD COLUMN unmask INTEGER NOT NULL DEFAULT 0 CHECK (unmask IN (0, 1));
ALTER TABLE api_tokens ADD COLUMN unmask INTEGER NOT NULL DEFAULT 0 CHECK (unmask IN (0, 1));
