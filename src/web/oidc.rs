//! OpenID Connect, the relying party's side: the authorization code flow
//! with PKCE (RFC 7636, S256), the provider found by discovery, its ID
//! tokens checked against its published keys. The pages that drive it are
//! `web::pages::sign_on`; what a person's groups grant is
//! `config::oidc::OidcConfig::grant`.
//!
//! Checked on every ID token: its signature (an asymmetric algorithm the
//! provider lists, never `none` or a shared-secret one, by a key of its
//! JWKS), its issuer (exactly the configured one), its audience (this
//! client, and `azp` when there are several), its expiry and issue time
//! against the node's clock, and its nonce (the one this sign-in sent).

use std::sync::Arc;

use base64::Engine as _;
use jsonwebtoken::jwk::Jwk;
use jsonwebtoken::{Algorithm, DecodingKey, Validation};
use serde::Deserialize;
use serde_json::Value;
use sha2::{Digest, Sha256};

use crate::config::oidc::OidcConfig;
use crate::domain::{Clock, UnixMs};

/// How long a discovery document is used before it is fetched again.
const METADATA_TTL_MS: i64 = 3_600_000;
/// How long a failure to discover the provider holds the next try back.
const RETRY_MS: i64 = 10_000;
/// A key set is fetched again for an unknown key id at most this often.
const JWKS_REFETCH_MS: i64 = 60_000;
/// Clock skew allowed between the provider and this node.
const LEEWAY_S: i64 = 60;
/// The most any of the provider's replies may hold.
const MAX_REPLY: usize = 512 * 1024;
/// The most groups read from a token.
const MAX_GROUPS: usize = 1_000;
/// The signature algorithms an ID token may use: asymmetric ones only.
const ALGORITHMS: [Algorithm; 9] = [
    Algorithm::RS256,
    Algorithm::RS384,
    Algorithm::RS512,
    Algorithm::PS256,
    Algorithm::PS384,
    Algorithm::PS512,
    Algorithm::ES256,
    Algorithm::ES384,
    Algorithm::EdDSA,
];

/// What went wrong, said to the person signing in and in the log.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum OidcError {
    #[error("the sign-on provider cannot be reached: {0}")]
    Unreachable(String),
    #[error("the sign-on provider's discovery document is not usable: {0}")]
    Discovery(String),
    #[error("the sign-on provider refused the sign-in: {0}")]
    Refused(String),
    #[error("the ID token is not valid: {0}")]
    Token(String),
}

/// The parts of a provider's discovery document Ballast uses.
#[derive(Debug, Clone, Deserialize)]
pub struct Metadata {
    pub issuer: String,
    pub authorization_endpoint: String,
    pub token_endpoint: String,
    pub jwks_uri: String,
    #[serde(default)]
    pub end_session_endpoint: Option<String>,
    #[serde(default)]
    pub id_token_signing_alg_values_supported: Vec<String>,
    #[serde(default)]
    pub code_challenge_methods_supported: Option<Vec<String>>,
    #[serde(default)]
    pub token_endpoint_auth_methods_supported: Option<Vec<String>>,
    /// The provider names itself in its answers (RFC 9207): one that
    /// does not is then refused.
    #[serde(default)]
    pub authorization_response_iss_parameter_supported: bool,
}

/// A provider's key set: the keys this build can read (one it cannot, an
/// unknown curve say, is left out rather than failing the rest).
pub struct Keys(Vec<Jwk>);

impl<'de> Deserialize<'de> for Keys {
    fn deserialize<D: serde::Deserializer<'de>>(d: D) -> Result<Keys, D::Error> {
        #[derive(Deserialize)]
        struct Raw {
            keys: Vec<Value>,
        }
        let raw = Raw::deserialize(d)?;
        Ok(Keys(
            raw.keys
                .into_iter()
                .filter_map(|k| serde_json::from_value(k).ok())
                .collect(),
        ))
    }
}

/// A provider as last fetched.
struct Discovered {
    issuer: String,
    metadata: Arc<Metadata>,
    fetched_at: UnixMs,
    jwks: Arc<Keys>,
    jwks_at: UnixMs,
}

