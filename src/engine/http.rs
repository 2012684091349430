//! One HTTP exchange with a provider, turned into a [`Reply`] whatever
//! happens: timeouts, resets, oversized or non-JSON bodies all become data.
//!
//! Every reply leaves here storable: the provider's credential (`secrets`;
//! providers sometimes echo the key they were sent) is replaced by
//! `[redacted]` in the whole body and error text before an excerpt is cut
//! from it, and NUL characters by U+FFFD (PostgreSQL stores none), so the
//! key reaches no output, job id, excerpt or log.

use std::time::Duration;

use tokio::time::Instant;

use futures_util::StreamExt;
use serde_json::Value;

use crate::config::provider::ContentEncoding;
use crate::domain::backoff::parse_retry_after;
use crate::domain::rules::{Reply, ReplyError};
use crate::domain::{Clock, EXCERPT_MAX_BYTES, excerpt, request};
use crate::pipeline::HttpMethod;

/// The longest `Retry-After` honoured.
pub const MAX_RETRY_AFTER: Duration = Duration::from_secs(3600);

/// A request ready to send.
#[derive(Debug, Clone)]
pub struct Call {
    pub method: HttpMethod,
    /// Parsed once, as built: the client sends it without parsing it again.
    pub url: reqwest::Url,
    /// Every header sent (`User-Agent`, `Accept`, `Content-Type` and
    /// `Accept-Encoding` included; the client adds only `Host`,
    /// `Content-Length` and the like), so the request the history keeps is
    /// the request that left.
    pub headers: Vec<(String, String)>,
    pub body: Option<String>,
    pub timeout: Duration,
    pub max_body: u64,
    /// The redirects this call may follow (a poll's `GET`, as its provider
    /// allows); `None` for every other call.
    pub follow: Option<super::redirect::Follow>,
    /// The `Content-Encoding`s this call's provider decodes.
    pub decode: Vec<ContentEncoding>,
}

/// Whether `headers` hold one named `name` (any case).
pub fn names(headers: &[(String, String)], name: &str) -> bool {
    headers.iter().any(|(k, _)| k.eq_ignore_ascii_case(name))
}

/// Whether a header `name: value` can be sent as the client would send it
/// (a value with CR, LF, NUL or another control character but tab cannot);
/// why not, naming the header but never its value.
pub fn header_ok(name: &str, value: &str) -> Result<(), String> {
    if reqwest::header::HeaderName::from_bytes(name.as_bytes()).is_err() {
        return Err(format!("`{name}` is not a header name"));
    }
    if reqwest::header::HeaderValue::from_bytes(value.as_bytes()).is_err() {
        return Err(format!(
            "header `{name}`'s value holds a character a header cannot carry (a line break or another control character)"
        ));
    }
    Ok(())
}

/// The host and port `url` names, without any user name or password:
/// where a call went, for a span.
pub fn host_port(url: &str) -> (&str, Option<u16>) {
    let rest = url.split_once("://").map_or(url, |(_, r)| r);
    let end = rest.find(['/', '?', '#']).unwrap_or(rest.len());
    let authority = &rest[..end];
    let authority = authority
        .rsplit_once('@')
        .map_or(authority, |(_, host)| host);
    match authority.rsplit_once(':') {
        Some((host, port)) if port.bytes().all(|b| b.is_ascii_digit()) => (host, port.parse().ok()),
        _ => (authority, None),
    }
}

/// What came back, with the evidence kept for the attempt history.
#[derive(Debug, Clone)]
pub struct Exchange {
    pub reply: Reply,
    pub http_status: Option<u16>,
    pub retry_after: Option<Duration>,
    pub took: Duration,
    /// The start of the body, or the transport error, for people.
    pub excerpt: String,
    /// The call's span (`call`; disabled with traces off): the attempt's
    /// verdict is recorded on it once judged.
    pub span: tracing::Span,
}

/// At most [`EXCERPT_MAX_BYTES`] of `text` once it is storable: secrets
/// and NUL characters replaced in the whole text first, so that a key
/// straddling the cut cannot leave its start behind.
fn storable_excerpt(text: &str, secrets: &[&str]) -> String {
    match crate::domain::storable_text(text, secrets) {
        Some(clean) => excerpt(&clean, EXCERPT_MAX_BYTES).to_owned(),
        None => excerpt(text, EXCERPT_MAX_BYTES).to_owned(),
    }
}

