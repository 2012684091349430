//! Who is asking: session cookies (a JWT naming a server-side session),
//! bearer API tokens, the role extractors, CSRF tokens and the client
//! address. Every route states its minimum role through an extractor, so a
//! handler without one cannot be reached by accident without a session.

use std::marker::PhantomData;
use std::net::{IpAddr, SocketAddr};
use std::sync::Arc;

use axum::extract::{ConnectInfo, FromRequestParts};
use axum::http::request::Parts;
use axum::http::{HeaderMap, Request, header};
use axum_extra::extract::cookie::{Cookie, SameSite};
use hmac::{Hmac, KeyInit, Mac};
use jsonwebtoken::{Algorithm, DecodingKey, EncodingKey, Header, Validation};
use serde::{Deserialize, Serialize};
use sha2::{Digest, Sha256};

use crate::auth::secret::{self, RandomError};
use crate::domain::{Role, Session, SessionUse, UnixMs, User};
use crate::web::AppState;

use super::error::WebError;

/// The session cookie's name: `__Host-` binds it to this host, path `/`
/// and HTTPS. Without `Secure` (plain-HTTP localhost) the prefix is not
/// allowed, so the name changes with it.
pub const SECURE_COOKIE: &str = "__Host-ballast_session";
pub const PLAIN_COOKIE: &str = "ballast_session";
/// The device cookie's names (see [`AuthKeys::device_cookie`]), with and
/// without `Secure` as the session cookie's.
pub const SECURE_DEVICE_COOKIE: &str = "__Host-ballast_device";
pub const PLAIN_DEVICE_COOKIE: &str = "ballast_device";
/// How long a device cookie is honoured after the login that issued it.
pub const DEVICE_TTL_MS: i64 = 365 * 24 * 3_600_000;
/// The header htmx sends the CSRF token in.
pub const CSRF_HEADER: &str = "x-csrf-token";
/// The form field plain forms send it in.
pub const CSRF_FIELD: &str = "csrf";
/// API tokens start with this, so a leaked one is recognisable.
pub const TOKEN_PREFIX: &str = "blt_";

/// Keys and settings of the control plane's authentication.
pub struct AuthKeys {
    encoding: EncodingKey,
    decoding: DecodingKey,
    csrf_key: Vec<u8>,
    device_key: Vec<u8>,
    pub secure: bool,
    pub session_ttl_ms: i64,
    pub session_idle_ms: i64,
    pub trusted_proxies: Arc<[IpAddr]>,
    /// A hash of a random password: unknown users are verified against it so
    /// that they cost the same time as known ones.
    pub dummy_hash: String,
    /// `/metrics` bearer token from the configuration.
    pub metrics_token: Option<String>,
}

impl AuthKeys {
    pub fn new(
        secret: &[u8],
        config: &crate::config::ServerConfig,
        dummy_hash: String,
    ) -> Result<Self, WebError> {
        // Session signing and CSRF derivation use separate keys derived from
        // the one secret, so a CSRF token never helps forge a session.
        let derive = |label: &[u8]| -> Option<Vec<u8>> {
            let mut mac = <Hmac<Sha256> as KeyInit>::new_from_slice(secret).ok()?;
            mac.update(label);
            Some(mac.finalize().into_bytes().to_vec())
        };
        let (Some(session_key), Some(csrf_key), Some(device_key)) = (
            derive(b"ballast session v1"),
            derive(b"ballast csrf v1"),
            derive(b"ballast device v1"),
        ) else {
            return Err(WebError::Internal("cannot derive keys".into()));
        };
        let encoding = EncodingKey::from_secret(&session_key)
            .map_err(|e| WebError::Internal(format!("jwt key: {e}")))?;
        let decoding = DecodingKey::from_secret(&session_key)
            .map_err(|e| WebError::Internal(format!("jwt key: {e}")))?;
        Ok(AuthKeys {
            encoding,
            decoding,
            csrf_key,
            device_key,
            secure: config.secure_cookies,
            session_ttl_ms: i64::try_from(config.session_ttl.0.as_millis()).unwrap_or(i64::MAX),
            session_idle_ms: i64::try_from(config.session_idle.0.as_millis()).unwrap_or(i64::MAX),
            trusted_proxies: config.trusted_proxies.clone().into(),
            dummy_hash,
            metrics_token: config.metrics_token.as_ref().map(|s| s.expose().to_owned()),
        })
    }

