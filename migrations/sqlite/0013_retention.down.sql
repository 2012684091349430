DROP TABLE task_leases;
DROP TABLE retention_progress;
DROP INDEX callbacks_record;
DROP INDEX records_finished;