/// A provider that answers in-process, without a socket: benchmarks use it
/// to measure Ballast's own cost per record (like a job queue's no-op job).
pub trait InProcessProvider: Send + Sync + 'static {
    /// The HTTP status and JSON body the provider gives `call`.
    fn answer(&self, call: &Call) -> (u16, Value);
}

/// An [`InProcessProvider`] for [`EngineOptions`](super::EngineOptions).
#[derive(Clone)]
pub struct InProcess(pub std::sync::Arc<dyn InProcessProvider>);

impl std::fmt::Debug for InProcess {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("InProcess")
    }
}

/// [`exchange`] with an in-process provider.
pub fn exchange_in_process(
    provider: &dyn InProcessProvider,
    call: &Call,
    secrets: &[&str],
    clock: &dyn Clock,
) -> Exchange {
    let started = clock.instant();
    let (status, mut json) = provider.answer(call);
    crate::domain::scrub_json(&mut json, secrets);
    let text = json.to_string();
    Exchange {
        reply: Reply::Http {
            status,
            json: Some(json),
            body_error: None,
            retry_after: false,
        },
        http_status: Some(status),
        retry_after: None,
        took: clock.instant() - started,
        excerpt: excerpt(&text, EXCERPT_MAX_BYTES).to_owned(),
        span: tracing::Span::none(),
    }
}

/// Sends `call` and reads the reply, never failing: every outcome is a
/// [`Reply`], made storable (see the module's note) with `secrets`.
pub async fn exchange(
    client: &reqwest::Client,
    call: &Call,
    secrets: &[&str],
    clock: &dyn Clock,
) -> Exchange {
    let started = clock.instant();
    let mut sending = Sending {
        call,
        secrets,
        clock,
        started,
        // One deadline for the whole exchange, redirects and body included.
        deadline: started + call.timeout,
        hops: Vec::new(),
    };
    let resp = match sending.follow(client).await {
        Ok(sent) => sent,
        Err(failed) => return failed,
    };
    let head = Head::read(&resp, clock);
    let (body, body_error) = match sending.read_body(resp, &head).await {
        Ok(read) => read,
        Err(failed) => return failed,
    };
    let (body, body_error, not_decoded) = decoded(body, body_error, head.encoding.as_deref(), call);
    let (mut reply, mut excerpt) =
        read_reply(head.status, &body, body_error, call.max_body, secrets);
    if let Some(note) = not_decoded {
        excerpt = storable_excerpt(&format!("{}{excerpt}", self::excerpt(&note, 200)), secrets);
    }
    if let Reply::Http {
        retry_after: named, ..
    } = &mut reply
    {
        *named = head.retry_after.is_some();
    }
    Exchange {
        reply,
        http_status: Some(head.status),
        retry_after: head.retry_after,
        took: clock.instant() - started,
        excerpt: with_redirects(excerpt, head.location.as_deref(), &sending.hops, secrets),
        span: tracing::Span::none(),
    }
}

/// One exchange under way: what it sends, when it started, its one
/// deadline and the redirects it has followed.
struct Sending<'a> {
    call: &'a Call,
    secrets: &'a [&'a str],
    clock: &'a dyn Clock,
    started: Instant,
    deadline: Instant,
    /// Redirects followed (only where the call allows: a poll's GET, within
    /// its provider's base URL), each kept for the excerpt, failures too.
    hops: Vec<String>,
}