    pub fn cookie_name(&self) -> &'static str {
        if self.secure {
            SECURE_COOKIE
        } else {
            PLAIN_COOKIE
        }
    }

    /// The signed token for a session, naming it by the id only the
    /// cookie carries (`sid`; the store keeps its [`session_key`]).
    pub fn issue(&self, sid: &str, session: &Session) -> Result<String, WebError> {
        let claims = Claims {
            sub: session.user_id.to_string(),
            sid: sid.to_owned(),
            iat: session.created_at / 1000,
            nbf: session.created_at / 1000,
            exp: session.expires_at / 1000,
        };
        jsonwebtoken::encode(&Header::new(Algorithm::HS256), &claims, &self.encoding)
            .map_err(|e| WebError::Internal(format!("jwt: {e}")))
    }

    /// The claims of a token that is HS256, correctly signed, and within its
    /// validity window. Anything else is `Unauthenticated`.
    pub fn verify(&self, token: &str) -> Result<Claims, WebError> {
        let mut validation = Validation::new(Algorithm::HS256);
        validation.algorithms = vec![Algorithm::HS256];
        validation.validate_nbf = true;
        validation.validate_exp = true;
        validation.leeway = 5;
        validation.set_required_spec_claims(&["exp", "nbf", "sub"]);
        jsonwebtoken::decode::<Claims>(token, &self.decoding, &validation)
            .map(|d| d.claims)
            .map_err(|_| WebError::Unauthenticated)
    }

    /// The session cookie carrying `token`.
    pub fn session_cookie(&self, token: String) -> Cookie<'static> {
        Cookie::build((self.cookie_name(), token))
            .path("/")
            .http_only(true)
            .secure(self.secure)
            .same_site(SameSite::Strict)
            .max_age(cookie_age(self.session_ttl_ms))
            .build()
    }

    /// A cookie that deletes the session cookie.
    pub fn clear_cookie(&self) -> Cookie<'static> {
        Cookie::build((self.cookie_name(), ""))
            .path("/")
            .http_only(true)
            .secure(self.secure)
            .same_site(SameSite::Strict)
            .max_age(cookie_age(0))
            .build()
    }

    /// The cookie that marks this browser as one that logged in to
    /// `username` at `now`: `issued.nonce.mac`, the MAC over the name too,
    /// so it vouches for that name only. A login on the name skips the
    /// name's failure delay when it carries one (OWASP's "device cookies"):
    /// an attacker's failures slow the attacker, not the name's owner.
    pub fn device_cookie(&self, username: &str, now: UnixMs) -> Result<Cookie<'static>, WebError> {
        let nonce = secret::hex::<16>().map_err(|e| WebError::Internal(e.to_string()))?;
        let mac = self.device_mac(username, now, &nonce);
        Ok(
            Cookie::build((self.device_cookie_name(), format!("{now}.{nonce}.{mac}")))
                .path("/")
                .http_only(true)
                .secure(self.secure)
                .same_site(SameSite::Strict)
                .max_age(cookie_age(DEVICE_TTL_MS))
                .build(),
        )
    }

    pub fn device_cookie_name(&self) -> &'static str {
        if self.secure {
            SECURE_DEVICE_COOKIE
        } else {
            PLAIN_DEVICE_COOKIE
        }
    }

    /// True when the request carries a device cookie this server issued
    /// for `username` within [`DEVICE_TTL_MS`] of `now`.
    pub fn device_ok(&self, headers: &HeaderMap, username: &str, now: UnixMs) -> bool {
        use subtle::ConstantTimeEq;
        let Some(value) = cookie_value(headers, self.device_cookie_name()) else {
            return false;
        };
        let mut parts = value.splitn(3, '.');
        let (Some(issued), Some(nonce), Some(mac)) = (parts.next(), parts.next(), parts.next())
        else {
            return false;
        };
        let Ok(issued) = issued.parse::<i64>() else {
            return false;
        };
        let expected = self.device_mac(username, issued, nonce);
        // A minute's grace for another node's clock ahead of this one's.
        issued < now.saturating_add(60_000)
            && now.saturating_sub(issued) < DEVICE_TTL_MS
            && !expected.is_empty()
            && bool::from(expected.as_bytes().ct_eq(mac.as_bytes()))
    }

    fn device_mac(&self, username: &str, issued: UnixMs, nonce: &str) -> String {
        match <Hmac<Sha256> as KeyInit>::new_from_slice(&self.device_key) {
            Ok(mut mac) => {
                // Lengths first, so no two (name, nonce) pairs read alike.
                mac.update(format!("{}:{username}:{issued}:{nonce}", username.len()).as_bytes());
                hex::encode(mac.finalize().into_bytes())
            }
            Err(_) => String::new(),
        }
    }

    /// The CSRF token of a session: a MAC of its id, so it needs no storage
    /// and dies with the session.
    pub fn csrf_token(&self, session_id: &str) -> String {
        match <Hmac<Sha256> as KeyInit>::new_from_slice(&self.csrf_key) {
            Ok(mut mac) => {
                mac.update(session_id.as_bytes());
                hex::encode(&mac.finalize().into_bytes()[..20])
            }
            Err(_) => String::new(),
        }
    }

    /// Constant-time check of a presented CSRF token.
    pub fn csrf_ok(&self, session_id: &str, presented: &str) -> bool {
        use subtle::ConstantTimeEq;
        let expected = self.csrf_token(session_id);
        !expected.is_empty() && bool::from(expected.as_bytes().ct_eq(presented.as_bytes()))
    }
}

