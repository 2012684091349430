//! Configuration: typed, layered defaults → TOML file → `BALLAST_*`
//! environment variables, strict about unknown keys, quiet about secrets.

mod duration;
pub mod encryption;
mod env;
pub mod notify;
pub mod oidc;
pub mod pipeline;
pub mod provider;
pub mod secret;
pub mod sensitive;
pub mod trigger;

use std::fmt;
use std::net::SocketAddr;
use std::path::{Path, PathBuf};
use std::sync::Arc;

use serde::Deserialize;

pub use duration::{HumanDuration, parse_duration};
pub use provider::secret_var;

/// The file read when `--config` is not given, if it exists.
pub const DEFAULT_FILE: &str = "ballast.toml";

/// Everything `ballast` reads at start-up.
#[derive(Debug, Clone, Default, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct Config {
    pub server: ServerConfig,
    pub database: DatabaseConfig,
    /// `[engine]`: how this node's workers take and hold work.
    pub engine: EngineConfig,
    /// `[providers.NAME]`: the third-party APIs.
    pub providers: std::collections::BTreeMap<String, provider::ProviderConfig>,
    /// `[pipelines.NAME]`: the workflows over them.
    pub pipelines: std::collections::BTreeMap<String, pipeline::PipelineConfig>,
    /// `[traces]`: OpenTelemetry export, off unless an endpoint is set.
    pub traces: TracesConfig,
    /// `[oidc]`: single sign-on, off unless set.
    pub oidc: Option<oidc::OidcConfig>,
    /// `[triggers.NAME]`: incoming events that start records.
    pub triggers: std::collections::BTreeMap<String, trigger::TriggerConfig>,
    /// `[[notify]]`: subscriptions to Ballast's own events.
    pub notify: Vec<notify::NotifyConfig>,
}

/// The configuration a running node uses now: read by the control plane
/// at each request, replaced whole by a reload (`crate::reload`).
#[derive(Clone)]
pub struct Live(Arc<std::sync::RwLock<(Arc<Config>, String)>>);

impl Live {
    pub fn new(config: Arc<Config>) -> Self {
        let version = config.version();
        Live(Arc::new(std::sync::RwLock::new((config, version))))
    }

    /// The configuration as it is now.
    pub fn get(&self) -> Arc<Config> {
        self.read().0.clone()
    }

    /// The version of the file it came from ([`Config::version`]; a
    /// reload may keep a provider the file no longer names, which this
    /// leaves out).
    pub fn version(&self) -> String {
        self.read().1.clone()
    }

    pub fn set(&self, config: Arc<Config>, version: String) {
        *self
            .0
            .write()
            .unwrap_or_else(std::sync::PoisonError::into_inner) = (config, version);
    }

    fn read(&self) -> std::sync::RwLockReadGuard<'_, (Arc<Config>, String)> {
        self.0
            .read()
            .unwrap_or_else(std::sync::PoisonError::into_inner)
    }
}

/// `[traces]`: spans of passes and provider calls exported over OTLP/HTTP
/// (protobuf), and `traceparent` sent to providers. Off without an
/// `endpoint`: then no exporter runs and the spans are never built. The
/// exporter also reads the standard `OTEL_EXPORTER_OTLP_HEADERS` (for a
/// collector's credentials), `OTEL_EXPORTER_OTLP_TIMEOUT`, `OTEL_BSP_*`
/// (batching), `OTEL_SERVICE_NAME` and `OTEL_RESOURCE_ATTRIBUTES`.
#[derive(Debug, Clone, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct TracesConfig {
    /// The collector, e.g. `http://127.0.0.1:4318` (spans go to its
    /// `/v1/traces`; a URL with a path is used as it is; no query, user
    /// or password). Env: `BALLAST_TRACES_ENDPOINT`.
    pub endpoint: Option<String>,
    /// The share of passes traced, 0 to 1 (a pass is traced whole or not
    /// at all; `traceparent` is sent either way). Env: `BALLAST_TRACES_SAMPLE`.
    pub sample: f64,
    /// `service.name` of the spans; without it `OTEL_SERVICE_NAME`, else
    /// `ballast`. Env: `BALLAST_TRACES_SERVICE_NAME`.
    pub service_name: Option<String>,
}

impl Default for TracesConfig {
    fn default() -> Self {
        TracesConfig {
            endpoint: None,
            sample: 1.0,
            service_name: None,
        }
    }
}

