-- Ballast core schema (PostgreSQL). Timestamps are BIGINT unix milliseconds,
-- the same representation as on SQLite, so ordering and arithmetic agree.

-- One row per installation fact. `installation_id` makes idempotency keys
-- unique across installations that share a provider account.
CREATE TABLE meta (
    key   TEXT PRIMARY KEY,
    value TEXT NOT NULL
);
INSERT INTO meta (key, value) VALUES ('installation_id', substr(md5(random()::text || clock_timestamp()::text), 1, 16));

CREATE TABLE pipeline_versions (
    id          BIGINT GENERATED ALWAYS AS IDENTITY PRIMARY KEY,
    pipeline    TEXT    NOT NULL,
    hash        TEXT    NOT NULL,
    definition  JSONB   NOT NULL,
    created_at  BIGINT  NOT NULL,
    UNIQUE (pipeline, hash)
);

CREATE TABLE records (
    id               BIGINT GENERATED ALWAYS AS IDENTITY PRIMARY KEY,
    pipeline         TEXT    NOT NULL,
    pipeline_version BIGINT  REFERENCES pipeline_versions (id),
    external_key     TEXT COLLATE "C",
    state            TEXT    NOT NULL CHECK (state IN
                       ('pending', 'running', 'waiting', 'retrying',
                        'succeeded', 'failed', 'parked', 'cancelled')),
    input            JSONB   NOT NULL,
    next_run_at      BIGINT,
    lease_owner      TEXT,
    lease_until      BIGINT,
    lease_token      BIGINT  NOT NULL DEFAULT 0,
    step             TEXT,
    provider         TEXT,
    error_code       TEXT,
    reason           TEXT,
    created_at       BIGINT  NOT NULL,
    updated_at       BIGINT  NOT NULL,
    finished_at      BIGINT,
    UNIQUE (pipeline, external_key),
    -- A record needs a worker exactly when it is not at rest.
    CHECK ((next_run_at IS NOT NULL) = (state IN ('pending', 'running', 'waiting', 'retrying'))),
    -- Only running records are leased.
    CHECK ((lease_owner IS NOT NULL) = (state = 'running')),
    CHECK ((lease_until IS NOT NULL) = (state = 'running'))
);
-- Claiming: due records (and expired leases) in due order.
CREATE INDEX records_due ON records (next_run_at, id) WHERE next_run_at IS NOT NULL;
CREATE INDEX records_pipeline ON records (pipeline, id);
CREATE INDEX records_state ON records (state, id);
CREATE INDEX records_pipeline_state ON records (pipeline, state, id);
CREATE INDEX records_provider ON records (provider, id) WHERE provider IS NOT NULL;
CREATE INDEX records_step ON records (step, id) WHERE step IS NOT NULL;
CREATE INDEX records_error_code ON records (error_code, id) WHERE error_code IS NOT NULL;
CREATE INDEX records_external_key ON records (external_key) WHERE external_key IS NOT NULL;

CREATE TABLE step_runs (
    record_id       BIGINT  NOT NULL REFERENCES records (id) ON DELETE CASCADE,
    step            TEXT    NOT NULL,
    provider        TEXT,
    state           TEXT    NOT NULL CHECK (state IN
                      ('pending', 'running', 'waiting', 'retrying',
                       'succeeded', 'failed', 'skipped')),
    generation      INTEGER NOT NULL DEFAULT 0,
    attempts        INTEGER NOT NULL DEFAULT 0,
    -- Replies no rule understood, counted apart: they park after fewer tries.
    unknowns        INTEGER NOT NULL DEFAULT 0,
    idempotency_key TEXT    NOT NULL,
    job_id          TEXT,
    output          JSONB,
    error_code      TEXT,
    reason          TEXT,
    next_run_at     BIGINT,
    deadline_at     BIGINT,
    started_at      BIGINT,
    finished_at     BIGINT,
    updated_at      BIGINT  NOT NULL,
    PRIMARY KEY (record_id, step)
);
-- Callbacks name the provider's job id; ids are only unique per provider.
CREATE INDEX step_runs_job ON step_runs (provider, job_id) WHERE job_id IS NOT NULL;

