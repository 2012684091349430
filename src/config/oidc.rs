//! `[oidc]`: single sign-on with OpenID Connect (`web::pages::sign_on`,
//! `web::oidc`). Read at start and at every reload (the client secret
//! too, from a variable or a file):
//!
//! ```toml
//! [oidc]
//! issuer = "https://id.example.com/realms/acme"
//! client_id = "ballast"
//! client_secret_file = "oidc-client-secret"
//! [[oidc.roles]]
//! group = "ballast-admins"
//! role = "admin"
//! [[oidc.roles]]
//! group = "support"
//! role = "viewer"
//! pipelines = ["lead-*"]
//! ```

use std::path::PathBuf;

use serde::Deserialize;

use super::secret::{SecretRef, SecretsDir};
use super::{ConfigError, Secret, ServerConfig, invalid};
use crate::domain::Role;
use crate::domain::scope::Scope;

/// The path the provider sends people back to.
pub const CALLBACK_PATH: &str = "/auth/oidc/callback";

/// `[oidc]`.
#[derive(Debug, Clone, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct OidcConfig {
    /// The provider's issuer URL, exactly as its discovery document and its
    /// ID tokens say it (`{issuer}/.well-known/openid-configuration`).
    pub issuer: String,
    pub client_id: String,
    /// The client's secret, from a variable or a file; none for a public
    /// client (PKCE alone).
    #[serde(default)]
    pub client_secret_env: Option<String>,
    #[serde(default)]
    pub client_secret_file: Option<PathBuf>,
    /// Where the provider sends people back: `<public_url>/auth/oidc/callback`
    /// unless set.
    #[serde(default)]
    pub redirect_url: Option<String>,
    /// Scopes asked for besides `openid`.
    #[serde(default = "default_scopes")]
    pub scopes: Vec<String>,
    /// The ID token claim listing the person's groups (a list of strings,
    /// or one string).
    #[serde(default = "default_groups_claim")]
    pub groups_claim: String,
    /// The ID token claim a new user's name is made from (`sub` when the
    /// token lacks it).
    #[serde(default = "default_username_claim")]
    pub username_claim: String,
    /// The sign-on button's words: "Sign in with …".
    #[serde(default = "default_label")]
    pub label: String,
    /// Whether local passwords still log in (false: sign-on only; API
    /// tokens still work).
    #[serde(default = "yes")]
    pub local_passwords: bool,
    /// Whether logging out also ends the session at the provider (its
    /// `end_session_endpoint`, when it has one).
    #[serde(default)]
    pub logout_at_provider: bool,
    /// Which groups grant what. A person in none of them is refused.
    #[serde(default)]
    pub roles: Vec<GroupRole>,
    /// The client secret as read ([`load`](Self::load)).
    #[serde(skip)]
    pub client_secret: Option<Secret>,
}

/// `[[oidc.roles]]`: members of `group` get `role` over `pipelines`.
#[derive(Debug, Clone, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct GroupRole {
    pub group: String,
    pub role: Role,
    /// Names or patterns (`lead-*`); none: every pipeline.
    #[serde(default)]
    pub pipelines: Vec<String>,
    /// Sees sensitive fields in clear.
    #[serde(default)]
    pub unmask: bool,
}

fn default_scopes() -> Vec<String> {
    vec!["profile".into(), "email".into()]
}
fn default_groups_claim() -> String {
    "groups".into()
}
fn default_username_claim() -> String {
    "preferred_username".into()
}
fn default_label() -> String {
    "single sign-on".into()
}
fn yes() -> bool {
    true
}

/// What a person's groups grant.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Granted {
    pub role: Role,
    pub pipelines: Scope,
    pub unmask: bool,
}

impl GroupRole {
    fn scope(&self) -> Result<Scope, String> {
        Scope::parse(&self.pipelines.join(","))
    }
}

impl OidcConfig {
    /// Reads the client secret, if one is named (a relative file in `dir`).
    pub(super) fn load(
        &mut self,
        env: &dyn Fn(&str) -> Option<String>,
        dir: &SecretsDir,
    ) -> Result<(), ConfigError> {
        if self.client_secret_env.is_none() && self.client_secret_file.is_none() {
            return Ok(());
        }
        let names = ("client_secret_env", "client_secret_file");
        let source = SecretRef::one_of(
            self.client_secret_env.as_ref(),
            self.client_secret_file.as_ref(),
            names,
        )
        .map_err(|m| invalid("oidc", m))?;
        let (key, source) = match source {
            SecretRef::File(path) => ("oidc.client_secret_file", SecretRef::File(dir.file(&path))),
            env => ("oidc.client_secret_env", env),
        };
        self.client_secret = Some(source.read(env, 1).map_err(|m| invalid(key, m))?);
        Ok(())
    }