impl TracesConfig {
    fn validate(&self) -> Result<(), ConfigError> {
        let invalid = |key: &str, message: String| ConfigError::Invalid {
            key: format!("traces.{key}"),
            message,
        };
        if let Some(url) = &self.endpoint {
            let host = url
                .strip_prefix("http://")
                .or_else(|| url.strip_prefix("https://"))
                .map(|rest| rest.split(['/', '?', '#']).next().unwrap_or(""));
            let port_ok = |h: &str| match h.rsplit_once(':') {
                Some((_, port)) if !port.ends_with(']') => port.parse::<u16>().is_ok(),
                _ => true,
            };
            match host {
                None => {
                    let message = format!("`{url}` must start with http:// or https://");
                    return Err(invalid("endpoint", message));
                }
                Some(h) if h.is_empty() || url.contains(char::is_whitespace) => {
                    let message =
                        format!("`{url}` is not a URL, expected e.g. http://127.0.0.1:4318");
                    return Err(invalid("endpoint", message));
                }
                Some(_) if url.contains(['?', '#']) => {
                    let message = format!(
                        "`{url}` must not carry a query or fragment (a collector's \
                         credentials go in OTEL_EXPORTER_OTLP_HEADERS)"
                    );
                    return Err(invalid("endpoint", message));
                }
                Some(h) if !port_ok(h) => {
                    return Err(invalid("endpoint", format!("`{url}`: invalid port")));
                }
                Some(h) if h.contains('@') => {
                    let message = "must not carry a user name or password (a collector's \
                                   credentials go in OTEL_EXPORTER_OTLP_HEADERS)";
                    return Err(invalid("endpoint", message.into()));
                }
                Some(_) => {}
            }
        }
        if !(0.0..=1.0).contains(&self.sample) {
            let message = format!("{} is not a share: expected 0 to 1", self.sample);
            return Err(invalid("sample", message));
        }
        if self
            .service_name
            .as_ref()
            .is_some_and(|n| n.trim().is_empty())
        {
            return Err(invalid("service_name", "must not be empty".into()));
        }
        Ok(())
    }

    /// Where spans are sent: `endpoint`, with `/v1/traces` when it names
    /// no path; `None` when traces are off.
    pub fn export_url(&self) -> Option<String> {
        let url = self.endpoint.as_deref()?.trim_end_matches('/');
        let scheme_end = url.find("://").map_or(0, |i| i + 3);
        Some(match url[scheme_end..].contains('/') {
            true => url.to_owned(),
            false => format!("{url}/v1/traces"),
        })
    }
}

/// A secret value (a credential from the environment): never printed.
#[derive(Clone, PartialEq, Eq)]
pub struct Secret(String);

impl Secret {
    pub fn new(value: impl Into<String>) -> Self {
        Secret(value.into())
    }

    /// The value, for sending it where it belongs only.
    pub fn expose(&self) -> &str {
        &self.0
    }
}

impl fmt::Debug for Secret {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str("[redacted]")
    }
}

/// `[server]`: the control plane's HTTP listener.
#[derive(Debug, Clone, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct ServerConfig {
    /// Address to listen on. Env: `BALLAST_SERVER_BIND`.
    pub bind: SocketAddr,
    /// The URL people reach the dashboard at; decides cookie security.
    /// Env: `BALLAST_SERVER_PUBLIC_URL`.
    pub public_url: Option<String>,
    /// How long a graceful shutdown waits for in-flight work.
    /// Env: `BALLAST_SERVER_SHUTDOWN_GRACE`.
    pub shutdown_grace: HumanDuration,
    /// Session cookies carry `Secure` and the `__Host-` prefix. May be turned
    /// off only when the dashboard is served over plain HTTP on localhost.
    /// Env: `BALLAST_SERVER_SECURE_COOKIES`.
    pub secure_cookies: bool,
    /// How long a login lasts. Env: `BALLAST_SERVER_SESSION_TTL`.
    pub session_ttl: HumanDuration,
    /// How long a login lasts unused (within `session_ttl`).
    /// Env: `BALLAST_SERVER_SESSION_IDLE`.
    pub session_idle: HumanDuration,
    /// Peers whose `X-Forwarded-For` is believed (reverse proxies that
    /// overwrite it). Others' client address is the peer address.
    /// Env: `BALLAST_SERVER_TRUSTED_PROXIES` (comma-separated).
    pub trusted_proxies: Vec<std::net::IpAddr>,
    /// The key that signs session tokens, at least 32 bytes. When unset, a
    /// key is generated once and kept in the database, shared by all nodes.
    /// Environment only: `BALLAST_SECRET_KEY`.
    #[serde(skip)]
    pub secret_key: Option<Secret>,
    /// The first admin's password, used only when the database has no users
    /// yet; without it a random one is printed once.
    /// Environment only: `BALLAST_ADMIN_PASSWORD`.
    #[serde(skip)]
    pub admin_password: Option<Secret>,
    /// A bearer token that may read `/metrics` (API tokens may too).
    /// Environment only: `BALLAST_METRICS_TOKEN`.
    #[serde(skip)]
    pub metrics_token: Option<Secret>,
    /// How many groups of each pipeline `/metrics` names in
    /// `ballast_group_records` (those with the most records at work; the
    /// rest are summed in `ballast_group_records_other`), at most
    /// [`MAX_METRICS_GROUPS`]; 0 leaves both families out.
    /// Env: `BALLAST_SERVER_METRICS_GROUPS`.
    pub metrics_groups: u32,
    /// `[server.limits]`: how much one client can do.
    pub limits: WebLimits,
}

impl Default for ServerConfig {
    fn default() -> Self {
        ServerConfig {
            bind: SocketAddr::from(([127, 0, 0, 1], 8080)),
            public_url: None,
            shutdown_grace: HumanDuration::secs(10),
            secure_cookies: true,
            session_ttl: HumanDuration::secs(8 * 3600),
            session_idle: HumanDuration::secs(30 * 60),
            trusted_proxies: Vec::new(),
            secret_key: None,
            admin_password: None,
            metrics_token: None,
            metrics_groups: 20,
            limits: WebLimits::default(),
        }
    }
}