CREATE TABLE attempts (
    id          BIGINT GENERATED ALWAYS AS IDENTITY PRIMARY KEY,
    record_id   BIGINT  NOT NULL REFERENCES records (id) ON DELETE CASCADE,
    step        TEXT    NOT NULL,
    provider    TEXT,
    attempt_no  INTEGER NOT NULL,
    node        TEXT,
    started_at  BIGINT  NOT NULL,
    duration_ms BIGINT  NOT NULL,
    http_status INTEGER,
    outcome     TEXT    NOT NULL CHECK (outcome IN ('success', 'pending', 'retry', 'fail', 'unknown')),
    error_code  TEXT,
    excerpt     TEXT
);
CREATE INDEX attempts_record ON attempts (record_id, id);

-- Events are kept forever: no foreign key, so deleting a record (retention)
-- never deletes its audit trail.
CREATE TABLE events (
    id         BIGINT GENERATED ALWAYS AS IDENTITY PRIMARY KEY,
    record_id  BIGINT,
    at         BIGINT  NOT NULL,
    kind       TEXT    NOT NULL,
    actor      TEXT    NOT NULL,
    audit      BOOLEAN NOT NULL DEFAULT FALSE,
    from_state TEXT,
    to_state   TEXT,
    step       TEXT,
    reason     TEXT,
    detail     JSONB
);
CREATE INDEX events_record ON events (record_id, id) WHERE record_id IS NOT NULL;
-- The audit log: operator actions only, by actor and by kind.
CREATE INDEX events_audit ON events (id) WHERE audit;
CREATE INDEX events_audit_actor ON events (actor, id) WHERE audit;
CREATE INDEX events_audit_kind ON events (kind, id) WHERE audit;

-- Records per (pipeline, state), maintained in the same transaction as every
-- state change. `shard` spreads concurrent writers over rows on PostgreSQL;
-- SQLite has one writer and uses shard 0.
CREATE TABLE record_counts (
    pipeline TEXT    NOT NULL,
    state    TEXT    NOT NULL,
    shard    INTEGER NOT NULL,
    n        BIGINT  NOT NULL,
    PRIMARY KEY (pipeline, state, shard)
);

CREATE TABLE users (
    id            BIGINT GENERATED ALWAYS AS IDENTITY PRIMARY KEY,
    username      TEXT    NOT NULL UNIQUE,
    password_hash TEXT    NOT NULL,
    role          TEXT    NOT NULL CHECK (role IN ('viewer', 'operator', 'admin')),
    disabled      BOOLEAN NOT NULL DEFAULT FALSE,
    created_at    BIGINT  NOT NULL,
    updated_at    BIGINT  NOT NULL
);

CREATE TABLE sessions (
    id         TEXT    PRIMARY KEY,
    user_id    BIGINT  NOT NULL REFERENCES users (id) ON DELETE CASCADE,
    created_at BIGINT  NOT NULL,
    expires_at BIGINT  NOT NULL,
    revoked_at BIGINT
);
CREATE INDEX sessions_user ON sessions (user_id);
CREATE INDEX sessions_expires ON sessions (expires_at);

-- Webhook deliveries for `callback` steps, kept as evidence. A delivery is
-- processed by the engine in the same transaction as the step result it
-- leads to; duplicates and late arrivals stay here, marked.
CREATE TABLE callbacks (
    id           BIGINT GENERATED ALWAYS AS IDENTITY PRIMARY KEY,
    provider     TEXT    NOT NULL,
    job_id       TEXT    NOT NULL,
    record_id    BIGINT  REFERENCES records (id) ON DELETE CASCADE,
    step         TEXT,
    received_at  BIGINT  NOT NULL,
    body         JSONB    NOT NULL,
    processed_at BIGINT
);
CREATE INDEX callbacks_pending ON callbacks (record_id, step, id) WHERE processed_at IS NULL;

CREATE TABLE nodes (
    id           TEXT    PRIMARY KEY,
    hostname     TEXT    NOT NULL,
    pid          BIGINT  NOT NULL,
    version      TEXT    NOT NULL,
    started_at   BIGINT  NOT NULL,
    heartbeat_at BIGINT  NOT NULL,
    draining     BOOLEAN NOT NULL DEFAULT FALSE
);

CREATE TABLE providers (
    provider           TEXT    PRIMARY KEY,
    breaker            TEXT    NOT NULL CHECK (breaker IN ('closed', 'open', 'half_open')),
    breaker_changed_at BIGINT  NOT NULL,
    open_until         BIGINT,
    paused             BOOLEAN NOT NULL DEFAULT FALSE,
    paused_by          TEXT,
    paused_reason      TEXT,
    stats              JSONB,
    updated_at         BIGINT  NOT NULL
);
