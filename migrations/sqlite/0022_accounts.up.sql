-- Accounts (SQLite).
--
-- Failed logins per account name slow that name's next password check
-- rather than lock it: the count and its latest failure are kept, and the
-- wait follows from them (`domain::login`). The old counts are dropped:
-- at worst a name under attack starts its count again.
DROP TABLE login_throttle;
CREATE TABLE login_throttle (
    username        TEXT    PRIMARY KEY,
    failures        INTEGER NOT NULL,
    last_failure_at INTEGER NOT NULL
);
