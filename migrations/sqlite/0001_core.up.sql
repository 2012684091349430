-- Ballast core schema (SQLite). Timestamps are INTEGER unix milliseconds.

-- One row per installation fact. `installation_id` makes idempotency keys
-- unique across installations that share a provider account.
CREATE TABLE meta (
    key   TEXT PRIMARY KEY,
    value TEXT NOT NULL
);
INSERT INTO meta (key, value) VALUES ('installation_id', lower(hex(randomblob(8))));

CREATE TABLE pipeline_versions (
    id          INTEGER PRIMARY KEY AUTOINCREMENT,
    pipeline    TEXT    NOT NULL,
    hash        TEXT    NOT NULL,
    definition  TEXT    NOT NULL,
    created_at  INTEGER NOT NULL,
    UNIQUE (pipeline, hash)
);

CREATE TABLE records (
    id               INTEGER PRIMARY KEY AUTOINCREMENT,
    pipeline         TEXT    NOT NULL,
    pipeline_version INTEGER REFERENCES pipeline_versions (id),
    external_key     TEXT,
    state            TEXT    NOT NULL CHECK (state IN
                       ('pending', 'running', 'waiting', 'retrying',
                        'succeeded', 'failed', 'parked', 'cancelled')),
    input            TEXT    NOT NULL,
    next_run_at      INTEGER,
    lease_owner      TEXT,
    lease_until      INTEGER,
    lease_token      INTEGER NOT NULL DEFAULT 0,
    step             TEXT,
    provider         TEXT,
    error_code       TEXT,
    reason           TEXT,
    created_at       INTEGER NOT NULL,
    updated_at       INTEGER NOT NULL,
    finished_at      INTEGER,
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
    record_id       INTEGER NOT NULL REFERENCES records (id) ON DELETE CASCADE,
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
    output          TEXT,
    error_code      TEXT,
    reason          TEXT,
    next_run_at     INTEGER,
    deadline_at     INTEGER,
    started_at      INTEGER,
    finished_at     INTEGER,
    updated_at      INTEGER NOT NULL,
    PRIMARY KEY (record_id, step)
);
-- Callbacks name the provider's job id; ids are only unique per provider.
CREATE INDEX step_runs_job ON step_runs (provider, job_id) WHERE job_id IS NOT NULL;

CREATE TABLE attempts (
    id          INTEGER PRIMARY KEY AUTOINCREMENT,
    record_id   INTEGER NOT NULL REFERENCES records (id) ON DELETE CASCADE,
    step        TEXT    NOT NULL,
    provider    TEXT,
    attempt_no  INTEGER NOT NULL,
    node        TEXT,
    started_at  INTEGER NOT NULL,
    duration_ms INTEGER NOT NULL,
    http_status INTEGER,
    outcome     TEXT    NOT NULL CHECK (outcome IN ('success', 'pending', 'retry', 'fail', 'unknown')),
    error_code  TEXT,
    excerpt     TEXT
);
CREATE INDEX attempts_record ON attempts (record_id, id);

-- Events are kept forever: no foreign key, so deleting a record (retention)
-- never deletes its audit trail.
CREATE TABLE events (
    id         INTEGER PRIMARY KEY AUTOINCREMENT,
    record_id  INTEGER,
    at         INTEGER NOT NULL,
    kind       TEXT    NOT NULL,
    actor      TEXT    NOT NULL,
    audit      INTEGER NOT NULL DEFAULT 0 CHECK (audit IN (0, 1)),
    from_state TEXT,
    to_state   TEXT,
    step       TEXT,
    reason     TEXT,
    detail     TEXT
);
CREATE INDEX events_record ON events (record_id, id) WHERE record_id IS NOT NULL;
-- The audit log: operator actions only, by actor and by kind.
CREATE INDEX events_audit ON events (id) WHERE audit = 1;
CREATE INDEX events_audit_actor ON events (actor, id) WHERE audit = 1;
CREATE INDEX events_audit_kind ON events (kind, id) WHERE audit = 1;

-- Records per (pipeline, state), maintained in the same transaction as every
-- state change. `shard` spreads concurrent writers over rows on PostgreSQL;
-- SQLite has one writer and uses shard 0.
CREATE TABLE record_counts (
    pipeline TEXT    NOT NULL,
    state    TEXT    NOT NULL,
    shard    INTEGER NOT NULL,
    n        INTEGER NOT NULL,
    PRIMARY KEY (pipeline, state, shard)
);

CREATE TABLE users (
    id            INTEGER PRIMARY KEY AUTOINCREMENT,
    username      TEXT    NOT NULL UNIQUE,
    password_hash TEXT    NOT NULL,
    role          TEXT    NOT NULL CHECK (role IN ('viewer', 'operator', 'admin')),
    disabled      INTEGER NOT NULL DEFAULT 0 CHECK (disabled IN (0, 1)),
    created_at    INTEGER NOT NULL,
    updated_at    INTEGER NOT NULL
);

CREATE TABLE sessions (
    id         TEXT    PRIMARY KEY,
    user_id    INTEGER NOT NULL REFERENCES users (id) ON DELETE CASCADE,
    created_at INTEGER NOT NULL,
    expires_at INTEGER NOT NULL,
    revoked_at INTEGER
);
CREATE INDEX sessions_user ON sessions (user_id);
CREATE INDEX sessions_expires ON sessions (expires_at);

-- Webhook deliveries for `callback` steps, kept as evidence. A delivery is
-- processed by the engine in the same transaction as the step result it
-- leads to; duplicates and late arrivals stay here, marked.
CREATE TABLE callbacks (
    id           INTEGER PRIMARY KEY AUTOINCREMENT,
    provider     TEXT    NOT NULL,
    job_id       TEXT    NOT NULL,
    record_id    INTEGER REFERENCES records (id) ON DELETE CASCADE,
    step         TEXT,
    received_at  INTEGER  NOT NULL,
    body         TEXT    NOT NULL,
    processed_at INTEGER
);
CREATE INDEX callbacks_pending ON callbacks (record_id, step, id) WHERE processed_at IS NULL;

CREATE TABLE nodes (
    id           TEXT    PRIMARY KEY,
    hostname     TEXT    NOT NULL,
    pid          INTEGER NOT NULL,
    version      TEXT    NOT NULL,
    started_at   INTEGER NOT NULL,
    heartbeat_at INTEGER NOT NULL,
    draining     INTEGER NOT NULL DEFAULT 0 CHECK (draining IN (0, 1))
);

CREATE TABLE providers (
    provider           TEXT    PRIMARY KEY,
    breaker            TEXT    NOT NULL CHECK (breaker IN ('closed', 'open', 'half_open')),
    breaker_changed_at INTEGER NOT NULL,
    open_until         INTEGER,
    paused             INTEGER NOT NULL DEFAULT 0 CHECK (paused IN (0, 1)),
    paused_by          TEXT,
    paused_reason      TEXT,
    stats              TEXT,
    updated_at         INTEGER NOT NULL
);
