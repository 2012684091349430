//! What protects one provider from us on this node: its concurrency slots
//! and rate permits (the cluster's, leased: `permits`), the "slow down"
//! pause, the circuit breaker and the retry budget.

use std::sync::{Arc, Mutex, MutexGuard, PoisonError};

use tokio::sync::Semaphore;

use super::permits::ClusterLimits;
use crate::config::provider::{ConcurrencyScope, ProviderConfig, ProviderSecrets};
use crate::domain::UnixMs;
use crate::domain::backoff::RetryBudget;
use crate::domain::breaker::Breaker;
use crate::domain::rules::Rule;

/// This node's calls in flight to one provider, and the provider's "slow
/// down" pause. (The rate windows are the cluster's: `permits`.)
#[derive(Debug, Default)]
pub struct Limiter {
    /// Granted calls that have not completed.
    in_flight: usize,
    paused_until: UnixMs,
}

impl Limiter {
    /// Calls in flight.
    pub fn in_flight(&self) -> usize {
        self.in_flight
    }

    /// Grants a call now, or says until when the provider asked to wait. A
    /// granted call must be followed by [`complete`](Self::complete).
    pub fn try_acquire(&mut self, now: UnixMs) -> Result<(), UnixMs> {
        if now < self.paused_until {
            return Err(self.paused_until);
        }
        self.in_flight += 1;
        Ok(())
    }

    /// A granted call finished or was never sent.
    pub fn complete(&mut self) {
        self.in_flight = self.in_flight.saturating_sub(1);
    }

    /// Until when the provider asked us to wait, if that is after `now`.
    pub fn paused_at(&self, now: UnixMs) -> Option<UnixMs> {
        (now < self.paused_until).then_some(self.paused_until)
    }

    /// The provider asked us to slow down (429 with Retry-After).
    pub fn pause_until(&mut self, until: UnixMs) {
        self.paused_until = self.paused_until.max(until);
    }
}

/// One provider's runtime on this node: its settings (replaced whole by a
/// configuration reload; a call in flight keeps the ones it started with)
/// and its state (the `Arc`s, carried from one set of settings to the next).
pub struct ProviderRuntime {
    pub name: String,
    pub config: ProviderConfig,
    pub rules: Vec<Rule>,
    pub client: reqwest::Client,
    /// The concurrency slots this node may use: the cap (scope `node`), or
    /// the slots it holds of the cluster's cap.
    pub concurrency: Arc<Semaphore>,
    /// The rate windows and (scope `cluster`) the cap, for the cluster.
    pub cluster: Arc<ClusterLimits>,
    limiter: Arc<Mutex<Limiter>>,
    breaker: Arc<Mutex<Breaker>>,
    budget: Arc<Mutex<RetryBudget>>,
    /// Paused by an operator (read from the shared provider state).
    paused: Arc<Mutex<bool>>,
    /// The latest "slow down" pause this node has published to the others.
    published_throttle: Arc<std::sync::atomic::AtomicI64>,
    /// Its calls' metric handles.
    pub(crate) calls: Arc<super::call_metrics::CallMetrics>,
    /// `config.base_url` parsed (`None`: it is no URL, and every call
    /// says so). Made with `config` by every constructor; `config` is
    /// never changed in place (a reload makes a new runtime).
    base: Option<reqwest::Url>,
    /// Answers calls in-process instead of over HTTP (benchmarks).
    pub in_process: Option<super::http::InProcess>,
    /// The provider's OAuth2 token on this node, when it uses one.
    pub token: Option<Arc<super::token::TokenSource>>,
    /// Its secrets as read at start or at the reload that made this
    /// runtime: calls made with it keep them to their end.
    pub secrets: ProviderSecrets,
}

/// A provider's new settings, checked and built, not yet in use
/// ([`ProviderRuntime::prepare`]).
pub struct Prepared {
    config: ProviderConfig,
    rules: Vec<Rule>,
    client: reqwest::Client,
    token: Option<Arc<super::token::TokenSource>>,
    secrets: ProviderSecrets,
}

/// The longest a call started before a grant or probe lapsed may still be
/// under way: twice the longest timeout its calls have (the provider's or
/// a step's), and 5 s.
pub fn lapse_ms(config: &ProviderConfig) -> i64 {
    let longest = config
        .longest_step_timeout
        .map_or(config.timeout, |t| t.max(config.timeout));
    2 * i64::try_from(longest.0.as_millis()).unwrap_or(i64::MAX / 8) + 5_000
}

