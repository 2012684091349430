//! `ballast serve --demo`: three chaos simulators mounted in-process, four
//! providers and three pipelines (and a child pipeline) that look like
//! real work, and a generator
//! that enqueues records at a steady rate, so the dashboard shows every
//! kind of outcome within a minute — retries, rate-limit deferrals, parked
//! records with readable reasons, a breaker opening during a scheduled
//! outage of the render provider, the AI provider's maintenance windows
//! (503 with `Retry-After` to every call, confirmations included) and its
//! OAuth2 tokens dying before their stated lifetime.

use std::time::Duration;

use anyhow::Context;
use serde_json::json;
use tokio_util::sync::CancellationToken;

use crate::config::{Config, DatabaseUrl, Secret};
use crate::sim::{Maintenance, Outage, Profile, SimHandle, SimOAuth2};

/// The database the demo uses when none is configured.
pub const DEMO_DB: &str = "sqlite://ballast-demo.db?mode=rwc";

/// The running simulators; they stop with the handle.
pub struct Demo {
    pub sims: Vec<SimHandle>,
    pub rate: f64,
}

impl Drop for Demo {
    fn drop(&mut self) {
        for s in &self.sims {
            s.stop();
        }
    }
}

/// The demo's providers and pipelines over simulators at `apis` (requests)
/// and `render` (jobs with signed callbacks). Written as TOML so that it is
/// checked exactly like an operator's file.
pub fn demo_toml(apis: &str, llm: &str, render: &str) -> String {
    // Each piece opens with a line break and ends without a blank line, so
    // that they join as one file.
    let mut toml = demo_providers(apis, llm, render);
    toml.push_str(LEAD_ENRICHMENT);
    toml.push_str(MEDIA_RENDER);
    toml.push_str(ONBOARDING);
    toml
}

/// The demo's four providers (`people-api` and `crm` at `apis`, `llm`,
/// `render-api`), each with its limits, retries and rules.
fn demo_providers(apis: &str, llm: &str, render: &str) -> String {
    format!(
        r#"
# A paid people-data API: rate-limited, sometimes 429s. Each lookup costs
# money, so one attempt only: a failed one is parked for a person to decide.
[providers.people-api]
base_url = "{apis}"
timeout = "3s"
concurrency = 16
rate_limits = ["8/s"]
retry = {{ max_attempts = 1, base = "500ms", cap = "8s", deadline = "2m" }}
{people_rules}
# An AI model behind an async job API: submit, then poll. OAuth2 tokens
# that die before their stated lifetime, and maintenance windows answering
# 503 with Retry-After: 30 to every call (confirmations too).
[providers.llm]
base_url = "{llm}"
timeout = "3s"
concurrency = 8
rate_limits = ["15/s"]
retry = {{ max_attempts = 4, base = "500ms", cap = "8s", deadline = "3m" }}
oauth2 = {{ token_url = "{llm}/oauth/token", client_id_env = "DEMO_LLM_CLIENT_ID", client_secret_env = "DEMO_LLM_CLIENT_SECRET" }}
{llm_rules}
# The CRM: the last, optional step.
[providers.crm]
base_url = "{apis}"
timeout = "3s"
rate_limits = ["5/s"]
retry = {{ max_attempts = 3, base = "1s", cap = "5s", deadline = "1m" }}
{crm_rules}
# A video renderer that calls back when done; it has scheduled outages.
[providers.render-api]
base_url = "{render}"
timeout = "3s"
concurrency = 8
rate_limits = ["4/s"]
retry = {{ max_attempts = 5, base = "1s", cap = "10s", deadline = "3m" }}
breaker = {{ window = 20, min_calls = 8, failure_rate = 0.5, open_for = "15s", probes = 2 }}
{render_rules}"#,
        people_rules = demo_rules("people-api"),
        llm_rules = demo_rules("llm"),
        crm_rules = demo_rules("crm"),
        render_rules = demo_rules("render-api"),
    )
}

/// The rules every demo provider `p` shares: a job's `/status` says
/// pending, success or failure, and 400, 404 and 422 fail.
fn demo_rules(p: &str) -> String {
    format!(
        r#"
[[providers.{p}.rules]]
when = {{ status = "2xx", field = "/status", in = ["queued", "running"] }}
outcome = "pending"
[[providers.{p}.rules]]
when = {{ status = "2xx", field = "/status", equals = "succeeded" }}
outcome = "success"
[[providers.{p}.rules]]
when = {{ status = "2xx", field = "/status", equals = "failed" }}
outcome = "fail"
[[providers.{p}.rules]]
when = {{ status = ["400", "404", "422"] }}
outcome = "fail"
"#
    )
}

