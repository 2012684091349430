//! The simulator's OAuth2 client credentials (RFC 6749 §4.4): the token
//! endpoint, the tokens it issued and when they die, its outages, and the
//! bearer check in front of every `/v1/*` route.

use std::collections::HashMap;
use std::sync::Arc;

use axum::Json;
use axum::body::Bytes;
use axum::extract::State;
use axum::http::{HeaderMap, HeaderValue, StatusCode, header};
use axum::response::{IntoResponse, Response};
use serde_json::{Value, json};
use subtle::ConstantTimeEq;

use super::{Sim, SimOAuth2};
use crate::domain::UnixMs;

/// The tokens issued and the token endpoint's state.
#[derive(Debug, Default)]
pub(super) struct Tokens {
    /// Each token not yet pruned, and when it dies by the simulator's clock.
    live: HashMap<String, UnixMs>,
    /// The token endpoint answers 503 until then.
    outage_until: Option<UnixMs>,
    pub(super) issued: u64,
    /// 401s sent for a missing, unknown or expired token.
    pub(super) unauthorized: u64,
}

/// Why the token endpoint refuses a request.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Refusal {
    UnsupportedGrantType,
    InvalidClient,
}

/// Decides a token request from its `Authorization` header (if any) and
/// its form: the requested scope when the grant is allowed. The client
/// authenticates with HTTP Basic when it sends that header, else with the
/// form's `client_id` and `client_secret` (RFC 6749 §2.3.1).
fn grant(
    oauth: &SimOAuth2,
    authorization: Option<&str>,
    form: &HashMap<String, String>,
) -> Result<Option<String>, Refusal> {
    if form.get("grant_type").map(String::as_str) != Some("client_credentials") {
        return Err(Refusal::UnsupportedGrantType);
    }
    let (id, secret) = match authorization {
        Some(value) => basic_credentials(value).ok_or(Refusal::InvalidClient)?,
        None => match (form.get("client_id"), form.get("client_secret")) {
            (Some(id), Some(secret)) => (id.clone(), secret.clone()),
            _ => return Err(Refusal::InvalidClient),
        },
    };
    // Both compared whole, so a wrong id costs what a wrong secret does.
    let id_ok = id.as_bytes().ct_eq(oauth.client_id.as_bytes());
    let secret_ok = secret.as_bytes().ct_eq(oauth.client_secret.as_bytes());
    if bool::from(id_ok & secret_ok) {
        Ok(form.get("scope").cloned())
    } else {
        Err(Refusal::InvalidClient)
    }
}

/// `Basic base64(urlencode(id):urlencode(secret))` as (id, secret).
fn basic_credentials(value: &str) -> Option<(String, String)> {
    let (scheme, encoded) = value.trim().split_once(' ')?;
    if !scheme.eq_ignore_ascii_case("basic") {
        return None;
    }
    let decoded = String::from_utf8(base64_decode(encoded.trim())?).ok()?;
    let (id, secret) = decoded.split_once(':')?;
    Some((form_decode(id)?, form_decode(secret)?))
}

/// Standard base64 (RFC 4648 §4), padding optional.
fn base64_decode(text: &str) -> Option<Vec<u8>> {
    let text = text.trim_end_matches('=');
    // One letter left over carries 6 bits: not even one byte.
    if text.len() % 4 == 1 {
        return None;
    }
    let mut out = Vec::with_capacity(text.len() * 3 / 4);
    let (mut acc, mut bits) = (0u32, 0u32);
    for c in text.bytes() {
        let v = match c {
            b'A'..=b'Z' => c - b'A',
            b'a'..=b'z' => c - b'a' + 26,
            b'0'..=b'9' => c - b'0' + 52,
            b'+' => 62,
            b'/' => 63,
            _ => return None,
        };
        acc = (acc << 6) | u32::from(v);
        bits += 6;
        if bits >= 8 {
            bits -= 8;
            out.push(((acc >> bits) & 0xff) as u8);
            acc &= (1 << bits) - 1;
        }
    }
    Some(out)
}