/// `[server.limits]`: rate limits and caps of the control plane.
#[derive(Debug, Clone, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct WebLimits {
    /// Login attempts per client address per minute.
    pub logins_per_minute: u32,
    /// Failed logins on one account name after which each further check
    /// of that name waits (1 s after the latest failure, doubling with each
    /// one, at most 30 s; a browser that logged in to the name before does
    /// not wait).
    pub account_failures: u32,
    /// A failure this long after the name's previous one starts its count
    /// again. (`lockout` is read as this too: it was the window and the
    /// lock's length when failures locked a name.)
    #[serde(alias = "lockout")]
    pub account_window: HumanDuration,
    /// Password checks (argon2, about 19 MiB each) one node runs at once;
    /// a login past them is answered 503 with `Retry-After` unchecked.
    /// Default: twice the CPU cores, from 4 to 16.
    pub password_checks: u32,
    /// API requests per second per token (bursts of twice as many); four
    /// times as many per client address, for the API and `/metrics`.
    pub api_per_second: u32,
    /// Webhook deliveries per second per client address (bursts of twice
    /// as many), refused 429 before any lookup or signature check.
    pub hooks_per_second: u32,
    /// Records one bulk action may touch.
    pub bulk_max: u32,
    /// Bulk actions per user per minute.
    pub bulk_per_minute: u32,
    /// The largest request body accepted, in bytes.
    pub max_body_bytes: usize,
}

impl Default for WebLimits {
    fn default() -> Self {
        WebLimits {
            logins_per_minute: 10,
            account_failures: 5,
            account_window: HumanDuration::secs(15 * 60),
            password_checks: default_password_checks(),
            api_per_second: 50,
            hooks_per_second: 500,
            bulk_max: 1000,
            bulk_per_minute: 10,
            max_body_bytes: 256 * 1024,
        }
    }
}

/// Twice the CPU cores, from 4 to 16: enough to keep the cores busy
/// checking, few enough that the checks' memory stays under about 300 MiB.
fn default_password_checks() -> u32 {
    let cores = std::thread::available_parallelism().map_or(2, std::num::NonZeroUsize::get);
    u32::try_from(cores.saturating_mul(2))
        .unwrap_or(u32::MAX)
        .clamp(4, 16)
}

impl ServerConfig {
    /// True when the dashboard is reached over plain HTTP on this machine
    /// only, the one case where cookies may go without `Secure`.
    pub fn is_plain_localhost(&self) -> bool {
        match &self.public_url {
            Some(url) => {
                let Some(rest) = url.strip_prefix("http://") else {
                    return false;
                };
                let host = rest.split(['/', '?', '#']).next().unwrap_or("");
                let host = match host.rsplit_once(':') {
                    Some((h, port)) if port.bytes().all(|b| b.is_ascii_digit()) => h,
                    _ => host,
                };
                matches!(host, "localhost" | "127.0.0.1" | "[::1]")
            }
            None => self.bind.ip().is_loopback(),
        }
    }

    /// The origin (`scheme://host[:port]`) of `public_url`, if set.
    pub fn public_origin(&self) -> Option<String> {
        let url = self.public_url.as_deref()?;
        let scheme_end = url.find("://")? + 3;
        let end = url[scheme_end..]
            .find(['/', '?', '#'])
            .map_or(url.len(), |i| scheme_end + i);
        let origin = url[..end].to_ascii_lowercase();
        // Browsers leave default ports out of `Origin`.
        let origin = origin
            .strip_suffix(":443")
            .filter(|o| o.starts_with("https://"))
            .or_else(|| {
                origin
                    .strip_suffix(":80")
                    .filter(|o| o.starts_with("http://"))
            })
            .map(str::to_owned)
            .unwrap_or(origin);
        Some(origin)
    }
}

/// `[engine]`: how this node's workers take and hold work.
#[derive(Debug, Clone, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct EngineConfig {
    /// How long a claimed record is held without a word from its worker
    /// (the worker extends it while alive); after that another node takes
    /// it over, and the stale worker's write is refused.
    pub lease: HumanDuration,
    /// Records claimed per database round trip, at least: a claim takes as
    /// many as there are free slots, up to 1,000, when that is more.
    pub batch: u32,
    /// Records this node works on at once.
    pub max_in_flight: u32,
    /// The longest the workers sleep with nothing due. Work another node
    /// or process enqueues wakes them at once on PostgreSQL (LISTEN/NOTIFY);
    /// this bounds how late work is found that nothing announced.
    pub idle_max: HumanDuration,
}

impl Default for EngineConfig {
    fn default() -> Self {
        EngineConfig {
            lease: HumanDuration::secs(30),
            batch: 50,
            max_in_flight: 256,
            idle_max: HumanDuration::secs(2),
        }
    }
}

/// `[database]`: where records live.
#[derive(Debug, Clone, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct DatabaseConfig {
    /// `sqlite://FILE?mode=rwc` or `postgres://user@host/db`.
    /// Env: `BALLAST_DATABASE_URL`.
    pub url: DatabaseUrl,
    /// Connection pool size. Env: `BALLAST_DATABASE_MAX_CONNECTIONS`.
    pub max_connections: u32,
    /// How long to wait for a pooled connection.
    /// Env: `BALLAST_DATABASE_ACQUIRE_TIMEOUT`.
    pub acquire_timeout: HumanDuration,
    /// SQLite: how long a statement waits for another process's write
    /// lock before it fails ("database is locked").
    /// Env: `BALLAST_DATABASE_BUSY_TIMEOUT`.
    pub busy_timeout: HumanDuration,
    /// `[database.encryption]`: values sealed at rest.
    pub encryption: encryption::EncryptionConfig,
}

