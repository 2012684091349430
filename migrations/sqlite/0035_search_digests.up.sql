-- The digest of each record's search document (`domain::search::digest`),
-- kept because the contentless FTS5 table cannot give a document back:
-- the search indexer writes a document again only when its digest
-- changed (a poll that changes no word writes nothing here). A record
-- indexed before this version has no digest: its next indexing writes it
-- as before and keeps the digest. Removed with the record's document; a
-- digest says what the index holds, so whatever clears `record_search`
-- must clear this table with it.
CREATE TABLE search_digests (
    record_id INTEGER PRIMARY KEY,
    digest    INTEGER NOT NULL
);