/// Decodes one `application/x-www-form-urlencoded` value: `+` is a
/// space, `%XX` a byte, and the bytes must be UTF-8.
fn form_decode(text: &str) -> Option<String> {
    let b = text.as_bytes();
    let mut out = Vec::with_capacity(b.len());
    let mut i = 0;
    while i < b.len() {
        match b[i] {
            b'+' => out.push(b' '),
            b'%' => {
                let hex = b.get(i + 1..i + 3)?;
                if !hex.iter().all(u8::is_ascii_hexdigit) {
                    return None;
                }
                out.push(u8::from_str_radix(std::str::from_utf8(hex).ok()?, 16).ok()?);
                i += 2;
            }
            c => out.push(c),
        }
        i += 1;
    }
    String::from_utf8(out).ok()
}

/// The token of an `Authorization: Bearer <token>` header.
fn bearer_token(headers: &HeaderMap) -> Option<&str> {
    let value = headers.get(header::AUTHORIZATION)?.to_str().ok()?;
    let (scheme, token) = value.trim().split_once(' ')?;
    scheme
        .eq_ignore_ascii_case("bearer")
        .then(|| token.trim())
        .filter(|t| !t.is_empty())
}

/// A `/v1/*` request without a live token: answered 401 `invalid_token`.
#[derive(Debug)]
pub(super) struct Unauthorized;

impl IntoResponse for Unauthorized {
    fn into_response(self) -> Response {
        let mut resp = error(StatusCode::UNAUTHORIZED, "invalid_token");
        resp.headers_mut().insert(
            header::WWW_AUTHENTICATE,
            HeaderValue::from_static("Bearer error=\"invalid_token\""),
        );
        resp
    }
}

fn error(status: StatusCode, code: &str) -> Response {
    (status, Json(json!({ "error": code }))).into_response()
}

impl Sim {
    /// Lets a `/v1/*` request through when OAuth2 is off or it carries a
    /// token this simulator issued that has not died; else counts the 401.
    pub(super) fn authorize(&self, headers: &HeaderMap) -> Result<(), Unauthorized> {
        if self.profile.oauth2.is_none() {
            return Ok(());
        }
        let now = self.clock.now_ms();
        let mut tokens = Self::lock(&self.tokens);
        let live = bearer_token(headers)
            .and_then(|t| tokens.live.get(t))
            .is_some_and(|dies| now < *dies);
        if live {
            return Ok(());
        }
        tokens.unauthorized += 1;
        Err(Unauthorized)
    }

    pub(super) fn set_token_outage(&self, for_ms: u64) {
        let until = self.clock.now_ms() + i64::try_from(for_ms).unwrap_or(i64::MAX / 2);
        Self::lock(&self.tokens).outage_until = Some(until);
    }
}

/// `POST /oauth/token`: a bearer token for good client credentials.
pub(super) async fn token(
    State(sim): State<Arc<Sim>>,
    headers: HeaderMap,
    body: Bytes,
) -> Response {
    let Some(oauth) = sim.profile.oauth2.as_ref() else {
        return error(StatusCode::NOT_FOUND, "oauth2 is off");
    };
    let now = sim.clock.now_ms();
    if Sim::lock(&sim.tokens)
        .outage_until
        .is_some_and(|until| now < until)
    {
        return error(StatusCode::SERVICE_UNAVAILABLE, "temporarily_unavailable");
    }
    let form: HashMap<String, String> = form_urlencoded::parse(&body).into_owned().collect();
    let authorization = headers
        .get(header::AUTHORIZATION)
        .map(|v| v.to_str().unwrap_or(""));
    let scope = match grant(oauth, authorization, &form) {
        Ok(scope) => scope,
        Err(Refusal::UnsupportedGrantType) => {
            return error(StatusCode::BAD_REQUEST, "unsupported_grant_type");
        }
        Err(Refusal::InvalidClient) => {
            let mut resp = error(StatusCode::UNAUTHORIZED, "invalid_client");
            resp.headers_mut().insert(
                header::WWW_AUTHENTICATE,
                HeaderValue::from_static("Basic realm=\"sim\""),
            );
            return resp;
        }
    };
    let Ok(access_token) = crate::auth::secret::hex::<16>() else {
        return error(StatusCode::INTERNAL_SERVER_ERROR, "server_error");
    };
    {
        let mut tokens = Sim::lock(&sim.tokens);
        // Dead tokens are dropped as new ones come, so a long run holds
        // only the live ones.
        tokens.live.retain(|_, dies| now < *dies);
        let ttl = i64::try_from(oauth.ttl.as_millis()).unwrap_or(i64::MAX / 2);
        tokens.live.insert(access_token.clone(), now + ttl);
        tokens.issued += 1;
    }
    let mut body = json!({
        "access_token": access_token,
        "token_type": "Bearer",
        "expires_in": oauth.stated_ttl.as_secs(),
    });
    if let Some(scope) = scope {
        body["scope"] = Value::String(scope);
    }
    (
        StatusCode::OK,
        [(header::CACHE_CONTROL, "no-store")],
        Json(body),
    )
        .into_response()
}