/// The `lead-enrichment` pipeline: a cron schedule, then fetch, an
/// analysis and an email check side by side, and an optional CRM update.
const LEAD_ENRICHMENT: &str = r#"
# Besides the generator's records, one enqueued by a cron schedule every
# 30 seconds (the overview lists it with its next and last run).
[pipelines.lead-enrichment]
schedule = { cron = "*/30 * * * * *", input = { email = "scheduled@example.com" } }

[[pipelines.lead-enrichment.steps]]
name = "fetch"
provider = "people-api"
request = { method = "POST", path = "/v1/charge", body = '{"ref": "{{ record.id }}-fetch", "amount": 0, "email": {{ input.email | tojson }}}' }
outputs = { person_id = "/id" }

[[pipelines.lead-enrichment.steps]]
name = "analyse"
provider = "llm"
kind = "submit_poll"
needs = ["fetch"]
request = { method = "POST", path = "/v1/jobs", body = '{"ref": "{{ record.id }}-analyse", "person": {{ steps.fetch.output.person_id | tojson }}}' }
job_id = "/id"
poll = { path = "/v1/jobs/{{ job_id }}", every = "2s", deadline = "30s" }
outputs = { summary = "/result/url" }
# Asked again 20 s and 40 s after its success: an analysis the model
# withdraws parks its record.
confirm = { after = "20s", times = 2 }
on_reversal = "park"

# Fans out after `fetch`: the email check runs beside the analysis, and
# the CRM update waits for both.
[[pipelines.lead-enrichment.steps]]
name = "verify-email"
provider = "crm"
needs = ["fetch"]
request = { method = "POST", path = "/v1/charge", body = '{"ref": "{{ record.id }}-verify", "amount": 0, "email": {{ input.email | tojson }}}' }
outputs = { check_id = "/id" }

[[pipelines.lead-enrichment.steps]]
name = "crm-update"
provider = "crm"
needs = ["analyse", "verify-email"]
required = false
request = { method = "POST", path = "/v1/charge", body = '{"ref": "{{ record.id }}-crm", "amount": 0}' }
"#;

/// The `media-render` pipeline: a render that calls back (polled when the
/// callback does not come), then its publication.
const MEDIA_RENDER: &str = r#"
[[pipelines.media-render.steps]]
name = "render"
provider = "render-api"
kind = "callback"
request = { method = "POST", path = "/v1/jobs", body = '{"ref": "{{ record.id }}-render", "video": {{ input.video | tojson }}, "callback_url": {{ input.callback_url | tojson }}}' }
job_id = "/id"
callback = { job_id = "/job_id", deadline = "45s", fallback = "poll" }
poll = { path = "/v1/jobs/{{ job_id }}", every = "2s", deadline = "2m" }
outputs = { url = "/result/url" }
on_reversal = "park"

[[pipelines.media-render.steps]]
name = "publish"
provider = "crm"
needs = ["render"]
request = { method = "POST", path = "/v1/charge", body = '{"ref": "{{ record.id }}-publish", "amount": 1, "url": {{ steps.render.output.url | tojson }}}' }
"#;

/// The `onboarding` pipeline, every workflow feature at once: a child
/// `identity-check` record; each of the applicant's documents scanned
/// (a step for each item, two at once); a branch on the credit limit (an analyst's
/// approval above 5,000, a short timer below); the join; an account opened
/// (undone if a later step fails: a card declined, one applicant in eight);
/// a signal that the account was funded (30 s, then on without it); a
/// durable timer; a welcome that may fail (one attempt, and the people API
/// fails some calls).
const ONBOARDING: &str = r#"
[pipelines.identity-check]
description = "Checks one applicant's documents (started by onboarding)."

[[pipelines.identity-check.steps]]
name = "documents"
provider = "people-api"
timeout = "5s"
retry = { max_attempts = 2 }
request = { method = "POST", path = "/v1/charge", body = '{"ref": "{{ record.id }}-documents", "amount": 0, "email": {{ input.email | tojson }}}' }
outputs = { check = "/id" }

[pipelines.onboarding]
description = "Opens an account: identity check, an analyst's approval above 5,000, a card, a funding signal, a welcome 20 s later; undone on failure."
on_failure = "undo"

