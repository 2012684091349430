//! Redirects, decided purely: whether an exchange may follow one (a job
//! poll's `GET`, as its provider allows, within the provider's own base URL)
//! and how a redirect's target is shown in the attempt history (without
//! the credentials a URL may carry).

use reqwest::Url;

/// Which redirects a call may follow: at most `max`, each to a URL under
/// `within` (the provider's base URL: same scheme, host, port and path
/// prefix).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Follow {
    pub max: u8,
    pub within: String,
}

/// The next URL of an exchange, when `status` and `location` (the raw
/// `Location` header) make a redirect the call may follow: a 301, 302,
/// 303, 307 or 308 (not 304 "not modified" nor 300 or 305), fewer than
/// `follow.max` followed so far (`done`), to a URL under `follow.within`
/// with no user or password in it.
pub fn next_hop(
    current: &str,
    status: u16,
    location: Option<&[u8]>,
    done: usize,
    follow: Option<&Follow>,
) -> Option<Url> {
    let follow = follow?;
    if !crate::domain::rules::is_redirect(status) || done >= usize::from(follow.max) {
        return None;
    }
    let location = std::str::from_utf8(location?).ok()?;
    let next = Url::parse(current).ok()?.join(location).ok()?;
    let within = Url::parse(&follow.within).ok()?;
    let bare = next.username().is_empty() && next.password().is_none();
    (bare && under(&next, &within)).then_some(next)
}

/// Whether `url` is under `base`: the same scheme, host and port, and a
/// path at or below the base's path (`/v1/t/7` is under `/v1/t`,
/// `/v1/tx` and `/v1/admin` are not). `url` is parsed, so `..` and
/// `%2e%2e` segments are already resolved.
pub fn under(url: &Url, base: &Url) -> bool {
    let prefix = base.path().trim_end_matches('/');
    let below = url.path() == prefix || url.path().starts_with(&format!("{prefix}/"));
    below
        && url.scheme() == base.scheme()
        && url.host() == base.host()
        && url.port_or_known_default() == base.port_or_known_default()
}

/// The URL of a call to `path` (as rendered) on the provider at `base_url`,
/// if it stays under it; otherwise why not (the base's credentials go only
/// where the base points).
pub fn call_url(base_url: &str, path: &str) -> Result<Url, String> {
    let base = Url::parse(base_url).map_err(|e| format!("base_url is not a URL: {e}"))?;
    call_url_under(&base, base_url, path)
}

/// [`call_url`] with the base already parsed (`base` is `base_url`'s).
pub fn call_url_under(base: &Url, base_url: &str, path: &str) -> Result<Url, String> {
    let joined = match path.strip_prefix('/') {
        Some(_) => format!("{}{path}", base_url.trim_end_matches('/')),
        None => format!("{}/{path}", base_url.trim_end_matches('/')),
    };
    let url = Url::parse(&joined).map_err(|e| format!("the path does not make a URL: {e}"))?;
    if under(&url, base) {
        Ok(url)
    } else {
        let to = shown(base_url, joined.as_bytes());
        Err(format!(
            "the path leaves the provider's base URL (it reaches {to})"
        ))
    }
}

/// How a redirect's target is kept in the history: resolved against the
/// URL it answered, without user, password or query (a presigned link's
/// signature lives there; `?…` says there was one), at most 300 bytes.
pub fn shown(current: &str, location: &[u8]) -> String {
    let raw = String::from_utf8_lossy(location);
    let text = match Url::parse(current).and_then(|u| u.join(&raw)) {
        Ok(u) => {
            let port = u.port().map(|p| format!(":{p}")).unwrap_or_default();
            let host = u.host_str().unwrap_or("");
            let query = if u.query().is_some() { "?…" } else { "" };
            format!("{}://{host}{port}{}{query}", u.scheme(), u.path())
        }
        Err(_) => match raw.split_once('?') {
            Some((before, _)) => format!("{before}?… (not a URL)"),
            None => format!("{raw} (not a URL)"),
        },
    };
    crate::domain::excerpt(&text, 300).to_owned()
}

#[cfg(test)]
mod tests {
    use super::*;

    const HERE: &str = "https://api.example.com/v2/jobs/7";

