-- Without the permission, an older binary shows every value in clear.
ALTER TABLE api_tokens DROP COLUMN unmask;
ALTER TABLE users DROP COLUMN unmask;