fn cookie_age(ms: i64) -> time::Duration {
    time::Duration::milliseconds(ms)
}

/// What a session token says.
#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct Claims {
    pub sub: String,
    pub sid: String,
    pub iat: i64,
    pub nbf: i64,
    pub exp: i64,
}

/// Makes an API token: `blt_` and 40 hex digits from the OS's CSPRNG (160
/// bits). Returns (token, its hash, its display prefix).
pub fn new_api_token() -> Result<(String, String, String), RandomError> {
    let raw = format!("{TOKEN_PREFIX}{}", secret::hex::<20>()?);
    let hash = hash_token(&raw);
    let prefix = raw[..TOKEN_PREFIX.len() + 6].to_owned();
    Ok((raw, hash, prefix))
}

/// True for strings shaped like the tokens [`new_api_token`] makes.
pub fn well_formed(token: &str) -> bool {
    token.len() == TOKEN_PREFIX.len() + 40
        && token.starts_with(TOKEN_PREFIX)
        && token[TOKEN_PREFIX.len()..]
            .bytes()
            .all(|b| b.is_ascii_hexdigit())
}

/// The stored form of an API token.
pub fn hash_token(token: &str) -> String {
    hex::encode(Sha256::digest(token.as_bytes()))
}

/// The caller: a user with a live session, or an API token.
#[derive(Debug, Clone)]
pub struct Caller {
    /// The name written into audit events.
    pub actor: String,
    pub role: Role,
    /// The session id the cookie carries, for CSRF checks and logout;
    /// `None` for API tokens.
    pub session_id: Option<String>,
    /// The session's CSRF token, for pages to embed.
    pub csrf: String,
    pub user: Option<User>,
    /// The user answerable for what it does: itself, or the user who made
    /// the token (the tokens a token makes belong to that user too, so a
    /// change to the user revokes them all).
    pub owner: String,
    /// The pipelines the caller may see (`web::scope`).
    pub scope: crate::domain::scope::Scope,
    /// Sees sensitive fields in clear (`web::mask`).
    pub unmask: bool,
}

impl Caller {
    pub fn can(&self, role: Role) -> bool {
        rank(self.role) >= rank(role)
    }
}

/// Roles include the ones below them.
pub fn rank(role: Role) -> u8 {
    match role {
        Role::Viewer => 0,
        Role::Operator => 1,
        Role::Admin => 2,
    }
}