    /// Checks the settings against the server's (`public_url`).
    pub(super) fn validate(&self, server: &ServerConfig) -> Result<(), ConfigError> {
        check_url("oidc.issuer", &self.issuer)?;
        if self.client_id.trim().is_empty() {
            return Err(invalid("oidc.client_id", "must not be empty".into()));
        }
        let redirect = self.redirect_url(server).ok_or_else(|| {
            invalid(
                "oidc.redirect_url",
                "set it, or `server.public_url` (it is then <public_url>/auth/oidc/callback)"
                    .into(),
            )
        })?;
        let url = check_url("oidc.redirect_url", &redirect)?;
        if url.path() != CALLBACK_PATH || url.query().is_some() {
            return Err(invalid(
                "oidc.redirect_url",
                format!("`{redirect}` must end in {CALLBACK_PATH} (no query)"),
            ));
        }
        for (key, v) in [
            ("oidc.groups_claim", &self.groups_claim),
            ("oidc.username_claim", &self.username_claim),
            ("oidc.label", &self.label),
        ] {
            if v.trim().is_empty() {
                return Err(invalid(key, "must not be empty".into()));
            }
        }
        if self.scopes.iter().any(|s| s.is_empty() || s.contains(' ')) {
            return Err(invalid(
                "oidc.scopes",
                "a scope is one word (no spaces)".into(),
            ));
        }
        self.validate_roles()
    }

    fn validate_roles(&self) -> Result<(), ConfigError> {
        if self.roles.is_empty() {
            return Err(invalid(
                "oidc.roles",
                "map at least one group to a role ([[oidc.roles]] group = \"…\", role = \"viewer\"): \
                 a person in no mapped group is refused"
                    .into(),
            ));
        }
        for (i, r) in self.roles.iter().enumerate() {
            let key = format!("oidc.roles[{i}]");
            if r.group.trim().is_empty() {
                return Err(invalid(&key, "`group` must not be empty".into()));
            }
            let scope = r.scope().map_err(|m| invalid(&key, m))?;
            scope
                .check_role(r.role)
                .map_err(|m| invalid(&key, format!("group {}: {m}", r.group)))?;
        }
        Ok(())
    }

    /// Where the provider sends people back.
    pub fn redirect_url(&self, server: &ServerConfig) -> Option<String> {
        self.redirect_url.clone().or_else(|| {
            let base = server.public_url.as_deref()?.trim_end_matches('/');
            Some(format!("{base}{CALLBACK_PATH}"))
        })
    }

    /// What `groups` grant: the strongest role any of them maps to, over
    /// the pipelines of the groups that map to that role (their union;
    /// every pipeline if one of them says so), unmasked if one of those
    /// says so. A weaker role's pipelines never widen a stronger one's.
    /// `None`: no group is mapped.
    pub fn grant(&self, groups: &[String]) -> Option<Granted> {
        let matching: Vec<&GroupRole> = self
            .roles
            .iter()
            .filter(|r| groups.contains(&r.group))
            .collect();
        let role = matching.iter().map(|r| r.role).max()?;
        let strongest: Vec<&&GroupRole> = matching.iter().filter(|r| r.role == role).collect();
        let pipelines = if strongest.iter().any(|r| r.pipelines.is_empty()) {
            Scope::all()
        } else {
            let all: Vec<&str> = strongest
                .iter()
                .flat_map(|r| r.pipelines.iter().map(String::as_str))
                .collect();
            // Checked when the configuration was read; at most the
            // patterns' limit, past which nothing is granted.
            Scope::parse(&all.join(",")).ok()?
        };
        Some(Granted {
            role,
            pipelines,
            unmask: strongest.iter().any(|r| r.unmask),
        })
    }
}

/// Whether `url` is https, or http on a loopback host (a test provider,
/// one on this machine): what the provider's endpoints and the redirect
/// must be, so codes, tokens and the client secret never cross a network
/// in clear.
pub fn safe_url(text: &str) -> bool {
    let Ok(url) = reqwest::Url::parse(text) else {
        return false;
    };
    let host = url.host_str().unwrap_or_default();
    let loopback = host == "localhost"
        || host
            .trim_start_matches('[')
            .trim_end_matches(']')
            .parse::<std::net::IpAddr>()
            .is_ok_and(|ip| ip.is_loopback());
    match url.scheme() {
        "https" => url.host().is_some(),
        "http" => loopback,
        _ => false,
    }
}

