//! `[providers.NAME]`: one third-party API — where it is, how to
//! authenticate, its limits, retry and breaker policies, and the ordered
//! rules that turn its replies into outcomes.

use std::fmt;
use std::time::Duration;

use serde::Deserialize;
use serde_json::Value;

use std::path::PathBuf;

use super::secret::{SecretRef, SecretsDir};
use super::{ConfigError, HumanDuration, Secret, parse_duration};
use crate::domain::Outcome;
use crate::domain::backoff::Backoff;
use crate::domain::breaker::BreakerPolicy;
use crate::domain::request::error_chain;
use crate::domain::rules::{FieldTest, ReplyError, Rule, StatusMatch, When, default_rules};

/// Where a provider's concurrency cap holds.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum ConcurrencyScope {
    #[default]
    Cluster,
    Node,
}

/// A `Content-Encoding` Ballast can decode.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum ContentEncoding {
    Gzip,
}

impl ContentEncoding {
    /// The name sent in `Accept-Encoding`.
    pub fn as_str(self) -> &'static str {
        match self {
            ContentEncoding::Gzip => "gzip",
        }
    }
}

/// The most redirects a poll may be allowed to follow.
pub const MAX_REDIRECTS: u8 = 10;

/// One provider as configured.
#[derive(Debug, Clone, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct ProviderConfig {
    /// Scheme, host and optional path prefix, e.g. `https://api.example.com/v2`.
    pub base_url: String,
    /// A header carrying a credential from a variable or a file.
    #[serde(default)]
    pub auth: Option<AuthConfig>,
    /// Sensitive fields of its replies (JSON pointers, `*` for any key or
    /// index): masked in the reply excerpts kept, and in the step outputs
    /// taken from them (`config::sensitive`).
    #[serde(default)]
    pub sensitive: Vec<super::sensitive::SensitiveField>,
    /// OAuth2 client credentials instead of a static header: a token
    /// fetched, cached and shared by this node's calls, renewed before it
    /// expires and once on a `401`.
    #[serde(default)]
    pub oauth2: Option<OAuth2Config>,
    /// TLS beyond the built-in roots: a private CA, a client certificate
    /// (mutual TLS).
    #[serde(default)]
    pub tls: Option<TlsConfig>,
    /// Each request signed with an HMAC over its timestamp, method, path
    /// and body, in a header.
    #[serde(default)]
    pub signing: Option<SigningConfig>,
    /// Per-attempt timeout for the whole exchange.
    #[serde(default = "defaults::timeout")]
    pub timeout: HumanDuration,
    /// The longest `timeout` a step of the loaded pipelines gives its
    /// calls to this provider, when longer than its own (set on loading,
    /// not configured): how long a call may be under way.
    #[serde(skip)]
    pub longest_step_timeout: Option<HumanDuration>,
    #[serde(default = "defaults::connect_timeout")]
    pub connect_timeout: HumanDuration,
    /// Largest reply body read, in bytes; larger is `body_too_large`.
    #[serde(default = "defaults::max_body")]
    pub max_body: u64,
    /// Redirects a job's poll (a `GET`) may follow, each to a URL under
    /// `base_url` (same scheme, host, port and path prefix, no user or
    /// password), each hop kept in the attempt's excerpt. 0
    /// (the default) follows none, and nothing else ever follows one: a 3xx
    /// is a reply like any other, recorded with its status and `Location`
    /// and classified by the rules (`unknown` unless a rule says
    /// otherwise).
    #[serde(default)]
    pub follow_redirects: u8,
    /// `Content-Encoding`s decoded (`["gzip"]`): asked for with
    /// `Accept-Encoding`, and `max_body` then bounds the decoded body, so a
    /// small reply that inflates past it is `body_too_large`. A body in an
    /// encoding not listed is kept as sent (and is then rarely JSON).
    #[serde(default)]
    pub decode: Vec<ContentEncoding>,
    /// Calls in flight at once: in the whole cluster, or on each node
    /// (`concurrency_scope`).
    #[serde(default = "defaults::concurrency")]
    pub concurrency: u32,
    /// `"cluster"` (the default): the cap holds for every node together;
    /// `"node"`: each node has the cap (a provider limiting connections per
    /// client).
    #[serde(default)]
    pub concurrency_scope: ConcurrencyScope,
    /// Every window holds at once, e.g. `["20/s", "10000/day"]`.
    #[serde(default)]
    pub rate_limits: Vec<RateLimit>,
    #[serde(default)]
    pub retry: RetryConfig,
    #[serde(default)]
    pub breaker: BreakerConfig,
    /// What a record does while the breaker is open: `"defer"` (the
    /// default: it stays scheduled, due when a probe may go) or
    /// `"park_until_healthy"` (it parks, and resumes by itself once the
    /// provider takes calls again; the records page lists who waits).
    #[serde(default)]
    pub on_outage: crate::domain::park::OutagePolicy,
    /// The provider does not honour idempotency keys (or a second charge
    /// must never happen): each side-effecting call is written down before
    /// it leaves, and a call whose outcome is not known (a timeout or a
    /// reset after it was sent, a reply nobody understood, a node that
    /// stopped mid-call) is never sent again blindly: the record parks
    /// `outcome_uncertain` for a person. Providers that honour keys need
    /// not set it (a resend there is harmless).
    #[serde(default)]
    pub at_most_once: bool,
    /// Environment variables holding webhook signing secrets (several, for
    /// rotation).
    #[serde(default)]
    pub webhook_secrets_env: Vec<String>,
    /// Files holding webhook signing secrets (beside those of
    /// `webhook_secrets_env`); a relative path is read in
    /// `$CREDENTIALS_DIRECTORY`, else beside the configuration file.
    #[serde(default)]
    pub webhook_secrets_file: Vec<PathBuf>,
    /// Where its relative secret files are read (set at load).
    #[serde(skip)]
    pub secrets_dir: super::secret::SecretsDir,
    /// Secrets set by the program itself (the demo's simulator), never from
    /// the configuration: operators name variables or files instead.
    #[serde(skip)]
    pub webhook_secrets_inline: Vec<crate::config::Secret>,
    /// The header carrying a webhook's signature (`t=<unix>,v1=<hex>`).
    #[serde(default = "defaults::signature_header")]
    pub webhook_signature_header: String,
    /// How far a signature's timestamp may be from now.
    #[serde(default = "defaults::webhook_tolerance")]
    pub webhook_tolerance: HumanDuration,
    /// The header naming a delivery; a delivery id is applied once.
    #[serde(default = "defaults::delivery_header")]
    pub webhook_delivery_header: String,
    /// Append the built-in rules (transport failures, 408, 429 and 5xx are
    /// retried) after this provider's own.
    #[serde(default = "defaults::yes")]
    pub default_rules: bool,
    /// Ordered reply rules; first match wins; unmatched is `unknown`.
    #[serde(default)]
    pub rules: Vec<RuleConfig>,
}

