//! A provider's OAuth2 token on one node: fetched with the client
//! credentials grant, cached and shared by every call, renewed before it
//! expires and (once per refused token) on a `401`. One fetch at a time:
//! calls that need a token while it is being fetched wait for that fetch
//! rather than starting their own. A failing endpoint is left alone for a
//! growing pause (`domain::token::pause_after`), during which calls are
//! told at once to defer.
//!
//! The token is a secret: it lives here and in the request header only;
//! every reply and request kept is cleaned of it, and its `Debug` is
//! redacted.

use std::time::Duration;

use tokio::sync::Mutex;

use crate::config::Secret;
use crate::config::provider::{ClientAuth, OAuth2Config};
use crate::domain::token::{
    DEFAULT_LIFETIME, Grant, TokenError, parse_grant, pause_after, renew_at,
};
use crate::domain::{Clock, UnixMs};

/// The longest token endpoint reply read.
const MAX_TOKEN_REPLY: usize = 64 * 1024;

/// Why no token: the error, and until when calls should wait.
#[derive(Debug, Clone)]
pub struct NoToken {
    pub error: TokenError,
    pub until: UnixMs,
}

/// A token as held: the secret, whether the provider has taken it yet
/// (answered a call with it by anything but a `401`), when it is due for
/// renewal, and when it expires.
struct Held {
    token: Secret,
    accepted: bool,
    renew_at: UnixMs,
    expires_at: UnixMs,
}

#[derive(Default)]
struct State {
    token: Option<Held>,
    /// Failed fetches in a row.
    failures: u32,
    /// Tokens the provider refused before ever taking them, in a row
    /// (reset when it takes one).
    refusals: u32,
    failing: Option<NoToken>,
}

impl State {
    /// The token, if it has not expired at `now`.
    fn unexpired(&self, now: UnixMs) -> Option<Secret> {
        self.token
            .as_ref()
            .filter(|h| now < h.expires_at)
            .map(|h| h.token.clone())
    }

    /// Why there is no token at `now`, while the endpoint is left alone.
    fn failing_at(&self, now: UnixMs) -> Option<NoToken> {
        self.failing.clone().filter(|f| now < f.until)
    }
}

/// One provider's token on this node.
pub struct TokenSource {
    config: OAuth2Config,
    client_id: Secret,
    client_secret: Secret,
    timeout: Duration,
    /// Read and written in short sections, never across an await.
    state: std::sync::Mutex<State>,
    /// Held by the one fetch under way.
    fetching: Mutex<()>,
}

impl std::fmt::Debug for TokenSource {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("TokenSource")
            .field("token_url", &self.config.token_url)
            .finish_non_exhaustive()
    }
}

impl TokenSource {
    /// A token source for the client `(client_id, client_secret)` (the
    /// provider's secrets as read).
    pub fn new(
        config: &OAuth2Config,
        (client_id, client_secret): (Secret, Secret),
        timeout: Duration,
    ) -> TokenSource {
        TokenSource {
            config: config.clone(),
            client_id,
            client_secret,
            timeout,
            state: std::sync::Mutex::new(State::default()),
            fetching: Mutex::new(()),
        }
    }

    /// The header the token goes in.
    pub fn header(&self) -> &str {
        &self.config.header
    }