/// An absolute URL without user or fragment that is [`safe_url`].
fn check_url(key: &str, text: &str) -> Result<reqwest::Url, ConfigError> {
    let url = reqwest::Url::parse(text)
        .map_err(|e| invalid(key, format!("`{text}` is not a URL: {e}")))?;
    if !safe_url(text) {
        return Err(invalid(
            key,
            format!("`{text}` must be an https:// URL (http:// only on localhost)"),
        ));
    }
    if !url.username().is_empty() || url.password().is_some() || url.fragment().is_some() {
        return Err(invalid(
            key,
            format!("`{text}` must not carry a user name, password or fragment"),
        ));
    }
    Ok(url)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn config(text: &str) -> OidcConfig {
        toml::from_str(text).unwrap()
    }

    const BASE: &str = r#"
        issuer = "https://id.example.com"
        client_id = "ballast"
        redirect_url = "https://ballast.example.com/auth/oidc/callback"
    "#;

    #[test]
    fn groups_grant_the_strongest_role_over_its_own_pipelines() {
        let c = config(&format!(
            r#"{BASE}
            [[roles]]
            group = "ops-a"
            role = "operator"
            pipelines = ["a"]
            [[roles]]
            group = "ops-b"
            role = "operator"
            pipelines = ["b-*"]
            unmask = true
            [[roles]]
            group = "everyone"
            role = "viewer"
            [[roles]]
            group = "admins"
            role = "admin"
            "#
        ));
        c.validate(&ServerConfig::default()).unwrap();
        let g =
            |groups: &[&str]| c.grant(&groups.iter().map(|s| s.to_string()).collect::<Vec<_>>());
        assert_eq!(
            g(&["nobody", "marketing"]),
            None,
            "no mapped group grants nothing"
        );
        assert_eq!(g(&[]), None);
        let viewer = g(&["everyone"]).unwrap();
        assert_eq!(
            (viewer.role, viewer.pipelines.is_all(), viewer.unmask),
            (Role::Viewer, true, false)
        );
        let ops = g(&["ops-a", "everyone"]).unwrap();
        assert_eq!(ops.role, Role::Operator);
        assert_eq!(
            ops.pipelines.patterns(),
            ["a"],
            "a viewer's every pipeline does not widen it"
        );
        assert!(!ops.unmask);
        let both = g(&["ops-b", "ops-a"]).unwrap();
        assert_eq!(both.pipelines.patterns(), ["a", "b-*"]);
        assert!(both.unmask);
        let admin = g(&["admins", "ops-a"]).unwrap();
        assert_eq!((admin.role, admin.pipelines.is_all()), (Role::Admin, true));
    }

    #[test]
    fn bad_settings_are_named() {
        let err = |text: &str| {
            config(text)
                .validate(&ServerConfig::default())
                .unwrap_err()
                .to_string()
        };
        let roles = "[[roles]]\ngroup = \"g\"\nrole = \"viewer\"\n";
        assert!(err(BASE).contains("oidc.roles"), "{}", err(BASE));
        let plain = BASE.replace("https://id.example.com", "http://id.example.com");
        assert!(err(&format!("{plain}{roles}")).contains("oidc.issuer"));
        let local = BASE.replace("https://id.example.com", "http://127.0.0.1:8080");
        config(&format!("{local}{roles}"))
            .validate(&ServerConfig::default())
            .unwrap();
        let elsewhere = BASE.replace("/auth/oidc/callback", "/cb");
        assert!(err(&format!("{elsewhere}{roles}")).contains("oidc.redirect_url"));
        let no_redirect = "issuer = \"https://id.example.com\"\nclient_id = \"b\"\n";
        assert!(err(&format!("{no_redirect}{roles}")).contains("server.public_url"));
        let server = ServerConfig {
            public_url: Some("https://ballast.example.com/".into()),
            ..Default::default()
        };
        let c = config(&format!("{no_redirect}{roles}"));
        c.validate(&server).unwrap();
        assert_eq!(
            c.redirect_url(&server).unwrap(),
            "https://ballast.example.com/auth/oidc/callback"
        );
        let scoped_admin = "[[roles]]\ngroup = \"g\"\nrole = \"admin\"\npipelines = [\"a\"]\n";
        assert!(err(&format!("{BASE}{scoped_admin}")).contains("admin sees every pipeline"));
        let blank = "[[roles]]\ngroup = \" \"\nrole = \"viewer\"\n";
        assert!(err(&format!("{BASE}{blank}")).contains("group"));
    }

    #[test]
    fn the_client_secret_comes_from_a_variable_or_a_file() {
        let dir = tempfile::tempdir().unwrap();
        std::fs::write(dir.path().join("secret"), "from-file\n").unwrap();
        let dir = SecretsDir::new(None, dir.path());
        let env = |v: &str| (v == "S").then(|| "from-env".to_owned());
        let mut c = config(&format!("{BASE}client_secret_env = \"S\"\n"));
        c.load(&env, &dir).unwrap();
        assert_eq!(c.client_secret.unwrap().expose(), "from-env");
        let mut c = config(&format!("{BASE}client_secret_file = \"secret\"\n"));
        c.load(&env, &dir).unwrap();
        assert_eq!(c.client_secret.unwrap().expose(), "from-file");
        let mut c = config(&format!("{BASE}client_secret_env = \"UNSET\"\n"));
        let e = c.load(&env, &dir).unwrap_err().to_string();
        assert!(
            e.contains("UNSET") && e.contains("oidc.client_secret_env"),
            "{e}"
        );
        let mut c = config(BASE);
        c.load(&env, &dir).unwrap();
        assert!(c.client_secret.is_none(), "a public client");
    }
}