impl Default for DatabaseConfig {
    fn default() -> Self {
        DatabaseConfig {
            url: DatabaseUrl("sqlite://ballast.db?mode=rwc".into()),
            max_connections: 10,
            acquire_timeout: HumanDuration::secs(10),
            busy_timeout: HumanDuration::secs(10),
            encryption: Default::default(),
        }
    }
}

/// A database URL. It may carry a password, so `Debug` and `Display` show
/// it with the password masked; [`expose`](Self::expose) gives the real one.
#[derive(Clone, PartialEq, Eq, Deserialize)]
#[serde(transparent)]
pub struct DatabaseUrl(String);

impl DatabaseUrl {
    pub fn new(url: impl Into<String>) -> Self {
        DatabaseUrl(url.into())
    }

    /// The URL with its password, for connecting only.
    pub fn expose(&self) -> &str {
        &self.0
    }

    /// The URL with any password replaced by `***`.
    pub fn redacted(&self) -> String {
        let url = &self.0;
        let Some(scheme_end) = url.find("://") else {
            return url.clone();
        };
        let rest = &url[scheme_end + 3..];
        let authority_end = rest.find(['/', '?']).unwrap_or(rest.len());
        let authority = &rest[..authority_end];
        let Some(at) = authority.rfind('@') else {
            return url.clone();
        };
        let userinfo = &authority[..at];
        let user = userinfo.split(':').next().unwrap_or("");
        if !userinfo.contains(':') {
            return url.clone();
        }
        format!("{}://{user}:***@{}", &url[..scheme_end], &rest[at + 1..])
    }
}

impl fmt::Debug for DatabaseUrl {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{:?}", self.redacted())
    }
}

impl fmt::Display for DatabaseUrl {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(&self.redacted())
    }
}

/// A configuration problem, precise enough to fix without guessing.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum ConfigError {
    #[error("config file {}: {message}", file.display())]
    Read { file: PathBuf, message: String },
    #[error("{}:{line}:{column}: {}{message}", file.display(), key.as_ref().map(|k| format!("key `{k}`: ")).unwrap_or_default())]
    Parse {
        file: PathBuf,
        line: usize,
        column: usize,
        key: Option<String>,
        message: String,
    },
    #[error("environment variable {var}: {message}")]
    Env { var: String, message: String },
    #[error("config `{key}`: {message}")]
    Invalid { key: String, message: String },
}

/// Where the configuration came from, for `check-config`.
#[derive(Debug, Clone)]
pub struct Loaded {
    pub config: Config,
    /// The file read, if any.
    pub file: Option<PathBuf>,
    /// The environment variables that overrode a value.
    pub env: Vec<String>,
}

impl Config {
    /// The version of what a reload can change (providers and pipelines),
    /// the same on every node whose files say the same: 12 hex digits of a
    /// SHA-256 over their settings (`Debug`: every field, no secret).
    pub fn version(&self) -> String {
        use sha2::Digest;
        let text = format!("{:?}\n{:?}", self.providers, self.pipelines);
        hex::encode(&sha2::Sha256::digest(text.as_bytes())[..6])
    }

    /// Loads defaults, then `file` (or `ballast.toml` if present), then the
    /// process environment, then validates (pipelines apart: see
    /// [`validate`](Self::validate)).
    pub fn load(file: Option<&Path>) -> Result<Loaded, ConfigError> {
        Self::load_with(file, &|var| std::env::var(var).ok())
    }

    /// [`load`](Self::load) for a reload of `running`: the server's
    /// secrets (and their `_FILE` twins) are not read again, the running
    /// ones stand (the caller keeps the sections that change only at a
    /// restart); everything else is read and checked as at start.
    pub fn load_for_reload(file: Option<&Path>, running: &Config) -> Result<Loaded, ConfigError> {
        Self::load_inner(file, &|var| std::env::var(var).ok(), Some(running))
    }

    /// [`load`](Self::load) with the environment given as a lookup, for tests.
    pub fn load_with(
        file: Option<&Path>,
        env: &dyn Fn(&str) -> Option<String>,
    ) -> Result<Loaded, ConfigError> {
        Self::load_inner(file, env, None)
    }