/// What the client knows: the provider as last fetched, and the last
/// failure to fetch it (for whom, when), which holds the next try back.
#[derive(Default)]
struct Cache {
    found: Option<Discovered>,
    failed: Option<(String, UnixMs, OidcError)>,
}

/// The node's client of the configured provider: its discovery document
/// and keys, cached (fetched again after an hour, when the issuer changes
/// with a reload, and for a key id not seen yet). One request fetches at
/// a time, never holding the cache while it waits on the network (a
/// cached answer never waits); after a failure the provider is left alone
/// for [`RETRY_MS`], unless a cached document can stand in.
pub struct Client {
    http: reqwest::Client,
    cache: std::sync::Mutex<Cache>,
    fetching: tokio::sync::Mutex<()>,
    /// The node's clock: what is cached and what failed is stamped when
    /// it happened (a fetch may take its whole timeout).
    clock: Arc<dyn Clock>,
}

/// The person an ID token names.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Person {
    pub subject: String,
    /// The name a new user is given (from the configured claim).
    pub username: String,
    pub groups: Vec<String>,
}

/// A fresh sign-in's secrets: state, nonce and PKCE verifier (each 256
/// bits from the OS's CSPRNG, base64url).
pub struct Fresh {
    pub state: String,
    pub nonce: String,
    pub verifier: String,
}

impl Fresh {
    pub fn new() -> Result<Fresh, crate::auth::secret::RandomError> {
        let b64 = |b: [u8; 32]| base64::engine::general_purpose::URL_SAFE_NO_PAD.encode(b);
        Ok(Fresh {
            state: b64(crate::auth::secret::bytes::<32>()?),
            nonce: b64(crate::auth::secret::bytes::<32>()?),
            verifier: b64(crate::auth::secret::bytes::<32>()?),
        })
    }
}

/// The S256 challenge of a PKCE verifier.
pub fn challenge(verifier: &str) -> String {
    base64::engine::general_purpose::URL_SAFE_NO_PAD.encode(Sha256::digest(verifier.as_bytes()))
}

/// How a state is kept in the store: its hash, so the table names no
/// state a browser could bring back.
pub fn state_key(state: &str) -> String {
    hex::encode(Sha256::digest(state.as_bytes()))
}

impl Client {
    pub fn new(clock: Arc<dyn Clock>) -> Result<Client, String> {
        let http = reqwest::Client::builder()
            .timeout(std::time::Duration::from_secs(10))
            .connect_timeout(std::time::Duration::from_secs(5))
            .redirect(reqwest::redirect::Policy::none())
            .build()
            .map_err(|e| format!("sign-on client: {e}"))?;
        Ok(Client {
            http,
            cache: std::sync::Mutex::new(Cache::default()),
            fetching: tokio::sync::Mutex::new(()),
            clock,
        })
    }

