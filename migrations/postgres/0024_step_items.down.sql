-- Items' runs mean nothing to a binary without steps for each item.
DELETE FROM step_runs WHERE item_of IS NOT NULL;
DROP INDEX step_runs_items;
ALTER TABLE step_runs DROP COLUMN item_no;
ALTER TABLE step_runs DROP COLUMN item_of;
