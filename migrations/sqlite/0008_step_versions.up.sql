-- Results keep their history (issue 19 item 5). A step run's result is
-- overwritten only by a new generation of the step (a replay, a rerun after
-- a reversal, an operator's retry of a step that had a result); the row it
-- replaces is kept here first, with what started it (`cause`: NULL for the
-- first run). The current version stays in `step_runs`, whose new `cause`
-- says what started its generation. Finished work writes nothing here: the
-- history costs only when a result is replaced.
ALTER TABLE step_runs ADD COLUMN cause TEXT;
CREATE TABLE step_versions (
    record_id     INTEGER NOT NULL REFERENCES records (id) ON DELETE CASCADE,
    step          TEXT    NOT NULL,
    generation    INTEGER NOT NULL,
    state         TEXT    NOT NULL,
    output        TEXT,
    job_id        TEXT,
    error_code    TEXT,
    cause         TEXT,
    started_at    INTEGER,
    finished_at   INTEGER,
    -- When it was replaced, and by what.
    replaced_at   INTEGER NOT NULL,
    replaced_by   TEXT    NOT NULL,
    PRIMARY KEY (record_id, step, generation)
);
