-- Notifications out (issue 50 item 1). `notices` is the outbox: one row
-- per subscription that wants a change, written in the transaction of
-- the change; delivered oldest first per (subscription, subject), so a
-- record's notices arrive in order. `pending` rows are due at `next_at`
-- (a delivery under way holds it a lease ahead, fenced by
-- `lease_token`). Rows are kept as long as the statistics, from their
-- change or their last delivery (a pending one too: a subscription off
-- or gone that long loses it). `notify_subscriptions` holds each subscription's failing
-- spell and whether it was turned off. `message_id` is the `webhook-id`
-- sent on every attempt: random, so that no restore or other
-- installation repeats one a subscriber has seen.
CREATE TABLE notices (
    id           INTEGER PRIMARY KEY AUTOINCREMENT,
    subscription TEXT    NOT NULL,
    message_id   TEXT    NOT NULL,
    topic        TEXT    NOT NULL,
    subject      TEXT    NOT NULL,
    record_id    INTEGER,
    pipeline     TEXT,
    group_key    TEXT,
    provider     TEXT,
    at           INTEGER NOT NULL,
    data         TEXT    NOT NULL,
    state        TEXT    NOT NULL DEFAULT 'pending'
                 CHECK (state IN ('pending', 'delivered', 'failed')),
    attempts     INTEGER NOT NULL DEFAULT 0,
    lease_token  INTEGER NOT NULL DEFAULT 0,
    next_at      INTEGER,
    last_at      INTEGER,
    status       INTEGER,
    reply        TEXT,
    CHECK ((state = 'pending') = (next_at IS NOT NULL))
);
CREATE INDEX notices_due ON notices (subscription, next_at) WHERE state = 'pending';
CREATE INDEX notices_heads ON notices (subscription, subject, id) WHERE state = 'pending';
CREATE INDEX notices_list ON notices (subscription, id);
CREATE INDEX notices_record ON notices (record_id) WHERE record_id IS NOT NULL;
CREATE INDEX notices_at ON notices (at);
CREATE TABLE notify_subscriptions (
    name            TEXT PRIMARY KEY,
    failing_since   INTEGER,
    disabled_at     INTEGER,
    disabled_reason TEXT,
    updated_at      INTEGER NOT NULL
);