fn lock<T>(m: &Mutex<T>) -> MutexGuard<'_, T> {
    m.lock().unwrap_or_else(PoisonError::into_inner)
}

impl ProviderRuntime {
    /// The URL of a call to `path` (as rendered) on this provider
    /// ([`call_url`](super::redirect::call_url), its base parsed once).
    pub(super) fn call_url(&self, path: &str) -> Result<reqwest::Url, String> {
        match &self.base {
            Some(base) => super::redirect::call_url_under(base, &self.config.base_url, path),
            None => super::redirect::call_url(&self.config.base_url, path),
        }
    }

    /// The provider's OAuth2 token, when it takes one (`None` when it does
    /// not); the endpoint's error, and until when, when there is none.
    pub(super) async fn token_now(
        &self,
        clock: &dyn crate::domain::Clock,
    ) -> Result<Option<crate::config::Secret>, super::token::NoToken> {
        match &self.token {
            Some(src) => src.get(&self.client, clock).await.map(Some),
            None => Ok(None),
        }
    }

    /// What a reply to a call with `token` says of the token: taken (any
    /// status but `401`), or refused (a `401`: dropped, and counted when
    /// the provider never took it; see `TokenSource::renew`).
    pub(super) fn judge_token(
        &self,
        token: Option<&crate::config::Secret>,
        status: Option<u16>,
        clock: &dyn crate::domain::Clock,
    ) {
        match (&self.token, token, status) {
            (Some(src), Some(t), Some(401)) => src.refused(t, clock),
            (Some(src), Some(t), Some(_)) => src.accepted(t),
            _ => {}
        }
    }

    pub fn new(name: &str, config: &ProviderConfig, now: UnixMs) -> Result<Self, String> {
        let secrets = Self::read_secrets(name, config)?;
        let (rules, client) = Self::settings(name, config, &secrets)?;
        Ok(ProviderRuntime {
            token: Self::token_source(config, &secrets),
            secrets,
            name: name.to_owned(),
            rules,
            client,
            concurrency: match config.concurrency_scope {
                ConcurrencyScope::Node => Arc::new(Semaphore::new(config.concurrency as usize)),
                ConcurrencyScope::Cluster => super::permits::cluster_semaphore(),
            },
            cluster: Arc::new(ClusterLimits::new(
                &config.rate_limits,
                (config.concurrency_scope == ConcurrencyScope::Cluster)
                    .then_some(config.concurrency),
                lapse_ms(config),
            )),
            limiter: Arc::default(),
            breaker: Arc::new(Mutex::new(Breaker::new(config.breaker.policy(), now))),
            budget: Arc::new(Mutex::new(RetryBudget::new(
                config.retry.budget,
                config.retry.budget_floor,
                now,
            ))),
            paused: Arc::default(),
            published_throttle: Arc::default(),
            calls: Arc::default(),
            base: reqwest::Url::parse(&config.base_url).ok(),
            config: config.clone(),
            in_process: None,
        })
    }

    /// The same provider with new settings (a configuration reload): its
    /// state goes on (breaker, budget, pause, "slow down", calls in flight,
    /// grants and slots, a token still valid for unchanged credentials),
    /// retuned to the new limits. Calls already made keep `self`'s
    /// settings to their end. A cap's scope (node or cluster) changes
    /// only at a restart. (`Engine::reconfigure` makes the two steps apart,
    /// every provider's `prepare` before any `retuned`.)
    #[cfg(test)]
    pub fn reconfigured(&self, config: &ProviderConfig, now: UnixMs) -> Result<Self, String> {
        let secrets = Self::read_secrets(&self.name, config)?;
        Ok(self.retuned(self.prepare(config, secrets)?, now))
    }

    /// The fallible part of [`reconfigured`](Self::reconfigured): the new
    /// settings (with `secrets`, as read) checked and built, nothing of the
    /// running state touched.
    pub fn prepare(
        &self,
        config: &ProviderConfig,
        secrets: ProviderSecrets,
    ) -> Result<Prepared, String> {
        let name = &self.name;
        if config.concurrency_scope != self.config.concurrency_scope {
            return Err(format!(
                "provider {name}: `concurrency_scope` changes only at a restart"
            ));
        }
        let (rules, client) = Self::settings(name, config, &secrets)?;
        // A token stays valid for the same credentials asked the same way.
        let same = |c: &ProviderConfig| super::fingerprint(&(&c.oauth2, c.timeout));
        let token = if same(config) == same(&self.config) && secrets.same_client(&self.secrets) {
            self.token.clone()
        } else {
            Self::token_source(config, &secrets)
        };
        Ok(Prepared {
            config: config.clone(),
            rules,
            client,
            token,
            secrets,
        })
    }