/// A minimum role, as a type for [`Authed`].
pub trait MinRole: Send + Sync + 'static {
    const ROLE: Role;
}
pub struct Viewer;
pub struct Operator;
pub struct Admin;
impl MinRole for Viewer {
    const ROLE: Role = Role::Viewer;
}
impl MinRole for Operator {
    const ROLE: Role = Role::Operator;
}
impl MinRole for Admin {
    const ROLE: Role = Role::Admin;
}

/// A dashboard caller with a live session and at least role `R`.
pub struct Authed<R: MinRole>(pub Caller, PhantomData<R>);

impl<R: MinRole> std::ops::Deref for Authed<R> {
    type Target = Caller;
    fn deref(&self) -> &Caller {
        &self.0
    }
}

impl<R: MinRole> FromRequestParts<AppState> for Authed<R> {
    type Rejection = WebError;

    async fn from_request_parts(parts: &mut Parts, state: &AppState) -> Result<Self, WebError> {
        let caller = match parts.extensions.get::<Caller>() {
            Some(c) => c.clone(),
            None => {
                let c = session_caller(&parts.headers, state).await?;
                parts.extensions.insert(c.clone());
                c
            }
        };
        if !caller.can(R::ROLE) {
            return Err(WebError::Forbidden);
        }
        Ok(Authed(caller, PhantomData))
    }
}

/// An API caller with a bearer token of at least role `R`.
pub struct Bearer<R: MinRole>(pub Caller, PhantomData<R>);

impl<R: MinRole> std::ops::Deref for Bearer<R> {
    type Target = Caller;
    fn deref(&self) -> &Caller {
        &self.0
    }
}

impl<R: MinRole> FromRequestParts<AppState> for Bearer<R> {
    type Rejection = WebError;

    async fn from_request_parts(parts: &mut Parts, state: &AppState) -> Result<Self, WebError> {
        let caller = token_caller(&parts.headers, state).await?;
        if !caller.can(R::ROLE) {
            return Err(WebError::Forbidden);
        }
        Ok(Bearer(caller, PhantomData))
    }
}

/// The value of cookie `name`, if the request carries it.
pub fn cookie_value(headers: &HeaderMap, name: &str) -> Option<String> {
    headers
        .get_all(header::COOKIE)
        .iter()
        .filter_map(|v| v.to_str().ok())
        .flat_map(|v| v.split(';'))
        .filter_map(|pair| Cookie::parse(pair.trim().to_owned()).ok())
        .find(|c| c.name() == name)
        .map(|c| c.value().to_owned())
}

/// The header a live page's own refresh carries (app.js).
pub const LIVE_HEADER: &str = "x-ballast-live";

/// Resolves the session cookie to a caller: a valid token, a live session
/// in the store (so logout and user changes apply at once) used within the
/// idle time, an enabled user.
pub async fn session_caller(headers: &HeaderMap, state: &AppState) -> Result<Caller, WebError> {
    let keys = &state.web.keys;
    let token = cookie_value(headers, keys.cookie_name()).ok_or(WebError::Unauthenticated)?;
    let claims = keys.verify(&token)?;
    let now = state.clock.now_ms();
    let session = state
        .db
        .session(&session_key(&claims.sid))
        .await?
        .filter(|s| s.user_id.to_string() == claims.sub)
        .ok_or(WebError::Unauthenticated)?;
    // A live page's own refresh (`X-Ballast-Live`, set by app.js) is no
    // one using the session: checked against the idle time, never noted.
    let refresh = headers.contains_key(LIVE_HEADER);
    match session.used(now, keys.session_idle_ms) {
        SessionUse::Dead => return Err(WebError::Unauthenticated),
        SessionUse::Live { touch: false } => {}
        SessionUse::Live { touch: true } if refresh => {}
        SessionUse::Live { touch: true } => {
            if let Err(e) = state.db.touch_session(&session.id, now).await {
                tracing::warn!(error = %e, "could not note a session's use");
            }
        }
    }
    let user = state
        .db
        .user_by_id(session.user_id)
        .await?
        .filter(|u| !u.disabled)
        .ok_or(WebError::Unauthenticated)?;
    Ok(Caller {
        actor: user.username.clone(),
        owner: user.username.clone(),
        role: user.role,
        csrf: keys.csrf_token(&claims.sid),
        session_id: Some(claims.sid),
        scope: user.pipelines.clone(),
        unmask: user.unmask,
        user: Some(user),
    })
}