/// `auth = { header = "Authorization", value_env = "TOKEN", scheme = "Bearer" }`
#[derive(Debug, Clone, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct AuthConfig {
    pub header: String,
    /// The environment variable holding the credential (never the
    /// credential), or (`value_file`) the file holding it: one of the two.
    #[serde(default)]
    pub value_env: Option<String>,
    #[serde(default)]
    pub value_file: Option<PathBuf>,
    /// Written before the credential, e.g. `Bearer`.
    #[serde(default)]
    pub scheme: Option<String>,
}

/// `oauth2 = { token_url = "https://auth.example.com/oauth/token",
/// client_id_env = "ACME_CLIENT_ID", client_secret_env = "ACME_CLIENT_SECRET",
/// scopes = ["jobs"] }`: the client-credentials grant (RFC 6749 §4.4).
#[derive(Debug, Clone, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct OAuth2Config {
    /// The token endpoint (an absolute http(s) URL; it need not be under
    /// `base_url`).
    pub token_url: String,
    /// Environment variables holding the client's id and secret (never the
    /// values), or the files holding them (`*_file`): one of each pair.
    #[serde(default)]
    pub client_id_env: Option<String>,
    #[serde(default)]
    pub client_id_file: Option<PathBuf>,
    #[serde(default)]
    pub client_secret_env: Option<String>,
    #[serde(default)]
    pub client_secret_file: Option<PathBuf>,
    /// Scopes asked for, sent space-separated; none by default.
    #[serde(default)]
    pub scopes: Vec<String>,
    /// How the client authenticates to the token endpoint: `"basic"` (HTTP
    /// Basic, the RFC's default) or `"body"` (`client_id` and
    /// `client_secret` in the form).
    #[serde(default)]
    pub client_auth: ClientAuth,
    /// How long before its expiry a token is renewed (at most half its
    /// lifetime).
    #[serde(default = "defaults::renew_before")]
    pub renew_before: HumanDuration,
    /// The header the token is sent in, as `Bearer <token>`.
    #[serde(default = "defaults::token_header")]
    pub header: String,
    /// The client's id and secret set by the program itself (the demo's
    /// simulator), never from a file: operators name variables instead.
    #[serde(skip)]
    pub inline: Option<(crate::config::Secret, crate::config::Secret)>,
}

impl OAuth2Config {
    /// Whether the token endpoint is an HTTP(S) URL and the token's header
    /// is named.
    fn check(&self) -> Result<(), FieldError> {
        if !(self.token_url.starts_with("http://") || self.token_url.starts_with("https://")) {
            return Err((
                "oauth2.token_url",
                format!("`{}` must start with http:// or https://", self.token_url),
            ));
        }
        if self.header.trim().is_empty() {
            return Err(("oauth2.header", "must not be empty".into()));
        }
        Ok(())
    }

    /// The client's id and secret: set by the program, or read from their
    /// variables or files.
    fn read_client(
        &self,
        env: &dyn Fn(&str) -> Option<String>,
        dir: &SecretsDir,
    ) -> Result<(Secret, Secret), FieldError> {
        if let Some(both) = &self.inline {
            return Ok(both.clone());
        }
        let id = read_one(
            (self.client_id_env.as_ref(), self.client_id_file.as_ref()),
            ("oauth2.client_id_env", "oauth2.client_id_file"),
            (env, dir),
            1,
        )?;
        let secret = read_one(
            (
                self.client_secret_env.as_ref(),
                self.client_secret_file.as_ref(),
            ),
            ("oauth2.client_secret_env", "oauth2.client_secret_file"),
            (env, dir),
            1,
        )?;
        Ok((id, secret))
    }
}

/// `tls = { ca_file = "bank-ca.pem", cert_file = "ballast.pem", key_file =
/// "ballast.key" }`: files read as the secrets are (a relative path in
/// `$CREDENTIALS_DIRECTORY`, else beside the configuration file; again at
/// each reload).
#[derive(Debug, Clone, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct TlsConfig {
    /// PEM certificates trusted instead of the built-in roots (the
    /// provider's private CA, as `curl --cacert` does).
    #[serde(default)]
    pub ca_file: Option<PathBuf>,
    /// The client certificate (PEM, its chain after it) and its private
    /// key (PEM, PKCS#8, SEC1 or RSA) for mutual TLS: both or neither.
    #[serde(default)]
    pub cert_file: Option<PathBuf>,
    #[serde(default)]
    pub key_file: Option<PathBuf>,
}

impl TlsConfig {
    /// The CA bundle and the client's certificate with its key, read and
    /// split: each must hold PEM of its kind ([`Self::check_built`] builds
    /// them, when the configuration is checked).
    fn read(&self, dir: &SecretsDir) -> Result<(Option<String>, Option<Secret>), FieldError> {
        let max = super::secret::MAX_CERTIFICATE_FILE;
        let ca = match &self.ca_file {
            Some(path) => {
                let path = dir.file(path);
                let pem = super::secret::read_text(&path, max).map_err(|m| ("tls.ca_file", m))?;
                match reqwest::Certificate::from_pem_bundle(pem.as_bytes()) {
                    Ok(certs) if !certs.is_empty() => Some(pem),
                    _ => {
                        let m = format!("file {} holds no PEM certificate", path.display());
                        return Err(("tls.ca_file", m));
                    }
                }
            }
            None => None,
        };
        let identity = match (&self.cert_file, &self.key_file) {
            (Some(cert), Some(key)) => {
                let (cert, key) = (dir.file(cert), dir.file(key));
                let c = super::secret::read_text(&cert, max).map_err(|m| ("tls.cert_file", m))?;
                let k = super::secret::read_text(&key, MAX_KEY).map_err(|m| ("tls.key_file", m))?;
                let both = format!("{c}\n{k}\n");
                if let Err(e) = reqwest::Identity::from_pem(both.as_bytes()) {
                    let pair = format!("{} and {}", cert.display(), key.display());
                    let m = format!("{pair} are not a PEM certificate and its private key: {e}");
                    return Err(("tls.key_file", m));
                }
                Some(Secret::new(both))
            }
            (None, None) if ca.is_none() => {
                let m = "set `ca_file`, or `cert_file` and `key_file`, or all three".to_owned();
                return Err(("tls", m));
            }
            (None, None) => None,
            _ => {
                let m = "set `cert_file` and `key_file` together".to_owned();
                return Err(("tls", m));
            }
        };
        Ok((ca, identity))
    }