    /// The infallible part of [`reconfigured`](Self::reconfigured): the
    /// state retuned to `new`'s limits, and the runtime that calls from
    /// now on use.
    pub fn retuned(&self, new: Prepared, now: UnixMs) -> Self {
        let Prepared {
            config,
            rules,
            client,
            token,
            secrets,
        } = new;
        let config = &config;
        let name = &self.name;
        let (old, new) = (self.config.concurrency, config.concurrency);
        if config.concurrency_scope == ConcurrencyScope::Node && old != new {
            let sem = self.concurrency.clone();
            if new > old {
                sem.add_permits((new - old) as usize);
            } else {
                // Free slots go now; the rest as the calls holding them end.
                let fewer = (old - new) as usize;
                let owed = fewer - sem.forget_permits(fewer);
                if owed > 0 {
                    tokio::spawn(async move {
                        if let Ok(p) = sem.acquire_many_owned(owed as u32).await {
                            p.forget();
                        }
                    });
                }
            }
        }
        let cap = (config.concurrency_scope == ConcurrencyScope::Cluster).then_some(new);
        self.cluster
            .reconfigure(&config.rate_limits, cap, lapse_ms(config));
        lock(&self.breaker).set_policy(config.breaker.policy());
        lock(&self.budget).retune(config.retry.budget, config.retry.budget_floor, now);
        ProviderRuntime {
            name: name.clone(),
            config: config.clone(),
            rules,
            client,
            concurrency: self.concurrency.clone(),
            cluster: self.cluster.clone(),
            limiter: self.limiter.clone(),
            breaker: self.breaker.clone(),
            budget: self.budget.clone(),
            paused: self.paused.clone(),
            published_throttle: self.published_throttle.clone(),
            calls: self.calls.clone(),
            base: reqwest::Url::parse(&config.base_url).ok(),
            in_process: self.in_process.clone(),
            token,
            secrets,
        }
    }

    /// What a provider's settings make: its reply rules and HTTP client.
    fn settings(
        name: &str,
        config: &ProviderConfig,
        secrets: &ProviderSecrets,
    ) -> Result<(Vec<Rule>, reqwest::Client), String> {
        let rules = config.compile_rules(name).map_err(|e| e.to_string())?;
        let cannot = |e: reqwest::Error| format!("provider {name}: cannot build HTTP client: {e}");
        // A private CA trusted instead of the built-in roots; a client
        // certificate (mutual TLS). Both checked when read.
        let identity = secrets.tls_identity.as_ref().map(|s| s.expose());
        let builder = crate::config::provider::tls_builder(secrets.tls_roots.as_deref(), identity)
            .map_err(cannot)?;
        let client = builder
            .connect_timeout(config.connect_timeout.0)
            .user_agent(concat!("ballast/", env!("CARGO_PKG_VERSION")))
            .pool_max_idle_per_host(config.concurrency as usize)
            // A redirect is a reply, never followed behind the rules' back
            // (a 302 to a POST would become a GET of another URL, whose
            // answer would be taken for the call's): see `http::exchange`.
            .redirect(reqwest::redirect::Policy::none())
            .build()
            .map_err(cannot)?;
        Ok((rules, client))
    }

    /// The provider's OAuth2 token source, when it uses one.
    fn token_source(
        config: &ProviderConfig,
        secrets: &ProviderSecrets,
    ) -> Option<Arc<super::token::TokenSource>> {
        let (o, client) = (config.oauth2.as_ref()?, secrets.client.clone()?);
        Some(Arc::new(super::token::TokenSource::new(
            o,
            client,
            config.timeout.0,
        )))
    }

    /// The provider's secrets read from their variables and files now.
    pub fn read_secrets(name: &str, config: &ProviderConfig) -> Result<ProviderSecrets, String> {
        config
            .read_secrets(&|v| std::env::var(v).ok())
            .map_err(|(field, m)| format!("provider {name}: `{field}`: {m}"))
    }