[[pipelines.onboarding.steps]]
name = "identity"
kind = "pipeline"
pipeline = "identity-check"
input = '{"email": {{ input.email | tojson }}}'

[[pipelines.onboarding.steps]]
name = "scan"
provider = "people-api"
for_each = "/input/documents"
max_parallel = 2
request = { method = "POST", path = "/v1/charge", body = '{"ref": "{{ record.id }}-scan-{{ item_index }}", "amount": 0, "document": {{ item | tojson }}}' }
outputs = { scan = "/id" }

[[pipelines.onboarding.steps]]
name = "review"
kind = "approval"
needs = ["identity", "scan"]
when = "input.limit > 5000"
timeout = "10m"

[[pipelines.onboarding.steps]]
name = "auto-approve"
kind = "sleep"
for = "2s"
needs = ["identity", "scan"]
when = "input.limit <= 5000"

[[pipelines.onboarding.steps]]
name = "open-account"
provider = "crm"
needs_any = ["review", "auto-approve"]
when = "steps.review is not defined or steps.review.output.decision == 'approved'"
request = { method = "POST", path = "/v1/charge", body = '{"ref": "{{ record.id }}-open", "amount": 1}' }
outputs = { account = "/id" }
undo = { request = { method = "POST", path = "/v1/charge", body = '{"ref": "{{ record.id }}-close", "amount": 0, "account": {{ output.account | tojson }}}' } }

[[pipelines.onboarding.steps]]
name = "issue-card"
provider = "crm"
needs = ["open-account"]
retry = { max_attempts = 1 }
request = { method = "POST", path = "/v1/{{ 'cards' if input.card is defined and input.card == 'declined' else 'charge' }}", body = '{"ref": "{{ record.id }}-card", "amount": 0}' }

[[pipelines.onboarding.steps]]
name = "funded"
kind = "signal"
needs = ["issue-card"]
timeout = "30s"
on_timeout = "continue"
timeout_output = { funded = false }

[[pipelines.onboarding.steps]]
name = "welcome-later"
kind = "sleep"
for = "20s"
needs = ["funded"]

[[pipelines.onboarding.steps]]
name = "welcome"
provider = "people-api"
needs = ["welcome-later"]
request = { method = "POST", path = "/v1/charge", body = '{"ref": "{{ record.id }}-welcome", "amount": 0, "email": {{ input.email | tojson }}}' }
"#;

/// Starts the simulators and adds the demo's providers and pipelines to
/// `config` (the operator's own stay), with the demo database unless one is
/// configured. `serve_addr` is where the callbacks go.
pub async fn prepare(config: &mut Config, rate: f64) -> anyhow::Result<Demo> {
    if !(0.0..=1000.0).contains(&rate) {
        anyhow::bail!("--demo-rate must be between 0 and 1000 records per second");
    }
    let mut apis = Profile::chaos(7);
    apis.latency_scale = 0.5;
    apis.retry_after_max_secs = 5;
    apis.hang = Duration::from_secs(10);
    apis.job_time = (Duration::from_millis(500), Duration::from_secs(8));
    let mut llm = Profile::chaos(9);
    llm.latency_scale = 0.5;
    llm.retry_after_max_secs = 5;
    llm.hang = Duration::from_secs(10);
    llm.job_time = (Duration::from_millis(500), Duration::from_secs(8));
    // Tokens that last 45 s while the endpoint says 2 minutes.
    let (client_id, client_secret) = ("demo-llm", crate::auth::secret::hex::<16>()?);
    let mut oauth = SimOAuth2::new(client_id, &client_secret, Duration::from_secs(45));
    oauth.stated_ttl = Duration::from_secs(120);
    llm.oauth2 = Some(oauth);
    // Ten seconds of maintenance 90 s in, and every five minutes after.
    llm.maintenance = (0..12)
        .map(|i| Maintenance {
            after: Duration::from_secs(90 + 300 * i),
            lasts: Duration::from_secs(10),
            retry_after: Duration::from_secs(30),
        })
        .collect();
    let mut render = Profile::chaos(11);
    render.latency_scale = 0.5;
    render.retry_after_max_secs = 5;
    render.hang = Duration::from_secs(10);
    render.job_time = (Duration::from_secs(1), Duration::from_secs(10));
    let secret = crate::auth::secret::hex::<32>()?;
    render.callback_secret = Some(secret.clone());
    // An outage 20 s in, and every five minutes after: the breaker opens.
    render.outages = (0..12)
        .map(|i| Outage {
            after: Duration::from_secs(20 + 300 * i),
            lasts: Duration::from_secs(25),
            brownout: 1.0,
        })
        .collect();
    let apis = SimHandle::spawn(apis)
        .await
        .context("cannot start the demo simulator")?;
    let llm = SimHandle::spawn(llm)
        .await
        .context("cannot start the demo simulator")?;
    let render = SimHandle::spawn(render)
        .await
        .context("cannot start the demo simulator")?;
    let text = demo_toml(&apis.base_url(), &llm.base_url(), &render.base_url());
    let demo = Config::parse(&text, std::path::Path::new("demo.toml"))
        .map_err(|e| anyhow::anyhow!("the demo configuration is broken: {e}"))?;
    for (name, mut p) in demo.providers {
        if name == "render-api" {
            p.webhook_secrets_inline = vec![Secret::new(secret.clone())];
        }
        if let Some(o) = p.oauth2.as_mut() {
            o.inline = Some((Secret::new(client_id), Secret::new(client_secret.clone())));
        }
        config.providers.entry(name).or_insert(p);
    }
    for (name, p) in demo.pipelines {
        config.pipelines.entry(name).or_insert(p);
    }
    if config.database.url == crate::config::DatabaseConfig::default().url {
        config.database.url = DatabaseUrl::new(DEMO_DB);
    }
    // Plain HTTP on this machine: cookies without `Secure`, so every
    // browser keeps them on http://127.0.0.1.
    if config.server.public_url.is_none() && config.server.bind.ip().is_loopback() {
        config.server.secure_cookies = false;
    }
    config
        .validate(&|v| std::env::var(v).ok())
        .and_then(|()| crate::pipeline::compile(config).map(drop))
        .map_err(|e| anyhow::anyhow!("{e}"))?;
    Ok(Demo {
        sims: vec![apis, llm, render],
        rate,
    })
}