    /// [`load_with`](Self::load_with), for a reload when `running` is given.
    fn load_inner(
        file: Option<&Path>,
        env: &dyn Fn(&str) -> Option<String>,
        running: Option<&Config>,
    ) -> Result<Loaded, ConfigError> {
        let path = match file {
            Some(p) => Some(p.to_path_buf()),
            None => Some(PathBuf::from(DEFAULT_FILE)).filter(|p| p.exists()),
        };
        let mut config = match &path {
            Some(p) => {
                let text = std::fs::read_to_string(p).map_err(|e| ConfigError::Read {
                    file: p.clone(),
                    message: e.to_string(),
                })?;
                Self::parse(&text, p)?
            }
            None => Config::default(),
        };
        let credentials = env(secret::CREDENTIALS_DIRECTORY).map(PathBuf::from);
        let beside = path
            .as_deref()
            .and_then(Path::parent)
            .unwrap_or(Path::new("."));
        // A provider's relative secret files: in systemd's credentials
        // directory when set, else beside this file.
        let dir = secret::SecretsDir::new(credentials.as_deref(), beside);
        for p in config.providers.values_mut() {
            p.secrets_dir = dir.clone();
        }
        config.database.encryption.load(env, &dir)?;
        if let Some(o) = &mut config.oidc {
            o.load(env, &dir)?;
        }
        for t in config.triggers.values_mut() {
            t.secrets_dir = dir.clone();
        }
        for n in &mut config.notify {
            n.secrets_dir = dir.clone();
        }
        let applied = match running {
            None => env::apply(&mut config, env)?,
            Some(running) => {
                let not_start_only = |v: &str| (!env::start_only(v)).then(|| env(v)).flatten();
                let applied = env::apply(&mut config, &not_start_only)?;
                config.server.secret_key = running.server.secret_key.clone();
                config.server.admin_password = running.server.admin_password.clone();
                config.server.metrics_token = running.server.metrics_token.clone();
                let url_from_env = ["BALLAST_DATABASE_URL", "BALLAST_DATABASE_URL_FILE"];
                if url_from_env.iter().any(|v| env(v).is_some()) {
                    config.database.url = running.database.url.clone();
                }
                applied
            }
        };
        config.validate(env)?;
        Ok(Loaded {
            config,
            file: path,
            env: applied,
        })
    }

    /// Parses TOML text; errors point at `file`'s line, column and key.
    pub fn parse(text: &str, file: &Path) -> Result<Config, ConfigError> {
        let mut config: Config = toml::from_str(text).map_err(|e| {
            let offset = e.span().map_or(0, |s| s.start);
            let (line, column) = line_col(text, offset);
            ConfigError::Parse {
                file: file.to_path_buf(),
                line,
                column,
                key: key_at(text, offset),
                message: e.message().trim().to_owned(),
            }
        })?;
        config.note_step_timeouts();
        Ok(config)
    }

    /// Tells each provider the longest call timeout its steps give.
    fn note_step_timeouts(&mut self) {
        let steps = self.pipelines.values().flat_map(|p| &p.steps);
        for s in steps {
            let (Some(t), Some(p)) = (s.timeout, self.providers.get_mut(&s.provider)) else {
                continue;
            };
            if t > p.timeout && p.longest_step_timeout.is_none_or(|l| t > l) {
                p.longest_step_timeout = Some(t);
            }
        }
    }

    /// Checks everything but the pipelines, which `pipeline::compile` checks
    /// (the layer above, which the CLI calls right after loading); `env`
    /// supplies the credentials that providers name.
    pub fn validate(&self, env: &dyn Fn(&str) -> Option<String>) -> Result<(), ConfigError> {
        self.validate_core()?;
        self.check_sensitive()?;
        for (name, p) in &self.providers {
            if !name
                .bytes()
                .all(|b| b.is_ascii_lowercase() || b.is_ascii_digit() || b == b'_' || b == b'-')
            {
                return Err(ConfigError::Invalid {
                    key: format!("providers.{name}"),
                    message: "provider names are a-z, 0-9, `_`, `-`".into(),
                });
            }
            p.validate(name, env)?;
        }
        for (name, t) in &self.triggers {
            t.validate(name, &self.pipelines, env)?;
        }
        notify::validate_all(&self.notify, &self.providers, env)?;
        Ok(())
    }

    /// Checks everything but the providers and pipelines, in the order the
    /// first problem is reported: storage and engine, the public URL,
    /// traces, sessions and secrets, then the web limits.
    fn validate_core(&self) -> Result<(), ConfigError> {
        self.validate_storage_and_engine()?;
        self.server.validate_public_url()?;
        self.traces.validate()?;
        self.server.validate_sessions()?;
        if let Some(o) = &self.oidc {
            o.validate(&self.server)?;
        }
        self.server.limits.validate()
    }

    /// Whether the database can be opened and the engine's settings are
    /// within bounds.
    fn validate_storage_and_engine(&self) -> Result<(), ConfigError> {
        if Backend::of_url(self.database.url.expose()).is_none() {
            return Err(invalid(
                "database.url",
                format!(
                    "`{}` is not a sqlite: or postgres:// URL",
                    self.database.url.redacted()
                ),
            ));
        }
        if self.engine.lease.0 < std::time::Duration::from_secs(1) {
            return Err(invalid("engine.lease", "must be at least 1s".into()));
        }
        if !(1..=1000).contains(&self.engine.batch) {
            return Err(invalid("engine.batch", "must be between 1 and 1000".into()));
        }
        if !(1..=100_000).contains(&self.engine.max_in_flight) {
            return Err(invalid(
                "engine.max_in_flight",
                "must be between 1 and 100000".into(),
            ));
        }
        if self.engine.idle_max.0 < std::time::Duration::from_millis(10) {
            return Err(invalid("engine.idle_max", "must be at least 10ms".into()));
        }
        if self.database.max_connections == 0 {
            return Err(invalid(
                "database.max_connections",
                "must be at least 1".into(),
            ));
        }
        // Zero would turn SQLite's busy handler off: every write beside
        // another process's would fail at once.
        if self.database.busy_timeout.0 < std::time::Duration::from_millis(100) {
            return Err(invalid(
                "database.busy_timeout",
                "must be at least 100ms".into(),
            ));
        }
        Ok(())
    }
}

