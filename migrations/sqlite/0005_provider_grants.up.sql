-- A provider's limits for the whole cluster (domain::permits): each row is
-- a batch of rate permits one node leased in one window (window_ms, the
-- window's length), or, with window_ms = 0, the concurrency slots a node
-- holds. A batch occupies its window from granted_at until a window after
-- done_at (its last call's completion), or, never closed (its node died),
-- until a window after it lapses. Rows are removed once they occupy nothing.
-- (AUTOINCREMENT: an id is never reused, so a late close of a removed grant
-- cannot close a newer one.)
CREATE TABLE provider_grants (
    id         INTEGER PRIMARY KEY AUTOINCREMENT,
    provider   TEXT    NOT NULL,
    node       TEXT    NOT NULL,
    window_ms  INTEGER NOT NULL CHECK (window_ms >= 0),
    count      INTEGER NOT NULL CHECK (count >= 0),
    wanted     INTEGER NOT NULL DEFAULT 0,
    granted_at INTEGER NOT NULL,
    expires_at INTEGER NOT NULL,
    done_at    INTEGER
);
CREATE INDEX provider_grants_window ON provider_grants (provider, window_ms);
CREATE UNIQUE INDEX provider_grants_slots ON provider_grants (provider, node) WHERE window_ms = 0;
