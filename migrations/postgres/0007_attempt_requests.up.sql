-- The request kept beside the reply (issue 19 item 4): each attempt stores
-- what was sent (method, URL, headers, the start of the body), credentials
-- removed (domain::request), as one JSON text. NULL for attempts written
-- before this migration and for webhook deliveries (nothing was sent).
ALTER TABLE attempts ADD COLUMN request TEXT;