impl ServerConfig {
    /// Whether `public_url`, when set, is an HTTP(S) URL without a user
    /// name or password.
    fn validate_public_url(&self) -> Result<(), ConfigError> {
        if let Some(url) = &self.public_url {
            if !(url.starts_with("http://") || url.starts_with("https://")) {
                return Err(invalid(
                    "server.public_url",
                    format!("`{url}` must start with http:// or https://"),
                ));
            }
            if self.public_origin().is_some_and(|o| o.contains('@')) {
                return Err(invalid(
                    "server.public_url",
                    format!("`{url}` must not carry a user name or password"),
                ));
            }
        }
        Ok(())
    }

    /// Whether sessions are safe: cookies without `Secure` only on plain
    /// localhost, lifetimes long enough to use, and keys and tokens long
    /// enough to resist guessing.
    fn validate_sessions(&self) -> Result<(), ConfigError> {
        if !self.secure_cookies && !self.is_plain_localhost() {
            return Err(invalid(
                "server.secure_cookies",
                "may be false only when the dashboard is served over plain HTTP on localhost \
                 (public_url http://localhost… or http://127.0.0.1…, or no public_url and a loopback bind)"
                    .into(),
            ));
        }
        if self.session_ttl.0.as_secs() < 60 {
            return Err(invalid("server.session_ttl", "must be at least 1m".into()));
        }
        // Uses are noted once a minute: a shorter idle time would end
        // sessions in use.
        if self.session_idle.0.as_secs() < 5 * 60 {
            return Err(invalid("server.session_idle", "must be at least 5m".into()));
        }
        if let Some(key) = &self.secret_key {
            if key.expose().len() < 32 {
                return Err(invalid(
                    "server.secret_key (BALLAST_SECRET_KEY)",
                    "must be at least 32 bytes".into(),
                ));
            }
        }
        if self.metrics_groups > MAX_METRICS_GROUPS {
            return Err(invalid(
                "server.metrics_groups",
                format!("must be at most {MAX_METRICS_GROUPS}"),
            ));
        }
        if let Some(token) = &self.metrics_token {
            if token.expose().trim().len() < crate::auth::webhook::MIN_SECRET {
                return Err(invalid(
                    "server.metrics_token (BALLAST_METRICS_TOKEN)",
                    format!(
                        "must be at least {} characters, not blank",
                        crate::auth::webhook::MIN_SECRET
                    ),
                ));
            }
        }
        Ok(())
    }
}

/// The most groups per pipeline `server.metrics_groups` may ask
/// `/metrics` to name: each is five series (one per state not final).
pub const MAX_METRICS_GROUPS: u32 = 200;

/// The error for the setting at `key` (dotted, as in the file).
fn invalid(key: &str, message: String) -> ConfigError {
    ConfigError::Invalid {
        key: key.to_owned(),
        message,
    }
}

impl WebLimits {
    fn validate(&self) -> Result<(), ConfigError> {
        let invalid = |key: &str, message: &str| ConfigError::Invalid {
            key: key.to_owned(),
            message: message.to_owned(),
        };
        for (key, value) in [
            ("server.limits.logins_per_minute", self.logins_per_minute),
            ("server.limits.account_failures", self.account_failures),
            ("server.limits.password_checks", self.password_checks),
            ("server.limits.api_per_second", self.api_per_second),
            ("server.limits.hooks_per_second", self.hooks_per_second),
            ("server.limits.bulk_max", self.bulk_max),
            ("server.limits.bulk_per_minute", self.bulk_per_minute),
        ] {
            if value == 0 {
                return Err(invalid(key, "must be at least 1"));
            }
        }
        // Shorter than the longest wait, a window would cut the waits short.
        if self.account_window.0.as_secs() < 60 {
            return Err(invalid(
                "server.limits.account_window",
                "must be at least 1m",
            ));
        }
        if self.max_body_bytes < 1024 {
            return Err(invalid(
                "server.limits.max_body_bytes",
                "must be at least 1024",
            ));
        }
        Ok(())
    }
}

/// 1-based line and column of a byte offset.
fn line_col(text: &str, offset: usize) -> (usize, usize) {
    let before = &text[..offset.min(text.len())];
    let line = before.matches('\n').count() + 1;
    let column = before
        .rfind('\n')
        .map_or(before.len(), |nl| before.len() - nl - 1)
        + 1;
    (line, column)
}

/// The dotted key whose line holds `offset`: the `key = …` on that line (or
/// the nearest line above with one), under the last `[table]` header.
fn key_at(text: &str, offset: usize) -> Option<String> {
    let offset = offset.min(text.len());
    let line_start = text[..offset].rfind('\n').map_or(0, |i| i + 1);
    let lines_up_to: Vec<&str> = text[..line_start].lines().collect();
    let current = text[line_start..].lines().next().unwrap_or("");
    let key_of = |line: &str| -> Option<String> {
        let t = line.trim();
        if t.starts_with('[') || t.starts_with('#') {
            return None;
        }
        let (k, _) = t.split_once('=')?;
        let k = k.trim().trim_matches('"');
        (!k.is_empty()).then(|| k.to_owned())
    };
    let table_of = |line: &str| -> Option<String> {
        let t = line.trim();
        let inner = t
            .strip_prefix("[[")
            .and_then(|r| r.strip_suffix("]]"))
            .or_else(|| t.strip_prefix('[').and_then(|r| r.strip_suffix(']')))?;
        Some(inner.trim().to_owned())
    };
    if let Some(table) = table_of(current) {
        return Some(table);
    }
    let key = key_of(current).or_else(|| {
        lines_up_to
            .iter()
            .rev()
            .take_while(|l| table_of(l).is_none())
            .find_map(|l| key_of(l))
    })?;
    let table = lines_up_to.iter().rev().find_map(|l| table_of(l));
    Some(match table {
        Some(t) => format!("{t}.{key}"),
        None => key,
    })
}

