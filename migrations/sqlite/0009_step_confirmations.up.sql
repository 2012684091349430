-- Confirmations after success (issue 19 item 6): a job step with `confirm`
-- polls its job again after it succeeded. One row per step still to
-- confirm, written with the success and deleted when done; any node takes
-- a due one by moving its `due_at` past the poll (a lease), so two nodes
-- never ask at once. Steps without `confirm` write nothing here.
CREATE TABLE step_confirmations (
    record_id  INTEGER NOT NULL REFERENCES records (id) ON DELETE CASCADE,
    step       TEXT    NOT NULL,
    generation INTEGER NOT NULL,
    due_at     INTEGER NOT NULL,
    remaining  INTEGER NOT NULL,
    tries      INTEGER NOT NULL DEFAULT 0,
    PRIMARY KEY (record_id, step)
);
CREATE INDEX step_confirmations_due ON step_confirmations (due_at);
