-- Triggers (issue 50 item 2): each delivery to `POST /triggers/NAME`,
-- with its verdict, for the triggers page; kept as long as the
-- statistics (the control plane's hourly upkeep deletes older ones).
-- Refused signatures are counted in `/metrics`, not kept here (anyone
-- could send them).
-- A new table: nothing else is locked, older nodes never read it.
CREATE TABLE trigger_deliveries (
    id          BIGINT GENERATED ALWAYS AS IDENTITY PRIMARY KEY,
    trigger     TEXT    NOT NULL,
    pipeline    TEXT    NOT NULL,
    received_at BIGINT  NOT NULL,
    verdict     TEXT    NOT NULL,
    status      INTEGER NOT NULL,
    event_id    TEXT,
    event_type  TEXT,
    record_id   BIGINT,
    detail      TEXT
);
CREATE INDEX trigger_deliveries_trigger ON trigger_deliveries (trigger, id);
CREATE INDEX trigger_deliveries_received ON trigger_deliveries (received_at);