    fn hop(location: &str, status: u16, done: usize) -> Option<String> {
        let follow = Follow {
            max: 2,
            within: "https://api.example.com/v2".into(),
        };
        next_hop(HERE, status, Some(location.as_bytes()), done, Some(&follow))
            .map(|u| u.to_string())
    }

    #[test]
    fn a_call_stays_under_its_base_path() {
        let base = "http://p.example/v1/t/7";
        let ok = |path: &str| call_url(base, path).map(|u| u.to_string());
        assert_eq!(
            ok("/jobs/1").as_deref(),
            Ok("http://p.example/v1/t/7/jobs/1")
        );
        assert_eq!(
            ok("jobs?a=1").as_deref(),
            Ok("http://p.example/v1/t/7/jobs?a=1")
        );
        assert_eq!(ok("").as_deref(), Ok("http://p.example/v1/t/7/"));
        assert_eq!(ok("/a/../b").as_deref(), Ok("http://p.example/v1/t/7/b"));
        for escape in [
            "/../../admin",
            "/jobs/../../../admin",
            "/%2e%2e/%2E%2e/admin",
            "/..",
        ] {
            let e = ok(escape).unwrap_err();
            assert!(
                e.contains("leaves the provider's base URL"),
                "{escape}: {e}"
            );
        }
        assert!(
            ok("/jobs/..%2F..%2Fadmin").is_ok(),
            "an encoded slash is one segment"
        );
        assert!(ok("@evil.example/x").is_ok_and(|u| u.starts_with("http://p.example/v1/t/7/")));
        let with_user = "https://u:pw@p.example/v1";
        let url = call_url(with_user, "/x").unwrap();
        assert_eq!(url.path(), "/v1/x");
        let e = call_url(with_user, "/../admin").unwrap_err();
        assert!(!e.contains("pw"), "the base's password is not said: {e}");
    }

    #[test]
    fn follows_within_the_base_url_only() {
        assert_eq!(
            hop("/v2/jobs/7/result", 302, 0).as_deref(),
            Some("https://api.example.com/v2/jobs/7/result")
        );
        assert_eq!(
            hop("result", 303, 1).as_deref(),
            Some("https://api.example.com/v2/jobs/result")
        );
        assert_eq!(
            hop("https://api.example.com:443/v2/x", 307, 0).as_deref(),
            Some("https://api.example.com/v2/x"),
            "the default port is the same port"
        );
        for other in [
            "/v3/jobs/7",
            "/v2x/jobs",
            "//evil.example/v2/x",
            "\\\\evil.example/v2/x",
            "https://api.example.com@evil.example/v2/x",
            "https://user:pass@api.example.com/v2/x",
            "http://api.example.com/v2/x",
            "https://api.example.com:8443/v2/x",
            "https://other.example.com/v2/x",
        ] {
            assert_eq!(hop(other, 302, 0), None, "{other}");
        }
    }

    #[test]
    fn only_redirect_codes_within_the_bound() {
        assert_eq!(hop("/v2/a", 302, 2), None, "the bound");
        for status in [300, 304, 305, 200, 404] {
            assert_eq!(hop("/v2/a", status, 0), None, "{status}");
        }
        for status in [301, 302, 303, 307, 308] {
            assert!(hop("/v2/a", status, 0).is_some(), "{status}");
        }
        assert_eq!(next_hop(HERE, 302, Some(b"/v2/a"), 0, None), None);
        assert_eq!(next_hop(HERE, 302, Some(b"/v2/\xff"), 0, None), None);
        let follow = Follow {
            max: 1,
            within: "https://api.example.com/v2".into(),
        };
        assert_eq!(next_hop(HERE, 302, None, 0, Some(&follow)), None);
    }

    #[test]
    fn targets_are_shown_without_credentials() {
        assert_eq!(
            shown(HERE, b"https://u:p@cdn.example/f.mp4?X-Amz-Signature=abc"),
            "https://cdn.example/f.mp4?…"
        );
        assert_eq!(
            shown(HERE, b"/v2/jobs/7/result"),
            "https://api.example.com/v2/jobs/7/result"
        );
        assert_eq!(shown(HERE, b"http://h:8080/x"), "http://h:8080/x");
        assert!(shown(HERE, "x".repeat(5_000).as_bytes()).len() <= 300);
    }
}