/// `POST /_sim/token_outage {"for_ms": N}`: the token endpoint answers 503
/// for that long.
pub(super) async fn token_outage(State(sim): State<Arc<Sim>>, Json(body): Json<Value>) -> Response {
    if sim.profile.oauth2.is_none() {
        return error(StatusCode::NOT_FOUND, "oauth2 is off");
    }
    let for_ms = body.get("for_ms").and_then(Value::as_u64).unwrap_or(10_000);
    sim.set_token_outage(for_ms);
    StatusCode::NO_CONTENT.into_response()
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::sim::{Profile, SimHandle};

    fn oauth() -> SimOAuth2 {
        SimOAuth2::new("app", "s3cr:t é", std::time::Duration::from_secs(60))
    }

    fn form(pairs: &[(&str, &str)]) -> HashMap<String, String> {
        pairs
            .iter()
            .map(|(k, v)| ((*k).to_owned(), (*v).to_owned()))
            .collect()
    }

    /// Standard base64 with padding, for the tests' Basic headers.
    fn base64(bytes: &[u8]) -> String {
        const ABC: &[u8; 64] = b"ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz0123456789+/";
        let mut out = String::new();
        for chunk in bytes.chunks(3) {
            let n = chunk
                .iter()
                .enumerate()
                .fold(0u32, |n, (i, b)| n | u32::from(*b) << (16 - 8 * i));
            for i in 0..4 {
                if i <= chunk.len() {
                    out.push(char::from(ABC[(n >> (18 - 6 * i) & 63) as usize]));
                } else {
                    out.push('=');
                }
            }
        }
        out
    }

    #[test]
    fn base64_decodes_with_or_without_padding_and_refuses_junk() {
        for text in ["", "f", "fo", "foo", "foob", "fooba", "foobar", "\u{ff}\0x"] {
            let enc = base64(text.as_bytes());
            assert_eq!(base64_decode(&enc).as_deref(), Some(text.as_bytes()));
            let bare = enc.trim_end_matches('=');
            assert_eq!(base64_decode(bare).as_deref(), Some(text.as_bytes()));
        }
        assert_eq!(base64("foobar".as_bytes()), "Zm9vYmFy");
        assert_eq!(base64_decode("Zg"), Some(b"f".to_vec()));
        assert_eq!(base64_decode("Zm9v!"), None);
        assert_eq!(base64_decode("Zm9vY"), None);
    }

    #[test]
    fn form_values_decode_plus_and_percent() {
        assert_eq!(form_decode("s3cr%3At+%C3%A9").as_deref(), Some("s3cr:t é"));
        assert_eq!(form_decode("a%2"), None);
        assert_eq!(form_decode("a%+f"), None);
        assert_eq!(form_decode("%ff"), None, "not UTF-8");
    }

    #[test]
    fn basic_or_form_credentials_grant_and_wrong_ones_do_not() {
        let o = oauth();
        let grant_form = form(&[("grant_type", "client_credentials"), ("scope", "charge")]);
        let basic = format!("Basic {}", base64(b"app:s3cr%3At+%C3%A9"));
        assert_eq!(
            grant(&o, Some(&basic), &grant_form),
            Ok(Some("charge".into()))
        );
        let lower = format!("basic {}", base64(b"app:s3cr%3At%20%C3%A9"));
        assert_eq!(
            grant(&o, Some(&lower), &grant_form),
            Ok(Some("charge".into()))
        );
        let in_body = form(&[
            ("grant_type", "client_credentials"),
            ("client_id", "app"),
            ("client_secret", "s3cr:t é"),
        ]);
        assert_eq!(grant(&o, None, &in_body), Ok(None));

        let wrong = format!("Basic {}", base64(b"app:s3cr"));
        let refused = [
            grant(&o, Some(&wrong), &grant_form),
            grant(&o, Some("Basic !!"), &grant_form),
            grant(&o, Some("Bearer x"), &grant_form),
            grant(&o, None, &grant_form),
            grant(
                &o,
                None,
                &form(&[("grant_type", "client_credentials"), ("client_id", "app")]),
            ),
        ];
        for r in refused {
            assert_eq!(r, Err(Refusal::InvalidClient));
        }
        let password = form(&[("grant_type", "password"), ("client_id", "app")]);
        assert_eq!(
            grant(&o, Some(&basic), &password),
            Err(Refusal::UnsupportedGrantType)
        );
    }

    /// A simulator on a manual clock whose tokens last 60 s but are said
    /// to last 120 s, every good answer's body not UTF-8 (a fault that
    /// applies the effect, to show a refused call meets no chaos).
    async fn spawn() -> (SimHandle, crate::domain::ManualClock) {
        let clock = crate::domain::ManualClock::new(1_700_000_000_000);
        let mut oauth = SimOAuth2::new("app", "pw", std::time::Duration::from_secs(60));
        oauth.stated_ttl = std::time::Duration::from_secs(120);
        let profile = Profile {
            oauth2: Some(oauth),
            p_bad_utf8: 1.0,
            ..Profile::clean(1)
        };
        let sim = SimHandle::spawn_with_clock(profile, Arc::new(clock.clone()))
            .await
            .unwrap();
        (sim, clock)
    }

    async fn ask_token(
        sim: &SimHandle,
        authorization: Option<&str>,
        form: &str,
    ) -> reqwest::Response {
        let mut req = reqwest::Client::new()
            .post(format!("{}/oauth/token", sim.base_url()))
            .header("content-type", "application/x-www-form-urlencoded")
            .body(form.to_owned());
        if let Some(a) = authorization {
            req = req.header("authorization", a);
        }
        req.send().await.unwrap()
    }

    /// A token, asked for with the credentials in the form.
    async fn token_of(sim: &SimHandle) -> String {
        let resp = ask_token(
            sim,
            None,
            "grant_type=client_credentials&client_id=app&client_secret=pw",
        )
        .await;
        assert_eq!(resp.status().as_u16(), 200);
        let body: Value = resp.json().await.unwrap();
        body["access_token"].as_str().unwrap().to_owned()
    }

    async fn charge(sim: &SimHandle, token: Option<&str>) -> reqwest::Response {
        let mut req = reqwest::Client::new()
            .post(format!("{}/v1/charge", sim.base_url()))
            .json(&json!({ "ref": "r1" }));
        if let Some(t) = token {
            req = req.bearer_auth(t);
        }
        req.send().await.unwrap()
    }

    #[tokio::test]
    async fn the_token_endpoint_grants_by_basic_or_form_and_states_its_ttl() {
        let (sim, _clock) = spawn().await;
        let basic = format!("Basic {}", base64(b"app:pw"));
        let resp = ask_token(&sim, Some(&basic), "grant_type=client_credentials&scope=x").await;
        assert_eq!(resp.status().as_u16(), 200);
        let body: Value = resp.json().await.unwrap();
        let token = body["access_token"].as_str().unwrap();
        assert_eq!(token.len(), 32);
        assert!(token.bytes().all(|c| c.is_ascii_hexdigit()), "{token}");
        assert_eq!(body["token_type"], "Bearer");
        assert_eq!(body["expires_in"], 120, "the stated TTL, not the real one");
        assert_eq!(body["scope"], "x");
        assert_ne!(token_of(&sim).await, token);

        let wrong = format!("Basic {}", base64(b"app:nope"));
        let resp = ask_token(&sim, Some(&wrong), "grant_type=client_credentials").await;
        assert_eq!(resp.status().as_u16(), 401);
        let body: Value = resp.json().await.unwrap();
        assert_eq!(body["error"], "invalid_client");
        let resp = ask_token(&sim, None, "grant_type=client_credentials&client_id=app").await;
        assert_eq!(resp.status().as_u16(), 401);
        let resp = ask_token(&sim, Some(&basic), "grant_type=password").await;
        assert_eq!(resp.status().as_u16(), 400);
        let body: Value = resp.json().await.unwrap();
        assert_eq!(body["error"], "unsupported_grant_type");
        assert_eq!(sim.stats().tokens_issued, 2);
        sim.stop();
    }

    #[tokio::test]
    async fn v1_wants_a_live_token_before_any_chaos_and_refuses_without_effect() {
        let (sim, clock) = spawn().await;
        for token in [None, Some("not-one-of-ours")] {
            let resp = charge(&sim, token).await;
            assert_eq!(resp.status().as_u16(), 401, "{token:?}");
            let challenge = resp.headers()["www-authenticate"].to_str().unwrap();
            assert_eq!(challenge, "Bearer error=\"invalid_token\"");
            let body: Value = resp.json().await.unwrap();
            assert_eq!(body["error"], "invalid_token");
        }
        assert_eq!(sim.ledger().effects, 0);

        let token = token_of(&sim).await;
        clock.advance(59_999);
        let resp = charge(&sim, Some(&token)).await;
        // The profile's fault, once let in: a 200 that is not UTF-8.
        assert_eq!(resp.status().as_u16(), 200);
        assert!(std::str::from_utf8(&resp.bytes().await.unwrap()).is_err());
        assert_eq!(sim.ledger().effects, 1);

        // Dead at its real TTL, long before the stated one.
        clock.advance(1);
        assert_eq!(charge(&sim, Some(&token)).await.status().as_u16(), 401);
        let moved = reqwest::Client::new()
            .get(format!("{}/v1/moved/mv_1", sim.base_url()))
            .bearer_auth(&token)
            .send()
            .await
            .unwrap();
        assert_eq!(moved.status().as_u16(), 401, "the redirect's target too");
        assert_eq!(sim.ledger().effects, 1);
        let stats = sim.stats();
        assert_eq!((stats.tokens_issued, stats.unauthorized), (1, 4));
        // Every charge reached the provider and is listed, refused or not.
        let arrived: Vec<(String, bool)> = sim
            .arrivals()
            .into_iter()
            .map(|a| (a.fault, a.effect))
            .collect();
        let refused = || ("unauthorized".to_owned(), false);
        assert_eq!(
            arrived,
            [
                refused(),
                refused(),
                ("bad_utf8".to_owned(), true),
                refused()
            ]
        );
        sim.stop();
    }

    #[tokio::test]
    async fn a_token_outage_answers_503_until_it_ends() {
        let (sim, clock) = spawn().await;
        let resp = reqwest::Client::new()
            .post(format!("{}/_sim/token_outage", sim.base_url()))
            .json(&json!({ "for_ms": 5_000 }))
            .send()
            .await
            .unwrap();
        assert_eq!(resp.status().as_u16(), 204);
        let form = "grant_type=client_credentials&client_id=app&client_secret=pw";
        assert_eq!(ask_token(&sim, None, form).await.status().as_u16(), 503);
        clock.advance(5_000);
        assert_eq!(ask_token(&sim, None, form).await.status().as_u16(), 200);
        sim.token_outage(1_000);
        assert_eq!(ask_token(&sim, None, form).await.status().as_u16(), 503);
        clock.advance(1_000);
        assert_eq!(ask_token(&sim, None, form).await.status().as_u16(), 200);
        assert_eq!(sim.stats().tokens_issued, 2);
        sim.stop();
    }

    #[test]
    fn bearer_tokens_are_read_from_the_header() {
        let mut h = HeaderMap::new();
        assert_eq!(bearer_token(&h), None);
        h.insert(
            header::AUTHORIZATION,
            HeaderValue::from_static("bearer abc"),
        );
        assert_eq!(bearer_token(&h), Some("abc"));
        h.insert(header::AUTHORIZATION, HeaderValue::from_static("Basic abc"));
        assert_eq!(bearer_token(&h), None);
        h.insert(header::AUTHORIZATION, HeaderValue::from_static("Bearer "));
        assert_eq!(bearer_token(&h), None);
    }
}
