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

#[derive(Default)]
struct State {
    /// The token, when it is due for renewal, and when it expires.
    token: Option<(Secret, UnixMs, UnixMs)>,
    failures: u32,
    failing: Option<NoToken>,
}

/// One provider's token on this node.
pub struct TokenSource {
    config: OAuth2Config,
    client_id: Secret,
    client_secret: Secret,
    timeout: Duration,
    state: Mutex<State>,
}

impl std::fmt::Debug for TokenSource {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("TokenSource")
            .field("token_url", &self.config.token_url)
            .finish_non_exhaustive()
    }
}

impl TokenSource {
    /// `None` when the environment lacks the client's id or secret (the
    /// configuration's validation says so first).
    pub fn new(
        config: &OAuth2Config,
        env: &dyn Fn(&str) -> Option<String>,
        timeout: Duration,
    ) -> Option<TokenSource> {
        Some(TokenSource {
            config: config.clone(),
            client_id: Secret::new(env(&config.client_id_env)?),
            client_secret: Secret::new(env(&config.client_secret_env)?),
            timeout,
            state: Mutex::new(State::default()),
        })
    }

    /// The header the token goes in.
    pub fn header(&self) -> &str {
        &self.config.header
    }

    /// The current token, fetched first if there is none or it is due for
    /// renewal. A renewal that fails leaves the old token in use until it
    /// expires.
    pub async fn get(
        &self,
        client: &reqwest::Client,
        clock: &dyn Clock,
    ) -> Result<Secret, NoToken> {
        let mut state = self.state.lock().await;
        let now = clock.now_ms();
        let unexpired = |s: &State, now: UnixMs| {
            s.token
                .as_ref()
                .filter(|(_, _, expires)| now < *expires)
                .map(|(t, _, _)| t.clone())
        };
        if let Some((token, renew, _)) = &state.token {
            if now < *renew {
                return Ok(token.clone());
            }
        }
        if let Some(f) = state.failing.clone() {
            if now < f.until {
                return unexpired(&state, now).ok_or(f);
            }
        }
        match self.fetch(&mut state, client, clock).await {
            Ok(t) => Ok(t),
            Err(no) => unexpired(&state, clock.now_ms()).ok_or(no),
        }
    }

    /// A token after `refused` was answered `401`: a new one, unless
    /// another call has renewed it since (then that one).
    pub async fn renew(
        &self,
        refused: &Secret,
        client: &reqwest::Client,
        clock: &dyn Clock,
    ) -> Result<Secret, NoToken> {
        let mut state = self.state.lock().await;
        if let Some((token, _, _)) = &state.token {
            if token.expose() != refused.expose() {
                return Ok(token.clone());
            }
        }
        state.token = None;
        if let Some(f) = &state.failing {
            if clock.now_ms() < f.until {
                return Err(f.clone());
            }
        }
        self.fetch(&mut state, client, clock).await
    }

    async fn fetch(
        &self,
        state: &mut State,
        client: &reqwest::Client,
        clock: &dyn Clock,
    ) -> Result<Secret, NoToken> {
        let asked_at = clock.now_ms();
        match self.request(client, asked_at).await {
            Ok(grant) => {
                let renew = renew_at(&grant, asked_at, self.config.renew_before.0);
                let expires = grant
                    .expires_at
                    .unwrap_or(asked_at + DEFAULT_LIFETIME.as_millis() as i64);
                let token = Secret::new(grant.access_token);
                state.token = Some((token.clone(), renew, expires));
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
            let body = read_bounded(resp)
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

/// A reply's body, at most [`MAX_TOKEN_REPLY`] bytes.
async fn read_bounded(resp: reqwest::Response) -> Result<Vec<u8>, String> {
    use futures_util::StreamExt;
    let mut body = Vec::new();
    let mut stream = resp.bytes_stream();
    while let Some(chunk) = stream.next().await {
        let chunk = chunk.map_err(|e| e.to_string())?;
        if body.len() + chunk.len() > MAX_TOKEN_REPLY {
            return Err(format!("token endpoint reply over {MAX_TOKEN_REPLY} bytes"));
        }
        body.extend_from_slice(&chunk);
    }
    Ok(body)
}