impl Sending<'_> {
    /// The exchange a transport failure `e` ends in, its message `msg` made
    /// storable and led by the redirects followed.
    fn failed(&self, e: ReplyError, msg: String) -> Exchange {
        Exchange {
            reply: Reply::Failed(e),
            http_status: None,
            retry_after: None,
            took: self.clock.instant() - self.started,
            excerpt: with_redirects(
                storable_excerpt(&msg, self.secrets),
                None,
                &self.hops,
                self.secrets,
            ),
            span: tracing::Span::none(),
        }
    }

    /// Sends the call, following the redirects it may: the response that
    /// is not followed (its URL the one it came from: the client itself
    /// follows none), or the failed exchange.
    async fn follow(&mut self, client: &reqwest::Client) -> Result<reqwest::Response, Exchange> {
        let call = self.call;
        let method = reqwest_method(call.method);
        let mut url = call.url.clone();
        loop {
            let mut req = client.request(method.clone(), url);
            for (k, v) in &call.headers {
                req = req.header(k, v);
            }
            if let Some(body) = &call.body {
                req = req.body(body.clone());
            }
            let resp = match tokio::time::timeout_at(self.deadline, req.send()).await {
                Err(_) => {
                    let msg = format!("no reply within {:?}", call.timeout);
                    return Err(self.failed(ReplyError::Timeout, msg));
                }
                Ok(Err(e)) => return Err(self.failed(classify_error(&e), request::error_chain(&e))),
                Ok(Ok(r)) => r,
            };
            let status = resp.status().as_u16();
            let location = resp
                .headers()
                .get(reqwest::header::LOCATION)
                .map(|v| v.as_bytes());
            let next = super::redirect::next_hop(
                resp.url().as_str(),
                status,
                location,
                self.hops.len(),
                call.follow.as_ref(),
            );
            match next {
                Some(next) => {
                    let to = super::redirect::shown(resp.url().as_str(), next.as_str().as_bytes());
                    self.hops.push(format!("{status} -> {to}"));
                    url = next;
                }
                None => return Ok(resp),
            }
        }
    }

    /// Reads the body within the deadline, up to the call's `max_body`: the
    /// bytes and whether they were cut there (`BodyTooLarge`), or the
    /// failed exchange when the body stalled or broke.
    async fn read_body(
        &self,
        resp: reqwest::Response,
        head: &Head,
    ) -> Result<(Vec<u8>, Option<ReplyError>), Exchange> {
        let mut body: Vec<u8> = Vec::new();
        let mut stream = resp.bytes_stream();
        loop {
            match tokio::time::timeout_at(self.deadline, stream.next()).await {
                Err(_) => {
                    let msg = format!("body not complete within {:?}", self.call.timeout);
                    let x = self.failed(ReplyError::Timeout, msg);
                    return Err(head.cut_short(x, ReplyError::Timeout));
                }
                Ok(None) => return Ok((body, None)),
                Ok(Some(Ok(chunk))) => {
                    if body.len() as u64 + chunk.len() as u64 > self.call.max_body {
                        return Ok((body, Some(ReplyError::BodyTooLarge)));
                    }
                    body.extend_from_slice(&chunk);
                }
                Ok(Some(Err(e))) => {
                    let mut x = self.failed(ReplyError::Reset, request::error_chain(&e));
                    x.excerpt = storable_excerpt(
                        &format!("{} [after: {}]", x.excerpt, String::from_utf8_lossy(&body)),
                        self.secrets,
                    );
                    return Err(head.cut_short(x, ReplyError::Reset));
                }
            }
        }
    }
}

/// The method `method` names, as the client spells it.
fn reqwest_method(method: HttpMethod) -> reqwest::Method {
    match method {
        HttpMethod::Get => reqwest::Method::GET,
        HttpMethod::Post => reqwest::Method::POST,
        HttpMethod::Put => reqwest::Method::PUT,
        HttpMethod::Patch => reqwest::Method::PATCH,
        HttpMethod::Delete => reqwest::Method::DELETE,
    }
}

/// What the final response's status and headers say, read before its body.
struct Head {
    status: u16,
    /// Where a redirect that was not followed pointed, as shown.
    location: Option<String>,
    retry_after: Option<Duration>,
    /// The `Content-Encoding`, lowercased; `None` when absent or `identity`.
    encoding: Option<String>,
}

impl Head {
    /// The status and headers of `resp` (a `Location` read against the
    /// URL it came from).
    fn read(resp: &reqwest::Response, clock: &dyn Clock) -> Head {
        let status = resp.status().as_u16();
        let location = crate::domain::rules::is_redirect(status)
            .then(|| resp.headers().get(reqwest::header::LOCATION))
            .flatten()
            .map(|v| super::redirect::shown(resp.url().as_str(), v.as_bytes()));
        let retry_after = resp
            .headers()
            .get(reqwest::header::RETRY_AFTER)
            .and_then(|v| v.to_str().ok())
            .and_then(|v| parse_retry_after(v, clock.now_system()))
            // Honoured, but bounded: a provider asking for years is asking for
            // an hour, and the step's deadline decides the rest.
            .map(|d| d.min(MAX_RETRY_AFTER));
        let encoding = resp
            .headers()
            .get(reqwest::header::CONTENT_ENCODING)
            .map(|v| {
                String::from_utf8_lossy(v.as_bytes())
                    .trim()
                    .to_ascii_lowercase()
            })
            .filter(|e| !e.is_empty() && e != "identity");
        Head {
            status,
            location,
            retry_after,
            encoding,
        }
    }