    fn cache(&self) -> std::sync::MutexGuard<'_, Cache> {
        self.cache
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner)
    }

    /// What the cache answers for `issuer` now: the document if fresh;
    /// the stale one (`Ok(Some)` too) while another request fetches or a
    /// failure holds fetching back; the recent failure when there is no
    /// document; `Ok(None)`: fetch it.
    fn cached(
        &self,
        issuer: &str,
        fetch_running: bool,
    ) -> Result<Option<Arc<Metadata>>, OidcError> {
        let now = self.clock.now_ms();
        let cache = self.cache();
        let found = cache.found.as_ref().filter(|d| d.issuer == issuer);
        if let Some(d) = found.filter(|d| now - d.fetched_at < METADATA_TTL_MS) {
            return Ok(Some(d.metadata.clone()));
        }
        let failed = cache
            .failed
            .as_ref()
            .filter(|(i, at, _)| i == issuer && now - at < RETRY_MS);
        match (found, failed) {
            (Some(d), Some(_)) => Ok(Some(d.metadata.clone())),
            (Some(d), None) if fetch_running => Ok(Some(d.metadata.clone())),
            (None, Some((_, _, e))) => Err(e.clone()),
            _ => Ok(None),
        }
    }

    /// The provider's discovery document, fetched if not cached for this
    /// issuer within the hour (a failed refresh keeps the one it has). One
    /// request fetches; the others take the stale document meanwhile, or
    /// wait for the first one's when there is none.
    pub async fn metadata(&self, cfg: &OidcConfig) -> Result<Arc<Metadata>, OidcError> {
        if let Some(m) = self.cached(&cfg.issuer, false)? {
            return Ok(m);
        }
        let _one = match self.fetching.try_lock() {
            Ok(one) => one,
            Err(_) => {
                if let Some(m) = self.cached(&cfg.issuer, true)? {
                    return Ok(m);
                }
                self.fetching.lock().await
            }
        };
        // Another request may have fetched it (or failed) meanwhile.
        if let Some(m) = self.cached(&cfg.issuer, false)? {
            return Ok(m);
        }
        let fetched = self.discover(cfg).await;
        let now = self.clock.now_ms();
        let mut cache = self.cache();
        match fetched {
            Ok((metadata, jwks)) => {
                let metadata = Arc::new(metadata);
                cache.found = Some(Discovered {
                    issuer: cfg.issuer.clone(),
                    metadata: metadata.clone(),
                    fetched_at: now,
                    jwks: Arc::new(jwks),
                    jwks_at: now,
                });
                cache.failed = None;
                Ok(metadata)
            }
            Err(e) => {
                cache.failed = Some((cfg.issuer.clone(), now, e.clone()));
                match cache.found.as_ref().filter(|d| d.issuer == cfg.issuer) {
                    Some(d) => {
                        tracing::warn!(error = %e, "sign-on: could not refresh the provider's discovery document; the last one stands");
                        Ok(d.metadata.clone())
                    }
                    None => Err(e),
                }
            }
        }
    }

    /// Fetches and checks the discovery document and the key set.
    async fn discover(&self, cfg: &OidcConfig) -> Result<(Metadata, Keys), OidcError> {
        let url = format!(
            "{}/.well-known/openid-configuration",
            cfg.issuer.trim_end_matches('/')
        );
        let metadata: Metadata = self.get_json(&url).await?;
        check_metadata(&metadata, &cfg.issuer)?;
        let jwks = self.get_json(&metadata.jwks_uri).await?;
        Ok((metadata, jwks))
    }

    async fn get_json<T: serde::de::DeserializeOwned>(&self, url: &str) -> Result<T, OidcError> {
        let resp = self
            .http
            .get(url)
            .header(reqwest::header::ACCEPT, "application/json")
            .send()
            .await
            .map_err(|e| OidcError::Unreachable(format!("{url}: {e}")))?;
        let status = resp.status();
        let body = crate::engine::token::read_bounded(resp, MAX_REPLY)
            .await
            .map_err(|e| OidcError::Unreachable(format!("{url}: {e}")))?;
        if !status.is_success() {
            return Err(OidcError::Discovery(format!("{url} answered {status}")));
        }
        serde_json::from_slice(&body)
            .map_err(|e| OidcError::Discovery(format!("{url} is not what was expected: {e}")))
    }

    /// Exchanges `code` for the provider's tokens and returns the ID token.
    pub async fn exchange(
        &self,
        (cfg, metadata): (&OidcConfig, &Metadata),
        redirect: &str,
        code: &str,
        verifier: &str,
    ) -> Result<String, OidcError> {
        let mut form = vec![
            ("grant_type", "authorization_code"),
            ("code", code),
            ("redirect_uri", redirect),
            ("code_verifier", verifier),
        ];
        let mut req = self.http.post(&metadata.token_endpoint);
        match &cfg.client_secret {
            Some(secret) if secret_in_body(metadata) => {
                form.push(("client_id", &cfg.client_id));
                form.push(("client_secret", secret.expose()));
            }
            // RFC 6749 §2.3.1: both form-encoded, then HTTP Basic.
            Some(secret) => {
                let enc =
                    |s: &str| form_urlencoded::byte_serialize(s.as_bytes()).collect::<String>();
                req = req.basic_auth(enc(&cfg.client_id), Some(enc(secret.expose())));
            }
            None => form.push(("client_id", &cfg.client_id)),
        }
        let body = form_urlencoded::Serializer::new(String::new())
            .extend_pairs(form)
            .finish();
        let resp = req
            .header(
                reqwest::header::CONTENT_TYPE,
                "application/x-www-form-urlencoded",
            )
            .header(reqwest::header::ACCEPT, "application/json")
            .body(body)
            .send()
            .await
            .map_err(|e| OidcError::Unreachable(format!("token endpoint: {e}")))?;
        let status = resp.status();
        let body = crate::engine::token::read_bounded(resp, MAX_REPLY)
            .await
            .map_err(|e| OidcError::Unreachable(format!("token endpoint: {e}")))?;
        let reply: Value = serde_json::from_slice(&body).unwrap_or(Value::Null);
        if !status.is_success() {
            let said = |k: &str| {
                reply
                    .get(k)
                    .and_then(Value::as_str)
                    .unwrap_or("")
                    .to_owned()
            };
            let what = format!("{} {}", said("error"), said("error_description"));
            let what = what.trim();
            return Err(OidcError::Refused(format!(
                "the token endpoint answered {status}{}{what}",
                if what.is_empty() { "" } else { ": " }
            )));
        }
        reply
            .get("id_token")
            .and_then(Value::as_str)
            .map(str::to_owned)
            .ok_or_else(|| OidcError::Refused("the token endpoint returned no ID token".into()))
    }

    /// The person `id_token` names, once it is shown valid (see the
    /// module's list) for this sign-in's `nonce` at `now`.
    pub async fn verify(
        &self,
        cfg: &OidcConfig,
        id_token: &str,
        nonce: &str,
        now: UnixMs,
    ) -> Result<Person, OidcError> {
        let header = jsonwebtoken::decode_header(id_token).map_err(|e| {
            tracing::warn!(error = %e, "sign-on: an unreadable ID token");
            OidcError::Token("it cannot be read".into())
        })?;
        let metadata = self.metadata(cfg).await?;
        let listed = &metadata.id_token_signing_alg_values_supported;
        if !ALGORITHMS.contains(&header.alg)
            || !(listed.is_empty() || listed.iter().any(|a| *a == format!("{:?}", header.alg)))
        {
            return Err(OidcError::Token(format!(
                "signed with {:?}, which is not accepted",
                header.alg
            )));
        }
        let mut validation = Validation::new(header.alg);
        validation.algorithms = vec![header.alg];
        // Checked below against the node's clock and the configuration.
        validation.validate_exp = false;
        validation.validate_nbf = false;
        validation.validate_aud = false;
        validation.required_spec_claims = Default::default();
        let kid = header.kid.as_deref();
        // The keys held first; then, if none verifies, the key set fetched
        // again (the provider may have rotated, with or without a kid).
        for fresh in [false, true] {
            let keys = self.keys(cfg, kid, header.alg, fresh).await?;
            for key in &keys {
                match jsonwebtoken::decode::<Value>(id_token, key, &validation) {
                    Ok(d) => {
                        return check_claims(cfg, &d.claims, nonce, now).map_err(OidcError::Token);
                    }
                    Err(e) => {
                        tracing::debug!(error = %e, "sign-on: a key did not verify the ID token")
                    }
                }
            }
        }
        Err(OidcError::Token(
            "its signature does not verify with the provider's keys".into(),
        ))
    }

    /// The provider's keys that may have signed a token naming `kid` with
    /// `alg`: those held, or (`fresh`) those of the key set fetched again,
    /// one request at a time and at most once a minute (an error when it
    /// may not be fetched yet or has none that fits).
    async fn keys(
        &self,
        cfg: &OidcConfig,
        kid: Option<&str>,
        alg: Algorithm,
        fresh: bool,
    ) -> Result<Vec<DecodingKey>, OidcError> {
        let held = |c: &Cache| {
            c.found
                .as_ref()
                .filter(|d| d.issuer == cfg.issuer)
                .map(|d| (d.jwks.clone(), d.jwks_at, d.metadata.jwks_uri.clone()))
                .ok_or_else(|| OidcError::Discovery("not fetched yet".into()))
        };
        let none = || {
            OidcError::Token(format!(
                "no key of the provider's verifies it (key id {kid:?})"
            ))
        };
        if !fresh {
            let (jwks, _, _) = held(&self.cache())?;
            return candidates(&jwks, kid, alg);
        }
        let _one = self.fetching.lock().await;
        let (_, jwks_at, uri) = held(&self.cache())?;
        if self.clock.now_ms() - jwks_at < JWKS_REFETCH_MS {
            return Err(none());
        }
        let fetched = self.get_json::<Keys>(&uri).await;
        let now = self.clock.now_ms();
        let mut cache = self.cache();
        let Some(d) = cache.found.as_mut().filter(|d| d.issuer == cfg.issuer) else {
            return Err(none());
        };
        // Tried now, whatever came of it: the next try waits a minute.
        d.jwks_at = now;
        let fresh = Arc::new(fetched?);
        d.jwks = fresh.clone();
        drop(cache);
        let keys = candidates(&fresh, kid, alg)?;
        match keys.is_empty() {
            true => Err(none()),
            false => Ok(keys),
        }
    }
}