/// Resolves `Authorization: Bearer …` to a caller.
pub async fn token_caller(headers: &HeaderMap, state: &AppState) -> Result<Caller, WebError> {
    let token = bearer(headers).ok_or(WebError::Unauthenticated)?;
    if !well_formed(token) {
        return Err(WebError::Unauthenticated);
    }
    let found = state
        .db
        .api_token_by_hash(&hash_token(token))
        .await?
        .ok_or(WebError::Unauthenticated)?;
    let now = state.clock.now_ms();
    if found.is_expired(now) {
        return Err(WebError::TokenExpired);
    }
    // A write at most once a minute per token, not one per request.
    if found.last_used_at.is_none_or(|t| t < now - 60_000) {
        if let Err(e) = state.db.touch_api_token(found.id, now).await {
            tracing::warn!(error = %e, "could not note an API token's use");
        }
    }
    Ok(Caller {
        actor: format!("token:{}", found.name),
        owner: found.created_by,
        role: found.role,
        session_id: None,
        csrf: String::new(),
        user: None,
        scope: found.pipelines,
        unmask: found.unmask,
    })
}

/// The bearer token of a request.
pub fn bearer(headers: &HeaderMap) -> Option<&str> {
    let value = headers.get(header::AUTHORIZATION)?.to_str().ok()?;
    let (scheme, token) = value.split_once(' ')?;
    scheme
        .eq_ignore_ascii_case("bearer")
        .then_some(token.trim())
}

/// The client's address: the peer, or, when the peer is a trusted proxy,
/// the last address in `X-Forwarded-For` that is not a trusted proxy.
pub fn client_ip(headers: &HeaderMap, peer: Option<IpAddr>, trusted: &[IpAddr]) -> Option<IpAddr> {
    // A dual-stack listener sees IPv4 clients as ::ffff:a.b.c.d.
    let peer = peer?.to_canonical();
    if !trusted.contains(&peer) {
        return Some(peer);
    }
    let forwarded = headers
        .get_all("x-forwarded-for")
        .iter()
        .filter_map(|v| v.to_str().ok())
        .flat_map(|v| v.split(','))
        .map(str::trim)
        .collect::<Vec<_>>();
    for hop in forwarded.iter().rev() {
        match hop.parse::<IpAddr>().map(|ip| ip.to_canonical()) {
            Ok(ip) if trusted.contains(&ip) => continue,
            Ok(ip) => return Some(ip),
            // An unparsable hop: stop believing the chain here.
            Err(_) => return Some(peer),
        }
    }
    Some(peer)
}

/// The client a per-address limit counts an address against: an IPv4
/// address alone, an IPv6 address by its /64. One subscriber or host is
/// routinely handed a whole /64, so counting its addresses one by one
/// would give a single client 2^64 budgets.
pub fn limit_key(ip: IpAddr) -> IpAddr {
    match ip.to_canonical() {
        IpAddr::V6(v6) => {
            let network = u128::from(v6) & !u128::from(u64::MAX);
            IpAddr::V6(std::net::Ipv6Addr::from(network))
        }
        v4 => v4,
    }
}

/// tower_governor key: the client address (see [`client_ip`]), IPv6 by
/// its /64 ([`limit_key`]).
#[derive(Clone)]
pub struct ClientIpKey {
    pub trusted: Arc<[IpAddr]>,
}

impl tower_governor::key_extractor::KeyExtractor for ClientIpKey {
    type Key = IpAddr;

    fn extract<T>(&self, req: &Request<T>) -> Result<IpAddr, tower_governor::GovernorError> {
        let peer = req
            .extensions()
            .get::<ConnectInfo<SocketAddr>>()
            .map(|c| c.0.ip());
        client_ip(req.headers(), peer, &self.trusted)
            .map(limit_key)
            .ok_or(tower_governor::GovernorError::UnableToExtractKey)
    }
}