/// Enqueues demo records at `demo.rate` per second until `stop`: leads,
/// videos and onboardings, each with an external key.
pub async fn generate(
    engine: crate::engine::Engine,
    demo: Demo,
    callback_url: String,
    stop: CancellationToken,
) {
    if demo.rate <= 0.0 {
        stop.cancelled().await;
        return;
    }
    let every = Duration::from_secs_f64(1.0 / demo.rate);
    let mut n: u64 = 0;
    let run = uuid::Uuid::new_v4().simple().to_string();
    let companies = [
        "acme", "globex", "initech", "umbrella", "hooli", "stark", "wayne", "tyrell",
    ];
    loop {
        tokio::select! {
            () = stop.cancelled() => break,
            () = tokio::time::sleep(every) => {}
        }
        n += 1;
        let key = format!("{}-{n}", &run[..6]);
        let (pipeline, input) = if n % 5 == 0 {
            let company = companies[(n as usize) % companies.len()];
            (
                "onboarding",
                json!({
                    "email": format!("applicant{n}@{company}.example"),
                    "limit": (n * 1_337) % 10_000,
                    "documents": (0..2 + n % 4).map(|d| format!("doc-{key}-{d}")).collect::<Vec<_>>(),
                    // One applicant in eight has a card declined: the
                    // account opened for them is closed again (undo).
                    "card": if (n / 5) % 8 == 3 { "declined" } else { "ok" },
                }),
            )
        } else if n % 3 == 0 {
            (
                "media-render",
                json!({ "video": format!("vid_{key}"), "callback_url": callback_url }),
            )
        } else {
            let company = companies[(n as usize) % companies.len()];
            (
                "lead-enrichment",
                json!({ "email": format!("lead{n}@{company}.example"), "company": company }),
            )
        };
        if let Err(e) = engine
            .enqueue(crate::engine::Enqueue::new(pipeline, Some(&key), input))
            .await
        {
            tracing::warn!(error = %e, "demo generator could not enqueue");
        }
    }
    drop(demo);
}

#[cfg(test)]
mod tests {
    use crate::config::Config;

    #[test]
    fn the_demo_pipelines_compile() {
        let url = "http://127.0.0.1:9";
        let text = super::demo_toml(url, url, url);
        let config = Config::parse(&text, std::path::Path::new("demo.toml")).unwrap();
        let compiled = crate::pipeline::compile(&config).unwrap();
        for name in [
            "lead-enrichment",
            "media-render",
            "onboarding",
            "identity-check",
        ] {
            assert!(compiled.pipelines.contains_key(name), "{name}");
        }
    }
}