    /// The files as read (`secrets`) built as the engine builds its client:
    /// the CA's certificates parsed (a PEM block of junk passes the split),
    /// the certificate matched with its key. Done when the configuration is
    /// checked (at start, by `check-config`, at each reload), not at every
    /// read.
    fn check_built(&self, dir: &SecretsDir, secrets: &ProviderSecrets) -> Result<(), FieldError> {
        let roots = secrets.tls_roots.as_deref();
        if let (Some(path), Some(_)) = (&self.ca_file, roots) {
            if let Err(e) = tls_builder(roots, None).and_then(|b| b.build()) {
                let m = format!("file {}: {}", dir.file(path).display(), error_chain(&e));
                return Err(("tls.ca_file", m));
            }
        }
        let identity = secrets.tls_identity.as_ref().map(Secret::expose);
        if let (Some(cert), Some(key), Some(_)) = (&self.cert_file, &self.key_file, identity) {
            if let Err(e) = tls_builder(roots, identity).and_then(|b| b.build()) {
                let (cert, key) = (dir.file(cert), dir.file(key));
                let m = format!(
                    "{} and {} are not a certificate and its private key: {}",
                    cert.display(),
                    key.display(),
                    error_chain(&e)
                );
                return Err(("tls.cert_file", m));
            }
        }
        Ok(())
    }
}

/// `signing = { scheme = "hmac-sha256", secret_env = "ACME_SIGNING_KEY",
/// header = "X-Signature" }`: each request carries `t=<unix
/// seconds>,v1=<hex>` in `header`, the HMAC of its timestamp, method, path
/// with query and body, one per line (`auth::signing`). Or `scheme =
/// "aws-sigv4"` with `region`, `service` and the access key id (and a
/// session token for temporary credentials): AWS Signature Version 4, the
/// secret access key as the secret.
#[derive(Debug, Clone, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct SigningConfig {
    /// `"hmac-sha256"` (the default), `"hmac-sha512"` or `"aws-sigv4"`.
    #[serde(default)]
    pub scheme: crate::auth::signing::Scheme,
    /// The signing key's variable or file: one of the two (with AWS, the
    /// secret access key).
    #[serde(default)]
    pub secret_env: Option<String>,
    #[serde(default)]
    pub secret_file: Option<PathBuf>,
    /// The header the signature goes in (HMAC; `X-Signature` unless set).
    #[serde(default)]
    pub header: Option<String>,
    /// AWS: the region and the service signed for (`eu-west-1`, `s3`).
    #[serde(default)]
    pub region: Option<String>,
    #[serde(default)]
    pub service: Option<String>,
    /// AWS: the access key id's variable or file.
    #[serde(default)]
    pub access_key_id_env: Option<String>,
    #[serde(default)]
    pub access_key_id_file: Option<PathBuf>,
    /// AWS: a temporary credential's session token, variable or file.
    #[serde(default)]
    pub session_token_env: Option<String>,
    #[serde(default)]
    pub session_token_file: Option<PathBuf>,
}

impl SigningConfig {
    /// The header an HMAC signature goes in.
    pub fn header(&self) -> &str {
        self.header.as_deref().unwrap_or("x-signature")
    }

    /// Whether the scheme is AWS Signature Version 4.
    pub fn aws(&self) -> bool {
        self.scheme == crate::auth::signing::Scheme::AwsSigV4
    }

    /// The settings `scheme` does not take (the first set, for the
    /// message).
    fn misplaced(&self) -> Option<&'static str> {
        let aws = [
            ("region", self.region.is_some()),
            ("service", self.service.is_some()),
            ("access_key_id_env", self.access_key_id_env.is_some()),
            ("access_key_id_file", self.access_key_id_file.is_some()),
            ("session_token_env", self.session_token_env.is_some()),
            ("session_token_file", self.session_token_file.is_some()),
        ];
        match self.aws() {
            true => self.header.is_some().then_some("header"),
            false => aws.into_iter().find(|(_, set)| *set).map(|(name, _)| name),
        }
    }

    /// The secrets it signs with: the key and, for AWS, the access key id
    /// and session token (the `signing.` fields named when one cannot be
    /// read); after checking that the settings fit the scheme.
    fn read(
        &self,
        (env, dir): (EnvLookup<'_>, &SecretsDir),
    ) -> Result<(Secret, Option<AwsIdentity>), FieldError> {
        if let Some(name) = self.misplaced() {
            let m = format!("`{name}` does not apply to scheme {:?}", self.scheme);
            return Err(("signing", m));
        }
        let secret = read_one(
            (self.secret_env.as_ref(), self.secret_file.as_ref()),
            ("signing.secret_env", "signing.secret_file"),
            (env, dir),
            1,
        )?;
        if !self.aws() {
            header_name(self.header()).map_err(|m| ("signing.header", m))?;
            return Ok((secret, None));
        }
        for (field, value) in [
            ("signing.region", &self.region),
            ("signing.service", &self.service),
        ] {
            let ok = value.as_deref().is_some_and(|v| {
                !v.is_empty() && v.bytes().all(|b| b.is_ascii_alphanumeric() || b == b'-')
            });
            if !ok {
                let m = "is required: letters, digits and `-` (`eu-west-1`, `s3`)".to_owned();
                return Err((field, m));
            }
        }
        let access_key_id = read_one(
            (
                self.access_key_id_env.as_ref(),
                self.access_key_id_file.as_ref(),
            ),
            ("signing.access_key_id_env", "signing.access_key_id_file"),
            (env, dir),
            1,
        )?;
        let session_token = match (&self.session_token_env, &self.session_token_file) {
            (None, None) => None,
            (var, file) => Some(read_one(
                (var.as_ref(), file.as_ref()),
                ("signing.session_token_env", "signing.session_token_file"),
                (env, dir),
                1,
            )?),
        };
        Ok((
            secret,
            Some(AwsIdentity {
                access_key_id,
                session_token,
            }),
        ))
    }
}

/// An AWS access key id and, for temporary credentials, the session token
/// (the secret access key is the signing secret).
#[derive(Clone, PartialEq, Eq)]
pub struct AwsIdentity {
    pub access_key_id: Secret,
    pub session_token: Option<Secret>,
}

/// Whether `name` can name an HTTP header.
fn header_name(name: &str) -> Result<(), String> {
    reqwest::header::HeaderName::from_bytes(name.as_bytes())
        .map(|_| ())
        .map_err(|_| format!("`{name}` is not a header name"))
}

/// A client builder trusting `roots` (PEM) instead of the built-in roots
/// (those when `None`) and presenting `identity` (a PEM certificate and
/// its key): the engine's clients are built on it, and the checks build
/// the same.
pub fn tls_builder(
    roots: Option<&str>,
    identity: Option<&str>,
) -> Result<reqwest::ClientBuilder, reqwest::Error> {
    let mut builder = reqwest::Client::builder();
    if let Some(pem) = roots {
        builder = builder.tls_certs_only(reqwest::Certificate::from_pem_bundle(pem.as_bytes())?);
    }
    if let Some(pem) = identity {
        builder = builder.identity(reqwest::Identity::from_pem(pem.as_bytes())?);
    }
    Ok(builder)
}