/// Whether the client secret goes in the form: only when the provider
/// lists `client_secret_post` and not `client_secret_basic` (the default).
fn secret_in_body(metadata: &Metadata) -> bool {
    metadata
        .token_endpoint_auth_methods_supported
        .as_ref()
        .is_some_and(|m| {
            m.iter().any(|x| x == "client_secret_post")
                && !m.iter().any(|x| x == "client_secret_basic")
        })
}

/// Checks a discovery document: the issuer it states is exactly the one
/// configured (OpenID Connect Discovery §4.3), and S256 is offered when
/// methods are listed.
fn check_metadata(m: &Metadata, issuer: &str) -> Result<(), OidcError> {
    if m.issuer != issuer {
        return Err(OidcError::Discovery(format!(
            "it names the issuer `{}`, not `{issuer}` as configured",
            m.issuer
        )));
    }
    let end = m.end_session_endpoint.as_ref();
    for (what, url) in [
        ("authorization_endpoint", Some(&m.authorization_endpoint)),
        ("token_endpoint", Some(&m.token_endpoint)),
        ("jwks_uri", Some(&m.jwks_uri)),
        ("end_session_endpoint", end),
    ]
    .into_iter()
    .filter_map(|(what, url)| Some((what, url?)))
    {
        if !crate::config::oidc::safe_url(url) {
            return Err(OidcError::Discovery(format!(
                "its {what} `{url}` is not an https:// URL (http:// only on localhost)"
            )));
        }
    }
    if let Some(methods) = &m.code_challenge_methods_supported {
        if !methods.iter().any(|x| x == "S256") {
            return Err(OidcError::Discovery(
                "it does not offer PKCE with S256".into(),
            ));
        }
    }
    Ok(())
}

