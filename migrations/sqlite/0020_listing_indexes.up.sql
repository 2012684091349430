-- `records_due` has served only the oldest-due metric since the claims
-- read the queues (migration 6); that metric now reads the queue index
-- (issue 22: one index fewer to keep per pass). On PostgreSQL the listing
-- indexes also leave running records out; SQLite rewrites only the
-- indexes whose columns an update changes, so they stay whole here.
DROP INDEX records_due;