/// The most a private key file may hold.
const MAX_KEY: u64 = super::secret::MAX_SECRET_FILE;

/// How a variable is looked up (the process environment, or a test's).
type EnvLookup<'a> = &'a dyn Fn(&str) -> Option<String>;

/// The secret one of a `*_env` and `*_file` pair names (`fields`, for the
/// message), at least `min` bytes: a variable of `env`, or a file (a
/// relative one in `dir`).
fn read_one(
    (var, file): (Option<&String>, Option<&PathBuf>),
    fields: (&'static str, &'static str),
    (env, dir): (EnvLookup<'_>, &SecretsDir),
    min: usize,
) -> Result<Secret, FieldError> {
    match SecretRef::one_of(var, file, fields).map_err(|m| (fields.0, m))? {
        SecretRef::Env(var) => SecretRef::Env(var)
            .read(env, min)
            .map_err(|m| (fields.0, m)),
        SecretRef::File(path) => SecretRef::File(dir.file(&path))
            .read(env, min)
            .map_err(|m| (fields.1, m)),
    }
}

/// A provider's secrets as read (at start and at each reload): its
/// credential, its OAuth2 client, its webhook secrets. `Debug` says only
/// which are there.
#[derive(Clone, Default)]
pub struct ProviderSecrets {
    /// `auth`'s value (its scheme not included).
    pub auth: Option<Secret>,
    /// The OAuth2 client's id and secret.
    pub client: Option<(Secret, Secret)>,
    /// The webhook signing secrets, any of which verifies.
    pub webhooks: Vec<Secret>,
    /// The CA bundle trusted instead of the built-in roots (PEM).
    pub tls_roots: Option<String>,
    /// The client certificate and its private key (PEM, one after the
    /// other), for mutual TLS.
    pub tls_identity: Option<Secret>,
    /// The key requests are signed with.
    pub signing: Option<Secret>,
    /// With AWS signing, the access key id and session token.
    pub aws: Option<AwsIdentity>,
}

impl fmt::Debug for ProviderSecrets {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("ProviderSecrets")
            .field("auth", &self.auth.is_some())
            .field("client", &self.client.is_some())
            .field("webhooks", &self.webhooks.len())
            .field("tls_roots", &self.tls_roots.is_some())
            .field("tls_identity", &self.tls_identity.is_some())
            .field("signing", &self.signing.is_some())
            .field("aws", &self.aws.is_some())
            .finish()
    }
}

impl ProviderSecrets {
    /// The raw credential, for scrubbing it from anything stored:
    /// providers sometimes echo the key they were sent in an error body.
    /// With OAuth2, the client secret (a token is added by the engine,
    /// which holds it).
    pub fn credential(&self) -> Option<&Secret> {
        match &self.client {
            Some((_, secret)) => Some(secret),
            None => self.auth.as_ref(),
        }
    }

    /// Whether `other` holds the same secrets (a reload applies a changed
    /// one).
    pub fn same(&self, other: &ProviderSecrets) -> bool {
        self.values() == other.values()
    }

    /// Whether `other` holds the same OAuth2 client (its token stays good).
    pub fn same_client(&self, other: &ProviderSecrets) -> bool {
        fn client(s: &ProviderSecrets) -> Option<[&str; 2]> {
            s.client
                .as_ref()
                .map(|(id, key)| [id.expose(), key.expose()])
        }
        client(self) == client(other)
    }

    /// Every value, in one order (the webhook secrets last: a list of
    /// another length is another list).
    fn values(&self) -> Vec<Option<&str>> {
        let client = self.client.as_ref();
        let mut all = vec![
            self.auth.as_ref().map(Secret::expose),
            client.map(|c| c.0.expose()),
            client.map(|c| c.1.expose()),
            self.tls_roots.as_deref(),
            self.tls_identity.as_ref().map(Secret::expose),
            self.signing.as_ref().map(Secret::expose),
            self.aws.as_ref().map(|a| a.access_key_id.expose()),
            self.aws
                .as_ref()
                .and_then(|a| a.session_token.as_ref().map(Secret::expose)),
        ];
        all.extend(self.webhooks.iter().map(|w| Some(w.expose())));
        all
    }
}

/// How a client proves itself to a token endpoint.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum ClientAuth {
    #[default]
    Basic,
    Body,
}

/// A provider's field (its path below `providers.NAME`) and what is wrong
/// with it.
type FieldError = (&'static str, String);

/// `retry = { max_attempts = 8, base = "500ms", cap = "2m", deadline = "30m", budget = 0.2 }`
#[derive(Debug, Clone, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct RetryConfig {
    /// Attempts per step (the first one included) before parking.
    pub max_attempts: u32,
    pub base: HumanDuration,
    pub cap: HumanDuration,
    /// Overall time for one step, from its first attempt; then parked.
    pub deadline: HumanDuration,
    /// Retries may be at most this fraction of calls to the provider.
    pub budget: f64,
    /// Retries per second allowed regardless of the fraction.
    pub budget_floor: f64,
    /// Attempts for replies no rule matched before parking with the evidence.
    pub unknown_attempts: u32,
}

impl Default for RetryConfig {
    fn default() -> Self {
        RetryConfig {
            max_attempts: 5,
            base: HumanDuration(Duration::from_millis(500)),
            cap: HumanDuration(Duration::from_secs(120)),
            deadline: HumanDuration(Duration::from_secs(1800)),
            budget: 0.2,
            budget_floor: 1.0,
            unknown_attempts: 3,
        }
    }
}

impl RetryConfig {
    pub fn backoff(&self) -> Backoff {
        Backoff {
            base: self.base.0,
            cap: self.cap.0,
        }
    }

    /// The settings a step's decisions read (`domain::step`).
    pub fn policy(&self) -> crate::domain::step::RetryPolicy {
        crate::domain::step::RetryPolicy {
            max_attempts: self.max_attempts,
            unknown_attempts: self.unknown_attempts,
            backoff: self.backoff(),
            deadline: self.deadline.0,
        }
    }

    /// Whether the retries are bounded sensibly: at least one attempt, a
    /// backoff that grows from more than 0, a budget that is a fraction.
    pub(crate) fn check(&self) -> Result<(), FieldError> {
        if self.max_attempts == 0 {
            return Err(("retry.max_attempts", "must be at least 1".into()));
        }
        if self.base.0.is_zero() || self.cap.0 < self.base.0 {
            return Err((
                "retry.cap",
                format!(
                    "must be at least `retry.base` ({}), and base more than 0",
                    self.base
                ),
            ));
        }
        if !(0.0..=1.0).contains(&self.budget) {
            return Err((
                "retry.budget",
                format!("{} is not a fraction between 0 and 1", self.budget),
            ));
        }
        if !(self.budget_floor >= 0.0 && self.budget_floor.is_finite()) {
            return Err(("retry.budget_floor", "must be 0 or more".into()));
        }
        Ok(())
    }
}