/// The signing keys of `jwks` that may have made a signature with `alg`:
/// those named `kid`, or without a kid every key of `alg`'s kind (keys
/// meant for encryption never, nor keys stated for another algorithm);
/// refused when keys are named `kid` but none of them fits.
fn candidates(
    jwks: &Keys,
    kid: Option<&str>,
    alg: Algorithm,
) -> Result<Vec<DecodingKey>, OidcError> {
    let named: Vec<&Jwk> = jwks
        .0
        .iter()
        .filter(|k| {
            !matches!(
                k.common.public_key_use,
                Some(jsonwebtoken::jwk::PublicKeyUse::Encryption)
            )
        })
        .filter(|k| kid.is_none() || k.common.key_id.as_deref() == kid)
        .collect();
    let mut keys = Vec::new();
    let mut refused = None;
    for jwk in &named {
        let stated = jwk.common.key_algorithm.map(|a| format!("{a:?}"));
        if let Some(stated) = stated.filter(|s| *s != format!("{alg:?}")) {
            refused = Some(format!("signed with {alg:?} by a key meant for {stated}"));
            continue;
        }
        match DecodingKey::from_jwk(jwk) {
            Ok(key) if key.family() == alg.family() => keys.push(key),
            Ok(_) => refused = Some(format!("signed with {alg:?} by a key of another kind")),
            Err(e) => {
                tracing::warn!(error = %e, "sign-on: a key of the provider's cannot be read");
                refused = Some("signed by a key that cannot be read".into());
            }
        }
    }
    match (keys.is_empty(), kid, refused) {
        (true, Some(_), Some(why)) => Err(OidcError::Token(why)),
        _ => Ok(keys),
    }
}

