-- Nothing on PostgreSQL: its search index keeps each document
-- (`record_search.doc`), which the indexer compares with the new one
-- before it writes. SQLite's contentless FTS5 table keeps none, so there
-- the documents' digests get a table of their own.
SELECT 1;
