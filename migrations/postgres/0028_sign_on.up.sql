-- Single sign-on with OpenID Connect (issue 49 item 1): a user a provider
-- created is known by the provider's issuer and its subject, never by
-- name; a sign-in under way is kept until its person comes back (once:
-- the row is taken, so a replayed answer finds nothing), by the hash of
-- its state, with its nonce, its PKCE verifier and where to go next.
ALTER TABLE users ADD COLUMN oidc_issuer TEXT;
ALTER TABLE users ADD COLUMN oidc_subject TEXT;
CREATE UNIQUE INDEX users_oidc ON users (oidc_issuer, oidc_subject) WHERE oidc_subject IS NOT NULL;

CREATE TABLE sign_ons (
    state_key  TEXT   PRIMARY KEY,
    nonce      TEXT   NOT NULL,
    verifier   TEXT   NOT NULL,
    next       TEXT   NOT NULL,
    created_at BIGINT NOT NULL
);
CREATE INDEX sign_ons_created ON sign_ons (created_at);