/// Checks an ID token's claims (its signature already verified) and reads
/// the person from them.
pub fn check_claims(
    cfg: &OidcConfig,
    claims: &Value,
    nonce: &str,
    now: UnixMs,
) -> Result<Person, String> {
    let text = |k: &str| claims.get(k).and_then(Value::as_str);
    let number = |k: &str| claims.get(k).and_then(Value::as_i64);
    match text("iss") {
        Some(iss) if iss == cfg.issuer => {}
        other => {
            return Err(format!(
                "issued by {other:?}, not `{}` as configured",
                cfg.issuer
            ));
        }
    }
    let audience: Vec<&str> = match claims.get("aud") {
        Some(Value::String(a)) => vec![a.as_str()],
        Some(Value::Array(a)) => a.iter().filter_map(Value::as_str).collect(),
        _ => Vec::new(),
    };
    if !audience.contains(&cfg.client_id.as_str()) {
        return Err(format!("meant for {audience:?}, not this client"));
    }
    let azp = text("azp");
    if (audience.len() > 1 || azp.is_some()) && azp != Some(cfg.client_id.as_str()) {
        return Err(format!("authorized for {azp:?}, not this client"));
    }
    let now_s = now.div_euclid(1000);
    let exp = number("exp").ok_or("it has no expiry")?;
    if now_s >= exp + LEEWAY_S {
        return Err(format!("it expired {} s ago", now_s - exp));
    }
    let iat = number("iat").ok_or("it has no issue time")?;
    if iat > now_s + LEEWAY_S || number("nbf").is_some_and(|nbf| nbf > now_s + LEEWAY_S) {
        return Err("it is not valid yet (is a clock wrong?)".into());
    }
    if text("nonce") != Some(nonce) {
        return Err("its nonce is not this sign-in's".into());
    }
    let subject = text("sub").filter(|s| !s.is_empty() && s.len() <= 255);
    let subject = subject.ok_or("it names no subject")?.to_owned();
    let groups = match claims.get(&cfg.groups_claim) {
        Some(Value::Array(a)) => a
            .iter()
            .filter_map(Value::as_str)
            .take(MAX_GROUPS)
            .map(str::to_owned)
            .collect(),
        Some(Value::String(g)) => vec![g.clone()],
        _ => Vec::new(),
    };
    let username = username(text(&cfg.username_claim), &subject);
    Ok(Person {
        subject,
        username,
        groups,
    })
}

