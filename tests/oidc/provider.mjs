// A real OpenID provider for Ballast's sign-on tests: panva's
// oidc-provider (certified by the OpenID Foundation), with its development
// login form (any password) and a first-party client that needs no consent.
//
// Environment: OIDC_CLIENT_SECRET (the `ballast` client's secret),
// OIDC_ACCOUNTS_FILE (a JSON file: login name -> its groups, read at each
// sign-in so a test may change them), OIDC_ID_TOKEN_TTL (seconds, default
// 60), OIDC_HOST (the issuer's host name, default 127.0.0.1: `localhost`
// makes it another site than a Ballast on 127.0.0.1, as a browser sees
// sites). Listens on 127.0.0.1 at a port of its own and
// prints one line, {"issuer": "..."}, once it serves.
import fs from 'node:fs';
import http from 'node:http';
import Provider from 'oidc-provider';

// Stdout carries the one line the test reads, then closes: the
// provider's own notices go to stderr.
console.info = console.error;
console.log = console.error;
process.stdout.on('error', () => {});

const groups = (id) => {
  const file = process.env.OIDC_ACCOUNTS_FILE;
  const accounts = file ? JSON.parse(fs.readFileSync(file, 'utf8')) : {};
  return accounts[id] ?? [];
};
const server = http.createServer();

server.listen(0, '127.0.0.1', () => {
  const host = process.env.OIDC_HOST ?? '127.0.0.1';
  const issuer = `http://${host}:${server.address().port}`;
  const provider = new Provider(issuer, {
    clients: [{
      client_id: 'ballast',
      client_secret: process.env.OIDC_CLIENT_SECRET,
      // A native client: loopback redirects match on any port (RFC 8252),
      // so the tests' servers may listen wherever they are given.
      application_type: 'native',
      redirect_uris: ['http://127.0.0.1/auth/oidc/callback'],
      post_logout_redirect_uris: ['http://127.0.0.1/login'],
      grant_types: ['authorization_code'],
      response_types: ['code'],
      token_endpoint_auth_method: 'client_secret_basic',
    }],
    pkce: { required: () => true },
    // The ID token carries the claims its scopes ask for (groups).
    conformIdTokenClaims: false,
    claims: {
      openid: ['sub'],
      profile: ['preferred_username', 'name'],
      groups: ['groups'],
    },
    scopes: ['openid', 'profile', 'groups'],
    features: {
      devInteractions: { enabled: true },
      rpInitiatedLogout: { enabled: true },
    },
    ttl: {
      IdToken: Number(process.env.OIDC_ID_TOKEN_TTL ?? 60),
    },
    cookies: { keys: ['a test provider cookie key'] },
    async findAccount(ctx, id) {
      return {
        accountId: id,
        async claims() {
          return { sub: id, preferred_username: id, name: id, groups: groups(id) };
        },
      };
    },
    // Ballast is first-party here: consent is implied.
    async loadExistingGrant(ctx) {
      const grant = new ctx.oidc.provider.Grant({
        clientId: ctx.oidc.client.clientId,
        accountId: ctx.oidc.session.accountId,
      });
      grant.addOIDCScope('openid profile groups');
      grant.addOIDCClaims(['preferred_username', 'name', 'groups']);
      await grant.save();
      return grant;
    },
  });
  provider.on('server_error', (ctx, err) => console.error('server_error', err));
  server.on('request', provider.callback());
  process.stdout.write(`${JSON.stringify({ issuer })}\n`);
});
