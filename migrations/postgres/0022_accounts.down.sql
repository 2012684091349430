DROP TABLE login_throttle;
CREATE TABLE login_throttle (
    username     TEXT    PRIMARY KEY,
    failures     BIGINT NOT NULL,
    window_start BIGINT NOT NULL,
    locked_until BIGINT
);

-- Sessions kept under hashed ids mean nothing to the older binary.
DELETE FROM sessions;
ALTER TABLE sessions DROP COLUMN last_seen_at;
ALTER TABLE api_tokens DROP COLUMN expires_at;
