-- A user's colour scheme on the dashboard: 'light' or 'dark', or NULL to
-- follow the system's (`prefers-color-scheme`).
ALTER TABLE users ADD COLUMN theme TEXT CHECK (theme IN ('light', 'dark'));