    /// Notes a pause to publish; false when one lasting as long or longer
    /// was published already (a storm of 429s costs one write per longer
    /// pause, not one per reply).
    pub fn note_throttle(&self, until: UnixMs) -> bool {
        use std::sync::atomic::Ordering;
        self.published_throttle.fetch_max(until, Ordering::Relaxed) < until
    }

    pub fn limiter(&self) -> MutexGuard<'_, Limiter> {
        lock(&self.limiter)
    }

    pub fn breaker(&self) -> MutexGuard<'_, Breaker> {
        lock(&self.breaker)
    }

    pub fn budget(&self) -> MutexGuard<'_, RetryBudget> {
        lock(&self.budget)
    }

    pub fn is_paused(&self) -> bool {
        *lock(&self.paused)
    }

    pub fn set_paused(&self, paused: bool) {
        *lock(&self.paused) = paused;
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn provider(extra: &str) -> ProviderConfig {
        let text = format!(
            "[providers.p]\nbase_url = \"http://127.0.0.1:9\"\nconcurrency_scope = \"node\"\n{extra}\n"
        );
        let config = crate::config::Config::parse(&text, std::path::Path::new("t.toml")).unwrap();
        config.providers["p"].clone()
    }

    /// A reload's runtime calls under its own base URL (parsed again with
    /// it) and keeps counting into the same metric handles.
    #[test]
    fn a_reload_calls_under_the_new_base_url_with_the_same_handles() {
        let with_base = |base: &str| {
            let text = format!("[providers.p]\nbase_url = \"{base}\"\n");
            let config =
                crate::config::Config::parse(&text, std::path::Path::new("t.toml")).unwrap();
            config.providers["p"].clone()
        };
        let rt = ProviderRuntime::new("p", &with_base("http://a.example/v1"), 0).unwrap();
        assert_eq!(rt.call_url("/x").unwrap().as_str(), "http://a.example/v1/x");
        let moved = rt
            .reconfigured(&with_base("https://b.example/v2/"), 0)
            .unwrap();
        assert_eq!(
            moved.call_url("x").unwrap().as_str(),
            "https://b.example/v2/x"
        );
        assert!(
            moved.call_url("/../v1/x").is_err(),
            "not under the new base"
        );
        assert!(Arc::ptr_eq(&moved.calls, &rt.calls));
    }

    /// A node's cap retuned under calls in flight: fewer slots take the
    /// free ones now and the busy ones as their calls end; more are there
    /// at once; the state is the same one; a scope change is refused.
    #[tokio::test]
    async fn a_smaller_cap_waits_for_calls_in_flight_and_a_larger_one_is_there_now() {
        let rt = ProviderRuntime::new("p", &provider("concurrency = 4"), 0).unwrap();
        let mut held: Vec<_> = (0..3)
            .map(|_| rt.concurrency.clone().try_acquire_owned().unwrap())
            .collect();
        let two = rt.reconfigured(&provider("concurrency = 2"), 0).unwrap();
        assert!(Arc::ptr_eq(&two.concurrency, &rt.concurrency));
        assert_eq!(rt.concurrency.available_permits(), 0, "the free one went");
        // One of the three calls ends: its slot is taken away too.
        drop(held.pop());
        tokio::task::yield_now().await;
        tokio::task::yield_now().await;
        assert_eq!(rt.concurrency.available_permits(), 0, "2 in flight, cap 2");
        drop(held.pop());
        tokio::task::yield_now().await;
        assert_eq!(rt.concurrency.available_permits(), 1, "1 in flight, cap 2");
        let five = two.reconfigured(&provider("concurrency = 5"), 0).unwrap();
        assert_eq!(
            five.concurrency.available_permits(),
            4,
            "1 in flight, cap 5"
        );
        rt.set_paused(true);
        assert!(five.is_paused(), "one state");
        let mut cluster = provider("concurrency = 5");
        cluster.concurrency_scope = ConcurrencyScope::Cluster;
        let scope = five.reconfigured(&cluster, 0);
        assert!(scope.err().unwrap().contains("changes only at a restart"));
    }

    #[test]
    fn a_pause_holds_calls_until_it_ends() {
        let mut l = Limiter::default();
        assert_eq!(l.try_acquire(0), Ok(()));
        l.pause_until(5_000);
        l.pause_until(2_000);
        assert_eq!(l.try_acquire(1), Err(5_000), "the later pause wins");
        assert_eq!(l.try_acquire(5_000), Ok(()));
        assert_eq!(l.in_flight(), 2);
        l.complete();
        assert_eq!(l.in_flight(), 1);
    }
}