    fn state(&self) -> std::sync::MutexGuard<'_, State> {
        self.state
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner)
    }

    /// The current token, fetched first if there is none or it is due for
    /// renewal. While one call fetches, the others go on with the current
    /// token if it has not expired (else they wait for that fetch); a
    /// renewal that fails leaves it in use until it expires.
    pub async fn get(
        &self,
        client: &reqwest::Client,
        clock: &dyn Clock,
    ) -> Result<Secret, NoToken> {
        let usable = |s: &State, now: UnixMs| -> Option<Result<Secret, NoToken>> {
            if let Some(h) = s.token.as_ref().filter(|h| now < h.renew_at) {
                return Some(Ok(h.token.clone()));
            }
            s.failing_at(now).map(|f| s.unexpired(now).ok_or(f))
        };
        let now = clock.now_ms();
        let current = {
            let s = self.state();
            if let Some(r) = usable(&s, now) {
                return r;
            }
            s.unexpired(now)
        };
        let _fetch = match (self.fetching.try_lock(), current) {
            (Ok(g), _) => g,
            (Err(_), Some(t)) => return Ok(t),
            (Err(_), None) => self.fetching.lock().await,
        };
        // Another call may have fetched while this one waited.
        if let Some(r) = usable(&self.state(), clock.now_ms()) {
            return r;
        }
        let got = self.fetch(client, clock).await;
        got.or_else(|no| self.state().unexpired(clock.now_ms()).ok_or(no))
    }

    /// A token after `refused` was answered `401`: a new one, unless
    /// another call has renewed it since (then that one). When the
    /// provider keeps refusing tokens it never took (the second in a row,
    /// and on), the renewal waits 1 s, 2 s … 60 s (`token_refused`)
    /// instead, so a provider that takes none of this client's tokens does
    /// not get a token fetch per call.
    pub async fn renew(
        &self,
        refused: &Secret,
        client: &reqwest::Client,
        clock: &dyn Clock,
    ) -> Result<Secret, NoToken> {
        let _fetch = self.fetching.lock().await;
        {
            let now = clock.now_ms();
            let mut s = self.state();
            let same = s
                .token
                .as_ref()
                .is_some_and(|h| h.token.expose() == refused.expose());
            if !same {
                if let Some(t) = s.unexpired(now) {
                    return Ok(t);
                }
            }
            if let Some(no) = self.note_refusal(&mut s, refused, now) {
                return Err(no);
            }
            if let Some(f) = s.failing_at(now) {
                return Err(f);
            }
        }
        self.fetch(client, clock).await
    }

    /// A call with `token` was answered `401`: the token is dropped (if it
    /// is the one held) and counted, at once, so that no later call leaves
    /// with it; no other is asked for here (the call that was refused
    /// renews, and the others wait for that renewal, as
    /// [`get`](Self::get) and [`renew`](Self::renew) say).
    pub fn refused(&self, token: &Secret, clock: &dyn Clock) {
        let mut s = self.state();
        let _ = self.note_refusal(&mut s, token, clock.now_ms());
    }

    /// Drops `refused` if it is the held token, counting it when the
    /// provider never took it; past the first such refusal in a row, the
    /// token endpoint is left alone for a while (returned).
    fn note_refusal(&self, s: &mut State, refused: &Secret, now: UnixMs) -> Option<NoToken> {
        let held = s.token.take_if(|h| h.token.expose() == refused.expose())?;
        s.refusals = if held.accepted { 0 } else { s.refusals + 1 };
        if s.refusals < 2 {
            return None;
        }
        let pause = pause_after(s.refusals - 1);
        let error = TokenError::Refused(
            "the provider refused a token it had not taken before (401); asking again later".into(),
        );
        let no = NoToken {
            error,
            until: now + i64::try_from(pause.as_millis()).unwrap_or(60_000),
        };
        s.failing = Some(no.clone());
        Some(no)
    }

    /// A reply other than a `401` came to a call with `token`: the
    /// provider takes this client's tokens.
    pub fn accepted(&self, token: &Secret) {
        let mut s = self.state();
        if let Some(h) = s
            .token
            .as_mut()
            .filter(|h| h.token.expose() == token.expose())
        {
            h.accepted = true;
        }
        s.refusals = 0;
    }

    /// Fetches a token (the caller holds `fetching`) and keeps it.
    async fn fetch(&self, client: &reqwest::Client, clock: &dyn Clock) -> Result<Secret, NoToken> {
        let asked_at = clock.now_ms();
        let got = self.request(client, asked_at).await;
        let mut state = self.state();
        match got {
            Ok(grant) => {
                let renew_at = renew_at(&grant, asked_at, self.config.renew_before.0);
                let expires_at = grant
                    .expires_at
                    .unwrap_or(asked_at + DEFAULT_LIFETIME.as_millis() as i64);
                let token = Secret::new(grant.access_token);
                state.token = Some(Held {
                    token: token.clone(),
                    accepted: false,
                    renew_at,
                    expires_at,
                });
                state.failures = 0;
                state.failing = None;
                metrics::counter!("ballast_oauth2_tokens_total", "result" => "granted")
                    .increment(1);
                Ok(token)
            }
            Err(error) => {
                state.failures += 1;
                let pause = pause_after(state.failures);
                let until = clock.now_ms() + i64::try_from(pause.as_millis()).unwrap_or(60_000);
                tracing::warn!(
                    token_url = %self.config.token_url,
                    error.code = error.code(),
                    error.detail = error.detail(),
                    pause_ms = pause.as_millis() as u64,
                    "no OAuth2 token"
                );
                metrics::counter!("ballast_oauth2_tokens_total", "result" => error.code())
                    .increment(1);
                let no = NoToken { error, until };
                state.failing = Some(no.clone());
                Err(no)
            }
        }
    }

    /// One client-credentials request, its reply read within the timeout
    /// and [`MAX_TOKEN_REPLY`], every error cleaned of the client secret.
    async fn request(&self, client: &reqwest::Client, now: UnixMs) -> Result<Grant, TokenError> {
        let mut pairs: Vec<(&str, &str)> = vec![("grant_type", "client_credentials")];
        let scopes = self.config.scopes.join(" ");
        if !scopes.is_empty() {
            pairs.push(("scope", &scopes));
        }
        let mut req = client
            .post(&self.config.token_url)
            .header(reqwest::header::ACCEPT, "application/json");
        match self.config.client_auth {
            ClientAuth::Basic => {
                // RFC 6749 §2.3.1: each form-encoded, then HTTP Basic.
                let enc =
                    |s: &str| form_urlencoded::byte_serialize(s.as_bytes()).collect::<String>();
                req = req.basic_auth(
                    enc(self.client_id.expose()),
                    Some(enc(self.client_secret.expose())),
                );
            }
            ClientAuth::Body => {
                pairs.push(("client_id", self.client_id.expose()));
                pairs.push(("client_secret", self.client_secret.expose()));
            }
        }
        let form = form_urlencoded::Serializer::new(String::new())
            .extend_pairs(pairs)
            .finish();
        let req = req
            .header(
                reqwest::header::CONTENT_TYPE,
                "application/x-www-form-urlencoded",
            )
            .body(form);
        let secrets = [self.client_secret.expose()];
        let clean = |text: &str| {
            let text =
                crate::domain::storable_text(text, &secrets).unwrap_or_else(|| text.to_owned());
            crate::domain::excerpt(&text, 300).to_owned()
        };
        let exchange = async {
            let resp = req
                .send()
                .await
                .map_err(|e| TokenError::Down(clean(&e.to_string())))?;
            let status = resp.status().as_u16();
            let body = read_bounded(resp, MAX_TOKEN_REPLY)
                .await
                .map_err(|e| TokenError::Down(clean(&e)))?;
            Ok::<_, TokenError>((status, body))
        };
        let (status, body) = tokio::time::timeout(self.timeout, exchange)
            .await
            .map_err(|_| TokenError::Down(format!("no reply within {:?}", self.timeout)))??;
        let text = String::from_utf8_lossy(&body);
        // The excerpt of an error never shows a token granted in it.
        let shown = if (200..300).contains(&status) {
            String::new()
        } else {
            clean(&text)
        };
        parse_grant(status, &body, now, &shown)
    }
}

/// A reply's body, at most `max` bytes (the sign-on's calls read theirs
/// so too).
pub(crate) async fn read_bounded(resp: reqwest::Response, max: usize) -> Result<Vec<u8>, String> {
    use futures_util::StreamExt;
    let mut body = Vec::new();
    let mut stream = resp.bytes_stream();
    while let Some(chunk) = stream.next().await {
        let chunk = chunk.map_err(|e| e.to_string())?;
        if body.len() + chunk.len() > max {
            return Err(format!("reply over {max} bytes"));
        }
        body.extend_from_slice(&chunk);
    }
    Ok(body)
}