    /// The failed exchange `x` (its body stalled or broke with `e`) as this
    /// head makes it: with the status and Retry-After kept, and still a
    /// "slow down" reply when the head said so.
    fn cut_short(&self, mut x: Exchange, e: ReplyError) -> Exchange {
        // "Slow down" is said by the status and its Retry-After: a body that
        // then stalls or breaks does not make it a transport failure (which
        // would spend an attempt).
        let throttling = self.status == 429 || (self.status == 503 && self.retry_after.is_some());
        x.http_status = Some(self.status);
        x.retry_after = self.retry_after;
        if throttling {
            x.reply = Reply::Http {
                status: self.status,
                json: None,
                body_error: Some(e),
                retry_after: self.retry_after.is_some(),
            };
        }
        x
    }
}

/// The body as read, decoded when its `encoding` is gzip and the call
/// decodes gzip; otherwise (or when it was cut at `max_body`) the note the
/// excerpt leads with, that it was not decoded.
fn decoded(
    body: Vec<u8>,
    body_error: Option<ReplyError>,
    encoding: Option<&str>,
    call: &Call,
) -> (Vec<u8>, Option<ReplyError>, Option<String>) {
    let Some(enc) = encoding else {
        return (body, body_error, None);
    };
    let gzip = enc == "gzip" && call.decode.contains(&ContentEncoding::Gzip);
    // An empty body stays `body_empty`, and a body cut at `max_body`
    // is not decoded (the excerpt shows the bytes as they came).
    if gzip && body_error.is_none() && !body.is_empty() {
        let (body, body_error) = gunzip(&body, call.max_body);
        (body, body_error, None)
    } else if !gzip || body_error.is_some() {
        let note = format!("[Content-Encoding: {enc}, not decoded] ");
        (body, body_error, Some(note))
    } else {
        (body, body_error, None)
    }
}

/// The excerpt, led by the redirects followed and, for a redirect that was
/// not, where it pointed: the evidence of what the provider said.
fn with_redirects(
    body: String,
    location: Option<&str>,
    hops: &[String],
    secrets: &[&str],
) -> String {
    if location.is_none() && hops.is_empty() {
        return body;
    }
    let mut lead = String::new();
    if !hops.is_empty() {
        lead.push_str(&format!("[followed: {}] ", hops.join("; ")));
    }
    if let Some(to) = location {
        lead.push_str(&format!("[Location: {to}] "));
    }
    // The lead never crowds the body out of the excerpt.
    let lead = excerpt(&lead, 1_024);
    storable_excerpt(&format!("{lead}{body}"), secrets)
}

/// A gzip body (every member of it) decoded, at most `max` bytes of it:
/// more is cut there with `BodyTooLarge`, so a small reply that inflates to
/// gigabytes costs at most `max` bytes and a chunk of output (gzip's own
/// window is 32 KiB: the decoder holds no more); a stream that does not
/// decode is `BodyBadEncoding` (with what decoded before the fault).
pub fn gunzip(body: &[u8], max: u64) -> (Vec<u8>, Option<ReplyError>) {
    use std::io::Read;
    let max = usize::try_from(max).unwrap_or(usize::MAX);
    let mut decoder = flate2::read::MultiGzDecoder::new(body);
    let mut out = Vec::new();
    let mut chunk = [0u8; 32 * 1024];
    loop {
        match decoder.read(&mut chunk) {
            Ok(0) => return (out, None),
            Ok(n) if out.len() + n > max => {
                let keep = max - out.len();
                out.reserve_exact(keep);
                out.extend_from_slice(&chunk[..keep]);
                return (out, Some(ReplyError::BodyTooLarge));
            }
            Ok(n) => {
                out.reserve_exact(n);
                out.extend_from_slice(&chunk[..n]);
            }
            Err(e) if e.kind() == std::io::ErrorKind::Interrupted => {}
            Err(_) => return (out, Some(ReplyError::BodyBadEncoding)),
        }
    }
}