/// Which database a URL names.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Backend {
    Sqlite,
    Postgres,
}

impl Backend {
    pub fn of_url(url: &str) -> Option<Backend> {
        if url.starts_with("sqlite:") {
            Some(Backend::Sqlite)
        } else if url.starts_with("postgres://") || url.starts_with("postgresql://") {
            Some(Backend::Postgres)
        } else {
            None
        }
    }

    pub fn as_str(self) -> &'static str {
        match self {
            Backend::Sqlite => "sqlite",
            Backend::Postgres => "postgres",
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn parse(text: &str) -> Result<Config, ConfigError> {
        Config::parse(text, Path::new("test.toml"))
    }

    #[test]
    fn defaults_are_local_and_sqlite() {
        let c = parse("").unwrap_or_default();
        assert_eq!(c.server.bind.to_string(), "127.0.0.1:8080");
        assert_eq!(c.database.url.expose(), "sqlite://ballast.db?mode=rwc");
    }

    #[test]
    fn unknown_key_names_file_line_and_key() {
        let err = parse("[server]\nbind = \"127.0.0.1:9\"\nbnd = 1\n").err();
        let Some(ConfigError::Parse {
            line, key, message, ..
        }) = err.clone()
        else {
            panic!("expected a parse error, got {err:?}");
        };
        assert_eq!(line, 3);
        assert_eq!(key.as_deref(), Some("server.bnd"));
        assert!(message.contains("bnd"), "{message}");
        let shown = err.map(|e| e.to_string()).unwrap_or_default();
        assert!(
            shown.starts_with("test.toml:3:1: key `server.bnd`"),
            "{shown}"
        );
    }

    #[test]
    fn bad_value_names_its_key() {
        let err = parse("[database]\nmax_connections = \"many\"\n").err();
        let Some(ConfigError::Parse { line, key, .. }) = err.clone() else {
            panic!("expected a parse error, got {err:?}");
        };
        assert_eq!(
            (line, key.as_deref()),
            (2, Some("database.max_connections"))
        );
    }

    #[test]
    fn unknown_table_is_refused() {
        let err = parse("[servr]\nbind = \"1.2.3.4:5\"\n").err();
        assert!(
            matches!(err, Some(ConfigError::Parse { line: 1, .. })),
            "{err:?}"
        );
    }

    #[test]
    fn bad_duration_is_refused() {
        let err = parse("[server]\nshutdown_grace = \"ten seconds\"\n").err();
        assert!(
            matches!(&err, Some(ConfigError::Parse { line: 2, key: Some(k), .. }) if k == "server.shutdown_grace"),
            "{err:?}"
        );
    }

    #[test]
    fn traces_are_off_by_default_and_checked_when_on() {
        let off = Config::default();
        assert_eq!(off.traces.export_url(), None);
        let on = |text: &str| {
            let c = parse(text)?;
            c.validate_core()?;
            Ok::<_, ConfigError>(c.traces)
        };
        let t = on("[traces]\nendpoint = \"http://otel:4318\"\nsample = 0.25\n").unwrap();
        assert_eq!(
            t.export_url().as_deref(),
            Some("http://otel:4318/v1/traces")
        );
        assert_eq!(t.sample, 0.25);
        assert_eq!(t.service_name, None);
        let t = on("[traces]\nendpoint = \"https://otel.example/ingest/traces/\"\n").unwrap();
        assert_eq!(
            t.export_url().as_deref(),
            Some("https://otel.example/ingest/traces")
        );
        for (bad, key) in [
            ("endpoint = \"otel:4318\"", "traces.endpoint"),
            ("endpoint = \"http://\"", "traces.endpoint"),
            ("endpoint = \"http://a b\"", "traces.endpoint"),
            (
                "endpoint = \"https://u:pw@otel.example\"",
                "traces.endpoint",
            ),
            (
                "endpoint = \"http://otel:4318?api_key=k\"",
                "traces.endpoint",
            ),
            ("endpoint = \"http://otel:4318/#x\"", "traces.endpoint"),
            ("endpoint = \"http://otel:99999\"", "traces.endpoint"),
            ("sample = 1.5", "traces.sample"),
            ("sample = -0.1", "traces.sample"),
            ("sample = nan", "traces.sample"),
            ("service_name = \" \"", "traces.service_name"),
        ] {
            match on(&format!("[traces]\n{bad}\n")) {
                Err(ConfigError::Invalid { key: k, .. }) => assert_eq!(k, key, "{bad}"),
                other => panic!("{bad}: {other:?}"),
            }
        }
        let env = |v: &str| match v {
            "BALLAST_TRACES_ENDPOINT" => Some("http://127.0.0.1:4318".to_owned()),
            "BALLAST_TRACES_SAMPLE" => Some("0.5".to_owned()),
            _ => None,
        };
        let loaded = Config::load_with(None, &env).unwrap();
        assert_eq!(
            loaded.config.traces.export_url().as_deref(),
            Some("http://127.0.0.1:4318/v1/traces")
        );
        assert_eq!(loaded.config.traces.sample, 0.5);
        let env = |v: &str| (v == "BALLAST_TRACES_SAMPLE").then(|| "most".to_owned());
        assert!(matches!(
            Config::load_with(None, &env),
            Err(ConfigError::Env { .. })
        ));
    }

    #[test]
    fn env_overrides_file() {
        let dir = tempfile::tempdir().ok();
        let path = dir
            .as_ref()
            .map(|d| d.path().join("b.toml"))
            .unwrap_or_default();
        std::fs::write(&path, "[database]\nurl = \"sqlite://x.db\"\n").ok();
        let env =
            |v: &str| (v == "BALLAST_DATABASE_URL").then(|| "postgres://u:pw@h/db".to_owned());
        let loaded = Config::load_with(Some(&path), &env);
        let loaded = loaded.unwrap_or_else(|e| panic!("{e}"));
        assert_eq!(loaded.config.database.url.expose(), "postgres://u:pw@h/db");
        assert_eq!(loaded.env, vec!["BALLAST_DATABASE_URL".to_owned()]);
    }

    #[test]
    fn sessions_idle_for_30_minutes_unless_told_otherwise() {
        let dir = tempfile::tempdir().ok();
        let path = dir
            .as_ref()
            .map(|d| d.path().join("idle.toml"))
            .unwrap_or_default();
        std::fs::write(&path, "").ok();
        let none = |_: &str| None;
        let defaults = Config::load_with(Some(&path), &none).unwrap_or_else(|e| panic!("{e}"));
        assert_eq!(defaults.config.server.session_idle.0.as_secs(), 30 * 60);
        let env = |v: &str| (v == "BALLAST_SERVER_SESSION_IDLE").then(|| "1h".to_owned());
        let loaded = Config::load_with(Some(&path), &env).unwrap_or_else(|e| panic!("{e}"));
        assert_eq!(loaded.config.server.session_idle.0.as_secs(), 3600);
        let mut short = loaded.config;
        short.server.session_idle = HumanDuration::secs(60);
        let err = short.validate(&none).err().map(|e| e.to_string());
        assert!(err.is_some_and(|e| e.contains("server.session_idle")));
    }

    #[test]
    fn bad_env_names_the_variable() {
        let env = |v: &str| (v == "BALLAST_DATABASE_MAX_CONNECTIONS").then(|| "lots".to_owned());
        let err = Config::load_with(Some(Path::new("/nonexistent/none.toml")), &env).err();
        assert!(matches!(err, Some(ConfigError::Read { .. })), "{err:?}");
        let dir = tempfile::tempdir().ok();
        let path = dir
            .as_ref()
            .map(|d| d.path().join("b.toml"))
            .unwrap_or_default();
        std::fs::write(&path, "").ok();
        let err = Config::load_with(Some(&path), &env)
            .err()
            .map(|e| e.to_string());
        assert_eq!(
            err.as_deref(),
            Some("environment variable BALLAST_DATABASE_MAX_CONNECTIONS: invalid number `lots`")
        );
    }

    #[test]
    fn engine_settings_are_checked_by_field() {
        let ok = parse("[engine]\nlease = \"5s\"\nbatch = 200\nmax_in_flight = 1000\n");
        let ok = ok.unwrap_or_else(|e| panic!("{e}"));
        assert_eq!(ok.validate(&|_| None).ok(), Some(()));
        assert_eq!(
            (ok.engine.lease.0, ok.engine.batch, ok.engine.max_in_flight),
            (std::time::Duration::from_secs(5), 200, 1000)
        );
        for (text, field) in [
            ("[engine]\nlease = \"500ms\"\n", "engine.lease"),
            ("[engine]\nbatch = 0\n", "engine.batch"),
            ("[engine]\nbatch = 5000\n", "engine.batch"),
            ("[engine]\nmax_in_flight = 0\n", "engine.max_in_flight"),
            ("[engine]\nidle_max = \"1ms\"\n", "engine.idle_max"),
        ] {
            let err = parse(text).map(|c| c.validate(&|_| None));
            assert!(
                matches!(err, Ok(Err(ConfigError::Invalid { ref key, .. })) if key == field),
                "{text}: {err:?}"
            );
        }
    }

    #[test]
    fn unsupported_database_is_refused_by_field() {
        let err = parse("[database]\nurl = \"mysql://x\"\n").map(|c| c.validate(&|_| None));
        assert!(
            matches!(err, Ok(Err(ConfigError::Invalid { ref key, .. })) if key == "database.url"),
            "{err:?}"
        );
    }

    #[test]
    fn passwords_never_print() {
        let url =
            DatabaseUrl::new("postgres://ballast:hunter2@db.internal:5432/ballast?sslmode=require");
        let c = Config {
            database: DatabaseConfig {
                url: url.clone(),
                ..Default::default()
            },
            ..Default::default()
        };
        for shown in [format!("{c:?}"), url.to_string(), url.redacted()] {
            assert!(!shown.contains("hunter2"), "{shown}");
        }
        assert_eq!(
            url.redacted(),
            "postgres://ballast:***@db.internal:5432/ballast?sslmode=require"
        );
        assert_eq!(
            DatabaseUrl::new("postgres://postgres@127.0.0.1/test").redacted(),
            "postgres://postgres@127.0.0.1/test"
        );
    }
}
