-- An older version rewrites every document it indexes.
DROP TABLE search_digests;