/// tower_governor key for the API: the token's hash, or the client address
/// for requests without one (which fail authentication anyway).
#[derive(Clone)]
pub struct ApiKey {
    pub trusted: Arc<[IpAddr]>,
}

impl tower_governor::key_extractor::KeyExtractor for ApiKey {
    type Key = String;

    fn extract<T>(&self, req: &Request<T>) -> Result<String, tower_governor::GovernorError> {
        // Only strings shaped like our tokens get a bucket of their own;
        // anything else counts against the client's address.
        if let Some(token) = bearer(req.headers()).filter(|t| well_formed(t)) {
            return Ok(hash_token(token));
        }
        ClientIpKey {
            trusted: self.trusted.clone(),
        }
        .extract(req)
        .map(|ip| ip.to_string())
    }
}

/// A new session for `user`, valid for the configured lifetime: the id
/// the cookie carries (128 bits from the OS's CSPRNG) and the session as
/// stored, under that id's [`session_key`].
pub fn new_session(
    user: &User,
    now: UnixMs,
    ttl_ms: i64,
) -> Result<(String, Session), RandomError> {
    let sid = secret::hex::<16>()?;
    let session = Session {
        id: session_key(&sid),
        user_id: user.id,
        created_at: now,
        expires_at: now.saturating_add(ttl_ms),
        revoked_at: None,
        last_seen_at: now,
    };
    Ok((sid, session))
}

/// The stored form of a session id: its SHA-256, as for API tokens, so
/// that a copy of the database (a backup, say) names no session a cookie
/// could carry, even with the signing key beside it.
pub fn session_key(sid: &str) -> String {
    hash_token(sid)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn client_ip_trusts_forwarded_only_from_proxies() {
        let mut h = HeaderMap::new();
        h.insert("x-forwarded-for", "6.6.6.6, 10.0.0.7".parse().unwrap());
        let proxy: IpAddr = "10.0.0.1".parse().unwrap();
        let stranger: IpAddr = "9.9.9.9".parse().unwrap();
        assert_eq!(client_ip(&h, Some(stranger), &[proxy]), Some(stranger));
        assert_eq!(
            client_ip(&h, Some(proxy), &[proxy]),
            Some("10.0.0.7".parse().unwrap()),
            "the hop the proxy saw, not the spoofable first entry"
        );
        let second: IpAddr = "10.0.0.7".parse().unwrap();
        assert_eq!(
            client_ip(&h, Some(proxy), &[proxy, second]),
            Some("6.6.6.6".parse().unwrap())
        );
        assert_eq!(
            client_ip(&HeaderMap::new(), Some(proxy), &[proxy]),
            Some(proxy)
        );
    }

    #[test]
    fn limits_count_ipv6_clients_by_their_64() {
        let ip = |s: &str| s.parse::<IpAddr>().unwrap();
        let net = ip("2001:db8:1:2::");
        for one in [
            "2001:db8:1:2::1",
            "2001:db8:1:2:ffff:ffff:ffff:ffff",
            "2001:db8:1:2::",
        ] {
            assert_eq!(limit_key(ip(one)), net, "{one}");
        }
        assert_ne!(limit_key(ip("2001:db8:1:3::1")), net, "the next /64");
        assert_eq!(limit_key(ip("203.0.113.9")), ip("203.0.113.9"));
        assert_eq!(
            limit_key(ip("::ffff:203.0.113.9")),
            ip("203.0.113.9"),
            "a mapped IPv4 address is that address"
        );
        assert_ne!(limit_key(ip("203.0.113.9")), limit_key(ip("203.0.113.10")));
    }

    #[test]
    fn api_tokens_are_random_and_hashed() {
        let (a, ha, pa) = new_api_token().unwrap();
        let (b, _, _) = new_api_token().unwrap();
        assert_ne!(a, b);
        assert!(a.starts_with(TOKEN_PREFIX) && a.len() == 4 + 40, "{a}");
        assert!(well_formed(&a) && !well_formed("blt_xyz") && !well_formed(&format!("{a}0")));
        assert_eq!(ha, hash_token(&a));
        assert!(a.starts_with(&pa));
        assert!(!ha.contains(&a));
    }
}