/// `breaker = { window = 50, min_calls = 20, failure_rate = 0.5, slow_call = "5s", open_for = "30s", probes = 3 }`
#[derive(Debug, Clone, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct BreakerConfig {
    pub window: u32,
    pub min_calls: u32,
    pub failure_rate: f64,
    pub slow_call: HumanDuration,
    pub slow_rate: f64,
    pub open_for: HumanDuration,
    pub probes: u32,
}

impl Default for BreakerConfig {
    fn default() -> Self {
        let p = BreakerPolicy::default();
        BreakerConfig {
            window: p.window,
            min_calls: p.min_calls,
            failure_rate: p.failure_rate,
            slow_call: HumanDuration(p.slow_call),
            slow_rate: p.slow_rate,
            open_for: HumanDuration(p.open_for),
            probes: p.probes,
        }
    }
}

impl BreakerConfig {
    pub fn policy(&self) -> BreakerPolicy {
        BreakerPolicy {
            window: self.window,
            min_calls: self.min_calls,
            failure_rate: self.failure_rate,
            slow_call: self.slow_call.0,
            slow_rate: self.slow_rate,
            open_for: self.open_for.0,
            probes: self.probes,
        }
    }

    /// Whether the breaker can judge: its rates fractions in (0, 1], its
    /// minimum of calls within its window, and at least one probe.
    fn check(&self) -> Result<(), FieldError> {
        for (field, rate) in [
            ("breaker.failure_rate", self.failure_rate),
            ("breaker.slow_rate", self.slow_rate),
        ] {
            if !(rate > 0.0 && rate <= 1.0) {
                return Err((field, format!("{rate} is not a fraction in (0, 1]")));
            }
        }
        if self.window == 0 || self.min_calls == 0 || self.min_calls > self.window {
            return Err((
                "breaker.min_calls",
                "must be between 1 and `breaker.window`".into(),
            ));
        }
        if self.probes == 0 {
            return Err(("breaker.probes", "must be at least 1".into()));
        }
        Ok(())
    }
}

/// `"20/s"`, `"600/min"`, `"10000/day"`, `"5/10s"`: at most `count` calls in
/// any `per`.
#[derive(Clone, Copy, PartialEq, Eq)]
pub struct RateLimit {
    pub count: u32,
    pub per: Duration,
}

impl fmt::Debug for RateLimit {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{}/{}", self.count, HumanDuration(self.per))
    }
}

impl std::str::FromStr for RateLimit {
    type Err = String;

    fn from_str(s: &str) -> Result<Self, Self::Err> {
        let bad =
            || format!("invalid rate limit `{s}`: expected e.g. `20/s`, `600/min`, `10000/day`");
        let (count, per) = s.split_once('/').ok_or_else(bad)?;
        let count: u32 = count.trim().parse().map_err(|_| bad())?;
        let per = match per.trim() {
            "s" | "sec" | "second" => Duration::from_secs(1),
            "m" | "min" | "minute" => Duration::from_secs(60),
            "h" | "hour" => Duration::from_secs(3600),
            "d" | "day" => Duration::from_secs(86_400),
            other => parse_duration(other).map_err(|_| bad())?,
        };
        if count == 0 || per.is_zero() {
            return Err(bad());
        }
        Ok(RateLimit { count, per })
    }
}

impl<'de> Deserialize<'de> for RateLimit {
    fn deserialize<D: serde::Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        String::deserialize(d)?
            .parse()
            .map_err(serde::de::Error::custom)
    }
}

/// One or several values: `status = "5xx"` or `status = ["429", "503"]`.
#[derive(Debug, Clone, Deserialize)]
#[serde(untagged)]
pub enum OneOrMany<T> {
    One(T),
    Many(Vec<T>),
}

impl<T: Clone> OneOrMany<T> {
    pub fn to_vec(&self) -> Vec<T> {
        match self {
            OneOrMany::One(t) => vec![t.clone()],
            OneOrMany::Many(v) => v.clone(),
        }
    }
}

/// `[[providers.NAME.rules]]`
#[derive(Debug, Clone, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct RuleConfig {
    #[serde(default)]
    pub when: WhenConfig,
    pub outcome: Outcome,
}

/// The conditions of a rule; all given must hold.
#[derive(Debug, Clone, Default, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct WhenConfig {
    pub status: Option<OneOrMany<StatusMatch>>,
    /// `timeout`, `connect`, `reset`, `tls`, `body_too_large`, `body_not_json`
    /// (which also matches the two below, none of them being JSON),
    /// `body_empty`, `body_not_utf8`.
    pub error: Option<OneOrMany<String>>,
    /// A JSON pointer into the reply body, tested by one of the next three.
    pub field: Option<String>,
    pub equals: Option<Value>,
    #[serde(rename = "in")]
    pub one_of: Option<Vec<Value>>,
    pub exists: Option<bool>,
    /// Whether the reply names a pause (a `Retry-After` header that
    /// parses): `when = { status = 503, retry_after = true }`.
    pub retry_after: Option<bool>,
}

mod defaults {
    use super::HumanDuration;
    use std::time::Duration;

    pub fn timeout() -> HumanDuration {
        HumanDuration(Duration::from_secs(10))
    }
    pub fn connect_timeout() -> HumanDuration {
        HumanDuration(Duration::from_secs(3))
    }
    pub fn max_body() -> u64 {
        1024 * 1024
    }
    pub fn concurrency() -> u32 {
        16
    }
    pub fn yes() -> bool {
        true
    }
    pub fn renew_before() -> HumanDuration {
        HumanDuration(Duration::from_secs(60))
    }

    pub fn token_header() -> String {
        "Authorization".into()
    }

    pub fn signature_header() -> String {
        "x-signature".into()
    }

    pub fn webhook_tolerance() -> HumanDuration {
        HumanDuration::secs(300)
    }

    pub fn delivery_header() -> String {
        "x-delivery-id".into()
    }
}

/// Checks a JSON pointer's syntax (RFC 6901): empty or starting with `/`.
pub fn check_pointer(pointer: &str) -> Result<(), String> {
    if pointer.is_empty() || pointer.starts_with('/') {
        Ok(())
    } else {
        Err(format!(
            "`{pointer}` is not a JSON pointer (it must start with `/`)"
        ))
    }
}

