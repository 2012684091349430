-- Child records (a step of kind `pipeline` starts one record of another
-- pipeline and waits for it): each child names its parent record and the
-- parent's step, so a child at rest wakes its parent, a parent's page
-- lists its children and cancelling a parent finds them. Most records
-- have no parent: the index holds only those that do.
ALTER TABLE records ADD COLUMN parent_id BIGINT;
ALTER TABLE records ADD COLUMN parent_step TEXT;
CREATE INDEX records_parent ON records (parent_id) WHERE parent_id IS NOT NULL;
