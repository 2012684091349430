-- Intent before the call (issue 23 item 1): for a provider declared
-- `at_most_once`, a side-effecting call is written here, durably, before
-- it leaves (grouped: one commit per batch of calls), and deleted in the
-- commit that stores its attempt. A row still here when a pass starts is
-- a call that went out from a node that stopped before recording its
-- reply: an ambiguous attempt, never resent blindly.
CREATE TABLE attempt_intents (
    id         INTEGER PRIMARY KEY AUTOINCREMENT,
    record_id  INTEGER NOT NULL REFERENCES records (id) ON DELETE CASCADE,
    step       TEXT    NOT NULL,
    provider   TEXT,
    attempt_no INTEGER NOT NULL,
    node       TEXT,
    sent_at    INTEGER NOT NULL,
    request    TEXT
);
CREATE INDEX attempt_intents_record ON attempt_intents (record_id, id);