impl ProviderConfig {
    /// Validates and compiles the rules; errors name `providers.NAME.FIELD`.
    pub fn compile_rules(&self, name: &str) -> Result<Vec<Rule>, ConfigError> {
        let mut rules = Vec::with_capacity(self.rules.len() + 3);
        for (i, r) in self.rules.iter().enumerate() {
            let key = format!("providers.{name}.rules[{i}].when");
            let invalid = |message: String| ConfigError::Invalid {
                key: key.clone(),
                message,
            };
            let w = &r.when;
            let errors = match &w.error {
                None => Vec::new(),
                Some(e) => e
                    .to_vec()
                    .iter()
                    .map(|s| s.parse::<ReplyError>())
                    .collect::<Result<_, _>>()
                    .map_err(invalid)?,
            };
            let tests = [
                w.equals.clone().map(FieldTest::Equals),
                w.one_of.clone().map(FieldTest::In),
                w.exists.map(FieldTest::Exists),
            ];
            let mut tests = tests.into_iter().flatten();
            let field = match (&w.field, tests.next(), tests.next()) {
                (None, None, _) => None,
                (Some(_), None, _) => {
                    return Err(invalid(
                        "`field` needs one of `equals`, `in` or `exists`".into(),
                    ));
                }
                (None, Some(_), _) => {
                    return Err(invalid(
                        "`equals`, `in` and `exists` need a `field` (a JSON pointer)".into(),
                    ));
                }
                (Some(_), Some(_), Some(_)) => {
                    return Err(invalid(
                        "give only one of `equals`, `in` or `exists`".into(),
                    ));
                }
                (Some(f), Some(t), None) => {
                    check_pointer(f).map_err(invalid)?;
                    Some((f.clone(), t))
                }
            };
            let status = w.status.as_ref().map(OneOrMany::to_vec).unwrap_or_default();
            rules.push(Rule {
                when: When {
                    status,
                    error: errors,
                    field,
                    retry_after: w.retry_after,
                },
                outcome: r.outcome,
            });
        }
        if self.default_rules {
            rules.extend(default_rules());
        }
        Ok(rules)
    }

    /// Checks everything but the rules; errors name `providers.NAME.FIELD`.
    pub fn validate(
        &self,
        name: &str,
        env: &dyn Fn(&str) -> Option<String>,
    ) -> Result<(), ConfigError> {
        let checked = self
            .check_base_url()
            .and_then(|()| self.check_credentials(env))
            .and_then(|()| self.check_calls())
            .and_then(|()| self.retry.check())
            .and_then(|()| self.breaker.check());
        checked.map_err(|(field, message)| ConfigError::Invalid {
            key: format!("providers.{name}.{field}"),
            message,
        })?;
        self.compile_rules(name)?;
        Ok(())
    }

    /// Whether `base_url` is an HTTP(S) URL.
    fn check_base_url(&self) -> Result<(), FieldError> {
        if !(self.base_url.starts_with("http://") || self.base_url.starts_with("https://")) {
            return Err((
                "base_url",
                format!(
                    "`{}` must start with http:// or https://",
                    crate::domain::request::redact_url(&self.base_url)
                ),
            ));
        }
        Ok(())
    }

    /// Whether the credentials are whole: one way to authenticate, its
    /// header named and its secrets readable, and the webhook secrets long
    /// enough to verify with.
    fn check_credentials(&self, env: &dyn Fn(&str) -> Option<String>) -> Result<(), FieldError> {
        if let Some(auth) = &self.auth {
            if auth.header.trim().is_empty() {
                return Err(("auth.header", "must not be empty".into()));
            }
            header_name(&auth.header).map_err(|m| ("auth.header", m))?;
        }
        if let Some(o) = &self.oauth2 {
            if self.auth.is_some() {
                return Err((
                    "oauth2",
                    "a provider uses `auth` or `oauth2`, not both".into(),
                ));
            }
            o.check()?;
        }
        let secrets = self.read_secrets(env)?;
        match &self.tls {
            Some(t) => t.check_built(&self.secrets_dir, &secrets),
            None => Ok(()),
        }
    }

    /// Reads the provider's secrets from their variables and files (the
    /// engine does at start and at each reload); the first that cannot
    /// be read, named by its field.
    pub fn read_secrets(
        &self,
        env: &dyn Fn(&str) -> Option<String>,
    ) -> Result<ProviderSecrets, FieldError> {
        let dir = &self.secrets_dir;
        let auth = match &self.auth {
            Some(a) => Some(read_one(
                (a.value_env.as_ref(), a.value_file.as_ref()),
                ("auth.value_env", "auth.value_file"),
                (env, dir),
                1,
            )?),
            None => None,
        };
        let client = match &self.oauth2 {
            Some(o) => Some(o.read_client(env, dir)?),
            None => None,
        };
        let mut webhooks = Vec::new();
        for var in &self.webhook_secrets_env {
            let s = SecretRef::Env(var.clone()).read(env, MIN_VERIFYING_SECRET);
            webhooks.push(s.map_err(|m| ("webhook_secrets_env", m))?);
        }
        for path in &self.webhook_secrets_file {
            let s = SecretRef::File(dir.file(path)).read(env, MIN_VERIFYING_SECRET);
            webhooks.push(s.map_err(|m| ("webhook_secrets_file", m))?);
        }
        webhooks.extend(self.webhook_secrets_inline.iter().cloned());
        let (tls_roots, tls_identity) = match &self.tls {
            Some(_) if !self.base_url.starts_with("https://") => {
                let m = "applies to an https:// base_url only".to_owned();
                return Err(("tls", m));
            }
            Some(t) => t.read(dir)?,
            None => (None, None),
        };
        let (signing, aws) = match &self.signing {
            Some(s) => {
                if self.follow_redirects > 0 {
                    let m = "a signed provider's redirects cannot be followed (each hop would \
                             need its own signature): set `follow_redirects = 0`"
                        .to_owned();
                    return Err(("signing", m));
                }
                if s.aws() && (self.auth.is_some() || self.oauth2.is_some()) {
                    let m = "AWS signing is the provider's credential (its `Authorization` \
                             header): remove `auth` or `oauth2`"
                        .to_owned();
                    return Err(("signing", m));
                }
                let (secret, aws) = s.read((env, dir))?;
                (Some(secret), aws)
            }
            None => (None, None),
        };
        Ok(ProviderSecrets {
            auth,
            client,
            webhooks,
            tls_roots,
            tls_identity,
            signing,
            aws,
        })
    }

    /// Whether calls can be made at all: a timeout, a concurrency and rate
    /// limits that allow one, and redirects within bounds.
    fn check_calls(&self) -> Result<(), FieldError> {
        if self.timeout.0.is_zero() {
            return Err(("timeout", "must be more than 0".into()));
        }
        if self.concurrency == 0 {
            return Err(("concurrency", "must be at least 1".into()));
        }
        if self.follow_redirects > MAX_REDIRECTS {
            return Err(("follow_redirects", format!("at most {MAX_REDIRECTS}")));
        }
        // Each window is leased apart, by its length: two of one length
        // are one window (keep the smaller count).
        for (i, l) in self.rate_limits.iter().enumerate() {
            if l.count == 0 || l.per.is_zero() {
                return Err(("rate_limits", format!("`{l:?}` allows no call")));
            }
            if let Some(other) = self.rate_limits[..i].iter().find(|o| o.per == l.per) {
                return Err((
                    "rate_limits",
                    format!("`{other:?}` and `{l:?}` are the same window; keep one"),
                ));
            }
        }
        Ok(())
    }

