-- Control plane (PostgreSQL): API tokens, per-provider counters, login throttling, webhook delivery ids,
-- per-minute step statistics for the overview.

-- Bearer tokens for the JSON API and metrics. Only a SHA-256 of the token is
-- kept; `prefix` lets people recognise a token in lists.
CREATE TABLE api_tokens (
    id           BIGINT GENERATED ALWAYS AS IDENTITY PRIMARY KEY,
    name         TEXT    NOT NULL,
    token_hash   TEXT    NOT NULL UNIQUE,
    prefix       TEXT    NOT NULL,
    role         TEXT    NOT NULL CHECK (role IN ('viewer', 'operator', 'admin')),
    created_by   TEXT    NOT NULL,
    created_at   BIGINT  NOT NULL,
    last_used_at BIGINT,
    revoked_at   BIGINT
);

-- Records per (provider of the current step, state), maintained with every
-- state change like `record_counts`; sharded the same way.
CREATE TABLE provider_counts (
    provider TEXT    NOT NULL,
    state    TEXT    NOT NULL,
    shard    INTEGER NOT NULL,
    n        BIGINT  NOT NULL,
    PRIMARY KEY (provider, state, shard)
);

-- Failed logins per account name (known or not), shared by all nodes.
CREATE TABLE login_throttle (
    username     TEXT    PRIMARY KEY,
    failures     BIGINT  NOT NULL,
    window_start BIGINT  NOT NULL,
    locked_until BIGINT
);

-- Webhook delivery ids already applied: a redelivery changes nothing.
CREATE TABLE webhook_deliveries (
    provider    TEXT    NOT NULL,
    delivery_id TEXT    NOT NULL,
    received_at BIGINT  NOT NULL,
    PRIMARY KEY (provider, delivery_id)
);
CREATE INDEX webhook_deliveries_received ON webhook_deliveries (received_at);

-- Step statistics per minute, written by each node for itself (no two nodes
-- write one row), summed by the overview. `latency` is a JSON array of
-- counts per latency bucket (see `engine::stats`).
CREATE TABLE step_rollups (
    minute            BIGINT  NOT NULL,
    node              TEXT    NOT NULL,
    pipeline          TEXT    NOT NULL,
    step              TEXT    NOT NULL,
    provider          TEXT    NOT NULL,
    calls             BIGINT  NOT NULL,
    succeeded         BIGINT  NOT NULL,
    failed            BIGINT  NOT NULL,
    retried           BIGINT  NOT NULL,
    unknown           BIGINT  NOT NULL,
    records_succeeded BIGINT  NOT NULL,
    records_failed    BIGINT  NOT NULL,
    records_parked    BIGINT  NOT NULL,
    latency           TEXT    NOT NULL,
    PRIMARY KEY (minute, node, pipeline, step, provider)
);
