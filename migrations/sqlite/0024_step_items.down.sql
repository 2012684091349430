DROP INDEX step_runs_items;
ALTER TABLE step_runs DROP COLUMN item_no;
ALTER TABLE step_runs DROP COLUMN item_of;