    /// The headers whose values the history never keeps: the credential's
    /// (`auth`, else `oauth2`'s) and the request signature's (whatever
    /// their names; with AWS, `Authorization` and the session token).
    pub fn credential_headers(&self) -> Vec<&str> {
        let credential = match (&self.auth, &self.oauth2) {
            (Some(a), _) => Some(a.header.as_str()),
            (None, Some(o)) => Some(o.header.as_str()),
            (None, None) => None,
        };
        let signing = match &self.signing {
            Some(s) if s.aws() => vec!["authorization", "x-amz-security-token"],
            Some(s) => vec![s.header()],
            None => Vec::new(),
        };
        credential.into_iter().chain(signing).collect()
    }

    /// The credential header and its value (`secrets`, as read).
    pub fn auth_header(&self, secrets: &ProviderSecrets) -> Option<(String, Secret)> {
        let auth = self.auth.as_ref()?;
        let value = secrets.auth.as_ref()?.expose();
        let value = match &auth.scheme {
            Some(s) => format!("{s} {value}"),
            None => value.to_owned(),
        };
        Some((auth.header.clone(), Secret::new(value)))
    }
}

/// The fewest bytes of a secret Ballast verifies with (webhook secrets, the
/// metrics token): a shorter key is guessed or forged, and an empty one is a
/// key everyone knows.
pub const MIN_VERIFYING_SECRET: usize = crate::auth::webhook::MIN_SECRET;

/// Checks that `var` holds a secret of at least `min` bytes: not unset,
/// not empty or blank (an env file's `KEY=` sets it to nothing), not short.
/// The message names the variable, never its value.
pub fn secret_var(
    env: &dyn Fn(&str) -> Option<String>,
    var: &str,
    min: usize,
) -> Result<(), String> {
    SecretRef::Env(var.to_owned()).read(env, min).map(|_| ())
}

#[cfg(test)]
mod tests {
    use super::*;

    fn provider(extra: &str) -> Result<ProviderConfig, toml::de::Error> {
        toml::from_str(&format!("base_url = \"https://api.example.com\"\n{extra}"))
    }

    #[test]
    fn rate_limits_parse() {
        let ok = |s: &str| s.parse::<RateLimit>().ok();
        assert_eq!(
            ok("20/s"),
            Some(RateLimit {
                count: 20,
                per: Duration::from_secs(1)
            })
        );
        assert_eq!(
            ok("10000/day"),
            Some(RateLimit {
                count: 10_000,
                per: Duration::from_secs(86_400)
            })
        );
        assert_eq!(
            ok("5/10s"),
            Some(RateLimit {
                count: 5,
                per: Duration::from_secs(10)
            })
        );
        for bad in ["0/s", "20", "x/s", "20/fortnight", "20/0s"] {
            assert!(bad.parse::<RateLimit>().is_err(), "{bad}");
        }
    }

    #[test]
    fn windows_of_one_length_are_refused_and_the_cap_scope_parses() {
        let none = |_: &str| None;
        let p = provider("rate_limits = [\"10/s\", \"5/1s\"]").unwrap_or_else(|e| panic!("{e}"));
        let err = p
            .validate("acme", &none)
            .err()
            .map(|e| e.to_string())
            .unwrap_or_default();
        assert!(
            err.contains("providers.acme.rate_limits") && err.contains("same window"),
            "{err}"
        );
        let p = provider("rate_limits = [\"10/s\", \"500/min\"]").unwrap_or_else(|e| panic!("{e}"));
        assert!(p.validate("acme", &none).is_ok());
        assert_eq!(
            p.concurrency_scope,
            ConcurrencyScope::Cluster,
            "the default"
        );
        let p = provider("concurrency_scope = \"node\"").unwrap_or_else(|e| panic!("{e}"));
        assert_eq!(p.concurrency_scope, ConcurrencyScope::Node);
        assert!(provider("concurrency_scope = \"everywhere\"").is_err());
    }

    #[test]
    fn rules_compile_with_defaults_after() {
        let p = provider(
            r#"
[[rules]]
when = { status = "2xx", field = "/status", in = ["queued", "running"] }
outcome = "pending"
[[rules]]
when = { status = ["400", "404"] }
outcome = "fail"
"#,
        )
        .unwrap_or_else(|e| panic!("{e}"));
        let rules = p.compile_rules("r").unwrap_or_else(|e| panic!("{e}"));
        assert_eq!(rules.len(), 2 + default_rules().len());
        assert_eq!(
            rules[1].when.status,
            vec![StatusMatch::Code(400), StatusMatch::Code(404)]
        );
    }

    #[test]
    fn bad_rules_name_their_place() {
        let cases = [
            (
                "[[rules]]\nwhen = { field = \"/s\" }\noutcome = \"success\"",
                "needs one of",
            ),
            (
                "[[rules]]\nwhen = { equals = 1 }\noutcome = \"success\"",
                "need a `field`",
            ),
            (
                "[[rules]]\nwhen = { field = \"s\", equals = 1 }\noutcome = \"success\"",
                "JSON pointer",
            ),
            (
                "[[rules]]\nwhen = { error = \"dns\" }\noutcome = \"retry\"",
                "unknown error class `dns`",
            ),
        ];
        for (text, expected) in cases {
            let p = provider(text).unwrap_or_else(|e| panic!("{e}"));
            let err = p
                .compile_rules("acme")
                .err()
                .map(|e| e.to_string())
                .unwrap_or_default();
            assert!(
                err.starts_with("config `providers.acme.rules[0].when`"),
                "{err}"
            );
            assert!(err.contains(expected), "{err}");
        }
    }