/// A user name made from a claim: lower case, characters a name cannot
/// hold replaced by `-`, at most 64; from the subject's hash when nothing
/// is left.
pub fn username(claim: Option<&str>, subject: &str) -> String {
    let made: String = claim
        .unwrap_or_default()
        .trim()
        .chars()
        .flat_map(char::to_lowercase)
        .map(|c| match c {
            'a'..='z' | '0'..='9' | '.' | '_' | '-' | '@' => c,
            _ => '-',
        })
        .take(64)
        .collect();
    if made.trim_matches('-').is_empty() {
        format!(
            "sso-{}",
            &hex::encode(Sha256::digest(subject.as_bytes()))[..12]
        )
    } else {
        made
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    fn cfg() -> OidcConfig {
        toml::from_str(
            r#"issuer = "https://id.example.com"
               client_id = "ballast"
               redirect_url = "https://b.example.com/auth/oidc/callback""#,
        )
        .unwrap()
    }

    const NOW: i64 = 1_800_000_000_000;

    fn claims() -> Value {
        json!({
            "iss": "https://id.example.com", "aud": "ballast", "sub": "u-1",
            "exp": NOW / 1000 + 60, "iat": NOW / 1000 - 5, "nonce": "n-1",
            "preferred_username": "Alice.Smith@Example.com", "groups": ["ops", 7, "support"],
        })
    }

    #[test]
    fn a_valid_token_names_its_person() {
        let p = check_claims(&cfg(), &claims(), "n-1", NOW).unwrap();
        assert_eq!(p.subject, "u-1");
        assert_eq!(p.username, "alice.smith@example.com");
        assert_eq!(p.groups, ["ops", "support"]);
    }

    #[test]
    fn every_claim_that_is_wrong_refuses_the_token() {
        let refused = |edit: &dyn Fn(&mut Value), nonce: &str, now: i64| {
            let mut c = claims();
            edit(&mut c);
            check_claims(&cfg(), &c, nonce, now).unwrap_err()
        };
        let keep = |_: &mut Value| {};
        assert!(
            refused(
                &|c| c["iss"] = json!("https://evil.example.com"),
                "n-1",
                NOW
            )
            .contains("issued by")
        );
        assert!(refused(&|c| c["aud"] = json!("other"), "n-1", NOW).contains("meant for"));
        assert!(
            refused(&|c| c["aud"] = json!(["ballast", "other"]), "n-1", NOW)
                .contains("authorized for")
        );
        check_claims(
            &cfg(),
            &{
                let mut c = claims();
                c["aud"] = json!(["ballast", "other"]);
                c["azp"] = json!("ballast");
                c
            },
            "n-1",
            NOW,
        )
        .unwrap();
        assert!(refused(&keep, "n-2", NOW).contains("nonce"));
        let drop = |k: &'static str| {
            move |c: &mut Value| {
                c.as_object_mut().unwrap().remove(k);
            }
        };
        assert!(refused(&drop("nonce"), "n-1", NOW).contains("nonce"));
        assert!(refused(&keep, "n-1", NOW + 121_000).contains("expired"));
        check_claims(&cfg(), &claims(), "n-1", NOW + 119_000).unwrap();
        assert!(refused(&keep, "n-1", NOW - 120_000).contains("not valid yet"));
        assert!(refused(&|c| c["sub"] = json!(""), "n-1", NOW).contains("subject"));
        assert!(refused(&drop("exp"), "n-1", NOW).contains("expiry"));
    }

    #[test]
    fn names_are_made_from_claims_or_the_subject() {
        assert_eq!(username(Some("Bob"), "s"), "bob");
        assert_eq!(username(Some("Zoë Müller"), "s"), "zo--m-ller");
        let anon = username(None, "subject-1");
        assert!(anon.starts_with("sso-") && anon.len() == 16, "{anon}");
        assert_eq!(username(Some("   "), "subject-1"), anon);
        assert_eq!(username(Some(&"x".repeat(100)), "s").len(), 64);
    }

    /// RFC 7517 appendix A.1's public keys, with `kid`, `use` and `alg` as given.
    fn keys(list: &[(&str, Option<&str>, Option<&str>, &str)]) -> Keys {
        let rsa_n = "0vx7agoebGcQSuuPiLJXZptN9nndrQmbXEps2aiAFbWhM78LhWx4cbbfAAtVT86zwu1RK7aPFFxuhDR1L6tSoc_BJECPebWKRXjBZCiFV4n3oknjhMstn64tZ_2W-5JsGY4Hc5n9yBXArwl93lqt7_RN5w6Cf0h4QyQ5v-65YGjQR0_FDW2QvzqY368QQMicAtaSqzs8KJZgnYb9c7d0zgdAZHzu6qMQvRL5hajrn1n91CbOpbISD08qNLyrdkt-bFTWhAI4vMQFh6WeZu0fM4lFd2NcRwr3XPksINHaQ-G_xBniIqbw0Ls1jF44-csFCur-kEgU8awapJzKnqDKgw";
        let jwks: Vec<Value> = list
            .iter()
            .map(|(kid, usage, alg, kty)| {
                let mut k = match *kty {
                    "RSA" => json!({ "kty": "RSA", "n": rsa_n, "e": "AQAB" }),
                    _ => json!({
                        "kty": "EC", "crv": "P-256",
                        "x": "MKBCTNIcKUSDii11ySs3526iDZ8AiTo7Tu6KPAqv7D4",
                        "y": "4Etl6SRW2YiLUrN5vfvVHuhp7x8PxltmWWlbbM4IFyM",
                    }),
                };
                k["kid"] = json!(kid);
                if let Some(u) = usage {
                    k["use"] = json!(u);
                }
                if let Some(a) = alg {
                    k["alg"] = json!(a);
                }
                k
            })
            .collect();
        serde_json::from_value(json!({ "keys": jwks })).unwrap()
    }

    #[test]
    fn keys_are_picked_for_signing_by_id_and_kind() {
        let rs = Algorithm::RS256;
        // A key meant for encryption under the same id hides nothing.
        let set = keys(&[
            ("k1", Some("enc"), None, "RSA"),
            ("k1", Some("sig"), None, "RSA"),
        ]);
        assert_eq!(candidates(&set, Some("k1"), rs).unwrap().len(), 1);
        let only_enc = keys(&[("k1", Some("enc"), None, "RSA")]);
        assert!(candidates(&only_enc, Some("k1"), rs).unwrap().is_empty());
        // A named key stated for another algorithm, or of another kind.
        let es = keys(&[("k1", None, Some("ES256"), "RSA"), ("k2", None, None, "EC")]);
        let err = |kid| candidates(&es, Some(kid), rs).err().unwrap().to_string();
        assert!(err("k1").contains("meant for ES256"), "{}", err("k1"));
        assert!(err("k2").contains("another kind"), "{}", err("k2"));
        assert!(
            candidates(&es, Some("k3"), rs).unwrap().is_empty(),
            "an unknown id: none"
        );
        // No id: every signing key of the kind is tried.
        let two = keys(&[
            ("a", None, None, "RSA"),
            ("b", Some("sig"), None, "RSA"),
            ("c", None, None, "EC"),
        ]);
        assert_eq!(candidates(&two, None, rs).unwrap().len(), 2);
        assert_eq!(candidates(&two, None, Algorithm::ES256).unwrap().len(), 1);
    }

    #[test]
    fn discovery_documents_must_name_the_issuer_and_use_https() {
        let doc = |issuer: &str, token: &str| -> Metadata {
            serde_json::from_value(json!({
                "issuer": issuer, "authorization_endpoint": "https://id.example.com/auth",
                "token_endpoint": token, "jwks_uri": "https://id.example.com/jwks",
            }))
            .unwrap()
        };
        let at = "https://id.example.com";
        check_metadata(&doc(at, "https://id.example.com/token"), at).unwrap();
        let e = check_metadata(
            &doc("https://evil.example.com", "https://id.example.com/token"),
            at,
        );
        assert!(
            e.unwrap_err()
                .to_string()
                .contains("not `https://id.example.com`")
        );
        let e = check_metadata(&doc(at, "http://id.example.com/token"), at);
        assert!(e.unwrap_err().to_string().contains("token_endpoint"));
        let local = "http://127.0.0.1:9000";
        check_metadata(&doc(local, "http://127.0.0.1:9000/token"), local).unwrap();
    }

    #[test]
    fn pkce_challenges_follow_rfc_7636() {
        // RFC 7636 appendix B.
        assert_eq!(
            challenge("dBjftJeZ4CVP-mB92K27uhbUJU1p1r_wW1gFWFOEjXk"),
            "E9Melhoa2OwvFrEMTJguCHaoeK1t8URWbuGJSstw-cM"
        );
        let f = Fresh::new().unwrap();
        assert_eq!(f.verifier.len(), 43);
        assert_ne!(f.state, f.nonce);
    }
}
