-- Users a provider created stay, as local users without a password that
-- any hash matches (an admin may give them one).
DROP TABLE sign_ons;
DROP INDEX users_oidc;
ALTER TABLE users DROP COLUMN oidc_subject;
ALTER TABLE users DROP COLUMN oidc_issuer;