    #[test]
    fn validation_names_fields_and_missing_secrets() {
        let env = |v: &str| (v == "TOKEN").then(|| "t0k3n".to_owned());
        let p = provider(
            "auth = { header = \"Authorization\", value_env = \"TOKEN\", scheme = \"Bearer\" }",
        )
        .unwrap_or_else(|e| panic!("{e}"));
        assert!(p.validate("acme", &env).is_ok());
        let secrets = p.read_secrets(&env).unwrap_or_else(|e| panic!("{e:?}"));
        let (h, v) = p
            .auth_header(&secrets)
            .unwrap_or_else(|| panic!("no header"));
        assert_eq!((h.as_str(), v.expose()), ("Authorization", "Bearer t0k3n"));
        assert!(!format!("{v:?}").contains("t0k3n"));
        let missing = provider("auth = { header = \"X-Key\", value_env = \"NOPE\" }")
            .unwrap_or_else(|e| panic!("{e}"));
        let err = missing
            .validate("acme", &env)
            .err()
            .map(|e| e.to_string())
            .unwrap_or_default();
        assert_eq!(
            err,
            "config `providers.acme.auth.value_env`: environment variable NOPE is not set"
        );
        let budget = provider("retry = { budget = 1.5 }").unwrap_or_else(|e| panic!("{e}"));
        assert!(
            budget
                .validate("acme", &env)
                .err()
                .map(|e| e.to_string())
                .unwrap_or_default()
                .contains("retry.budget")
        );
        assert!(
            provider("retry = { tries = 3 }").is_err(),
            "unknown keys are refused"
        );
    }

    #[test]
    fn empty_and_short_secrets_are_refused_naming_the_variable() {
        let env = |v: &str| match v {
            "EMPTY" => Some(String::new()),
            "BLANK" => Some("  ".to_owned()),
            "SHORT" => Some("fifteen-bytes!!".to_owned()),
            "GOOD" => Some("sixteen-bytes!!!".to_owned()),
            _ => None,
        };
        let err = |extra: &str| {
            provider(extra)
                .unwrap_or_else(|e| panic!("{e}"))
                .validate("kyc", &env)
                .err()
                .map(|e| e.to_string())
        };
        for (extra, field, said) in [
            (
                "webhook_secrets_env = [\"GOOD\", \"EMPTY\"]",
                "webhook_secrets_env",
                "EMPTY is set but empty",
            ),
            (
                "webhook_secrets_env = [\"BLANK\"]",
                "webhook_secrets_env",
                "BLANK is set but empty",
            ),
            (
                "webhook_secrets_env = [\"SHORT\"]",
                "webhook_secrets_env",
                "SHORT holds 15 bytes; this secret must be at least 16",
            ),
            (
                "auth = { header = \"X-Key\", value_env = \"EMPTY\" }",
                "auth.value_env",
                "EMPTY is set but empty",
            ),
            (
                "oauth2 = { token_url = \"https://a.example/t\", client_id_env = \"GOOD\", client_secret_env = \"EMPTY\" }",
                "oauth2.client_secret_env",
                "EMPTY is set but empty",
            ),
        ] {
            let e = err(extra).unwrap_or_else(|| panic!("{extra}: accepted"));
            assert_eq!(
                e,
                format!("config `providers.kyc.{field}`: environment variable {said}"),
                "{extra}"
            );
            assert!(!e.contains("fifteen"), "the value is never said: {e}");
        }
        assert_eq!(err("webhook_secrets_env = [\"GOOD\"]"), None);
        // A provider's API key may be short; only an empty one is refused.
        assert_eq!(
            err("auth = { header = \"X-Key\", value_env = \"SHORT\" }"),
            None
        );
    }

    /// Every `*_env` has a `*_file` twin, one of the two set; a secret
    /// read from a file is the file's text without its last newline.
    #[test]
    fn secrets_are_read_from_files() {
        let dir = tempfile::tempdir().unwrap_or_else(|e| panic!("{e}"));
        let put = |name: &str, text: &str| {
            let p = dir.path().join(name);
            std::fs::write(&p, text).unwrap_or_else(|e| panic!("{e}"));
            p.display().to_string()
        };
        let (key, id, secret) = (
            put("key", "k3y\n"),
            put("id", "client\n"),
            put("secret", "s3cret"),
        );
        let hook = put("hook", "sixteen-bytes!!!\n");
        let short = put("short", "fifteen-bytes!!\n");
        let none = |_: &str| None;
        let read = |extra: &str| {
            provider(extra)
                .unwrap_or_else(|e| panic!("{e}"))
                .read_secrets(&none)
        };
        let s = read(&format!(
            "auth = {{ header = \"X-Key\", value_file = \"{key}\" }}\nwebhook_secrets_file = [\"{hook}\"]"
        ))
        .unwrap_or_else(|e| panic!("{e:?}"));
        assert_eq!(s.auth.as_ref().map(Secret::expose), Some("k3y"));
        assert_eq!(s.credential().map(Secret::expose), Some("k3y"));
        assert_eq!(
            s.webhooks.iter().map(Secret::expose).collect::<Vec<_>>(),
            ["sixteen-bytes!!!"]
        );
        let o = read(&format!(
            "oauth2 = {{ token_url = \"https://a.example/t\", client_id_file = \"{id}\", client_secret_file = \"{secret}\" }}"
        ))
        .unwrap_or_else(|e| panic!("{e:?}"));
        let client = o.client.as_ref().map(|(i, s)| (i.expose(), s.expose()));
        assert_eq!(client, Some(("client", "s3cret")));
        assert_eq!(o.credential().map(Secret::expose), Some("s3cret"));
        assert!(!format!("{o:?}").contains("s3cret"), "{o:?}");
        for (extra, field, said) in [
            (
                format!(
                    "auth = {{ header = \"X-Key\", value_env = \"K\", value_file = \"{key}\" }}"
                ),
                "auth.value_env",
                "set `auth.value_env` or `auth.value_file`, not both".to_owned(),
            ),
            (
                "auth = { header = \"X-Key\" }".to_owned(),
                "auth.value_env",
                "set `auth.value_env` or `auth.value_file`".to_owned(),
            ),
            (
                format!("webhook_secrets_file = [\"{short}\"]"),
                "webhook_secrets_file",
                format!("file {short} holds 15 bytes; this secret must be at least 16"),
            ),
            (
                "auth = { header = \"X-Key\", value_file = \"/nonexistent/k\" }".to_owned(),
                "auth.value_file",
                "cannot read file /nonexistent/k: No such file or directory (os error 2)"
                    .to_owned(),
            ),
            (
                format!(
                    "oauth2 = {{ token_url = \"https://a.example/t\", client_id_file = \"{id}\" }}"
                ),
                "oauth2.client_secret_env",
                "set `oauth2.client_secret_env` or `oauth2.client_secret_file`".to_owned(),
            ),
        ] {
            let e = read(&extra).err();
            assert_eq!(e, Some((field, said)), "{extra}");
        }
        // Two reads of the same files are the same secrets; a file
        // changed is not.
        let same = format!("auth = {{ header = \"X-Key\", value_file = \"{key}\" }}");
        let before = read(&same).unwrap_or_else(|e| panic!("{e:?}"));
        assert!(before.same(&read(&same).unwrap_or_else(|e| panic!("{e:?}"))));
        put("key", "rotated");
        assert!(!before.same(&read(&same).unwrap_or_else(|e| panic!("{e:?}"))));
    }
}