/// The reply a provider's status and body (as much of it as was read) make,
/// and its excerpt for the attempt history, both storable (see the module's
/// note). `body_error` is what went wrong while reading it (`BodyTooLarge`:
/// it was cut at `max_body`); otherwise an empty body is `BodyEmpty`, one
/// that is not UTF-8 `BodyNotUtf8`, and one that is not JSON
/// `BodyNotJson`. Any bytes at all give a reply: the fuzz tests
/// (`tests/it/fuzz.rs`) hold it to that.
pub fn read_reply(
    status: u16,
    body: &[u8],
    mut body_error: Option<ReplyError>,
    max_body: u64,
    secrets: &[&str],
) -> (Reply, String) {
    let mut json = if body_error.is_some() {
        None
    } else if body.is_empty() {
        body_error = Some(ReplyError::BodyEmpty);
        None
    } else if std::str::from_utf8(body).is_err() {
        body_error = Some(ReplyError::BodyNotUtf8);
        None
    } else {
        match serde_json::from_slice::<Value>(body) {
            Ok(v) => Some(v),
            Err(_) => {
                body_error = Some(ReplyError::BodyNotJson);
                None
            }
        }
    };
    if let Some(j) = json.as_mut() {
        crate::domain::scrub_json(j, secrets);
    }
    // The whole text is made storable before any cut (the raw text may
    // spell a key with JSON escapes: `redact` sees through them).
    let raw = String::from_utf8_lossy(body);
    let text = match crate::domain::storable_text(&raw, secrets) {
        Some(clean) => std::borrow::Cow::Owned(clean),
        None => raw,
    };
    let shown = match body_error {
        Some(ReplyError::BodyTooLarge) => format!(
            "body over {max_body} bytes; starts: {}",
            excerpt(&text, 512)
        ),
        Some(ReplyError::BodyEmpty) => "empty body".to_owned(),
        _ => text.into_owned(),
    };
    let reply = Reply::Http {
        status,
        json,
        body_error,
        retry_after: false,
    };
    (reply, excerpt(&shown, EXCERPT_MAX_BYTES).to_owned())
}

/// Maps a transport error to its class, by what caused it: the error's
/// own text names the URL, whose host or path may hold any word
/// (`https://mtls.bank.example/certificates`).
fn classify_error(e: &reqwest::Error) -> ReplyError {
    use std::error::Error;
    let causes = e.source().map(request::error_chain).unwrap_or_default();
    let causes = causes.to_ascii_lowercase();
    let tls = ["certificate", "tls", "handshake", "alert"];
    if e.is_timeout() {
        ReplyError::Timeout
    } else if tls.iter().any(|w| causes.contains(w)) {
        ReplyError::Tls
    } else if e.is_connect() {
        ReplyError::Connect
    } else {
        ReplyError::Reset
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::io::Write;

    fn gzip(data: &[u8]) -> Vec<u8> {
        let mut e = flate2::write::GzEncoder::new(Vec::new(), flate2::Compression::best());
        e.write_all(data).unwrap();
        e.finish().unwrap()
    }

    #[test]
    fn a_calls_host_and_port_leave_path_query_and_credentials_out() {
        for (url, host, port) in [
            (
                "https://api.example.com/v1/jobs?key=s3cret",
                "api.example.com",
                None,
            ),
            ("http://127.0.0.1:9000", "127.0.0.1", Some(9000)),
            ("http://user:pw@h.example:8443/x#f", "h.example", Some(8443)),
            ("https://h.example?q=1", "h.example", None),
            ("http://[::1]:8080/x", "[::1]", Some(8080)),
            ("http://[::1]/x", "[::1]", None),
            ("not a url", "not a url", None),
        ] {
            assert_eq!(host_port(url), (host, port), "{url}");
        }
    }

    #[test]
    fn gzip_bodies_decode_within_the_limit() {
        let json = br#"{"status": "succeeded"}"#;
        assert_eq!(gunzip(&gzip(json), 1_024), (json.to_vec(), None));
        // 64 MiB of zeros compress to about 64 KiB: decoding stops at the
        // limit, holding no more than it.
        let bomb = gzip(&vec![b'0'; 64 << 20]);
        assert!(bomb.len() < 200 << 10, "{} bytes", bomb.len());
        let (out, err) = gunzip(&bomb, 1 << 20);
        assert_eq!(err, Some(ReplyError::BodyTooLarge));
        assert_eq!(out.len(), 1 << 20);
        // A stream that breaks off, or is not gzip at all.
        let cut = gzip(&vec![b'x'; 10_000]);
        assert_eq!(
            gunzip(&cut[..cut.len() / 2], 1 << 20).1,
            Some(ReplyError::BodyBadEncoding)
        );
        assert_eq!(
            gunzip(b"plain text", 1 << 20).1,
            Some(ReplyError::BodyBadEncoding)
        );
        // Two members (some servers concatenate them) are one body.
        let two = [gzip(b"{\"a\": "), gzip(b"1}")].concat();
        assert_eq!(gunzip(&two, 1_024), (b"{\"a\": 1}".to_vec(), None));
        // The output never grows past the limit, whatever the stream.
        let (out, _) = gunzip(&bomb, 100_000);
        assert_eq!(out.len(), 100_000);
        assert!(out.capacity() <= 100_000 + 32 * 1024, "{}", out.capacity());
    }
}
