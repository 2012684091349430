DROP TABLE login_throttle;
CREATE TABLE login_throttle (
    username     TEXT    PRIMARY KEY,
    failures     INTEGER NOT NULL,
    window_start INTEGER NOT NULL,
    locked_until INTEGER
);

-- Sessions kept under hashed ids mean nothing to the older binary.
DELETE FROM sessions;
ALTER TABLE sessions DROP COLUMN last_seen_at;
ALTER TABLE api_tokens DROP COLUMN expires_at;
