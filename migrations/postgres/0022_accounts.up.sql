-- Accounts (PostgreSQL).
--
-- Failed logins per account name slow that name's next password check
-- rather than lock it: the count and its latest failure are kept, and the
-- wait follows from them (`domain::login`). The old counts are dropped:
-- at worst a name under attack starts its count again.
DROP TABLE login_throttle;
CREATE TABLE login_throttle (
    username        TEXT    PRIMARY KEY,
    failures        BIGINT  NOT NULL,
    last_failure_at BIGINT  NOT NULL
);

-- Sessions are kept under the SHA-256 of the id their cookie carries (as
-- API tokens are), so that a copy of the database opens no session. The
-- sessions kept under their raw ids are dropped (as on SQLite, which has
-- no SHA-256 to carry them over with), and everyone logs in again.
DELETE FROM sessions;

-- When each session was last used (noted at most once a minute), for the
-- idle timeout beside the absolute one.
ALTER TABLE sessions ADD COLUMN last_seen_at BIGINT NOT NULL DEFAULT 0;

-- API tokens may expire (none: never, as every token made before).
ALTER TABLE api_tokens ADD COLUMN expires_at BIGINT;
