DROP TABLE search_progress;
DROP TABLE record_search;
