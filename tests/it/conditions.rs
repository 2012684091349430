//! Branches: a step's `when` skips it with the values it read kept, a
//! skip propagates to what needs the skipped step, and a join
//! (`needs_any`) runs after whichever branch ran. Both backends, on a
//! clock the test moves.

use std::path::Path;
use std::sync::Arc;

use ballast::config::Config;
use ballast::domain::{OperatorAction, RecordState, StepRun, StepState};
use ballast::engine::Enqueue;
use ballast::sim::{Profile, SimHandle};
use ballast::store::Backend;
use serde_json::json;

use crate::engine::{drain, manual_engine_at};
use crate::helpers::TestDb;

/// A check whose reply echoes the input's amount; a manual review only
/// over 100, a fast path otherwise; `open` after whichever ran; `notify`
/// only after a review; `audit` when the input asks for it, reading a
/// field only some inputs have.
fn onboarding(base_url: &str) -> Arc<Config> {
    let text = format!(
        r#"
[providers.sim]
base_url = "{base_url}"
timeout = "30s"
[[providers.sim.rules]]
when = {{ status = "2xx", field = "/status", equals = "succeeded" }}
outcome = "success"

[[pipelines.onboard.steps]]
name = "check"
provider = "sim"
request = {{ method = "POST", path = "/v1/charge", body = '{{"ref": "check-{{{{ record.id }}}}", "amount": {{{{ input.amount }}}}}}' }}
outputs = {{ amount = "/amount" }}

[[pipelines.onboard.steps]]
name = "review"
provider = "sim"
needs = ["check"]
when = "steps.check.output.amount > 100"
request = {{ method = "POST", path = "/v1/charge", body = '{{"ref": "review-{{{{ record.id }}}}", "amount": 1}}' }}

[[pipelines.onboard.steps]]
name = "fast"
provider = "sim"
needs = ["check"]
when = "steps.check.output.amount <= 100"
request = {{ method = "POST", path = "/v1/charge", body = '{{"ref": "fast-{{{{ record.id }}}}", "amount": 1}}' }}

[[pipelines.onboard.steps]]
name = "open"
provider = "sim"
needs_any = ["review", "fast"]
request = {{ method = "POST", path = "/v1/charge", body = '{{"ref": "open-{{{{ record.id }}}}", "amount": {{% if steps.review is defined %}}2{{% else %}}3{{% endif %}}}}' }}
outputs = {{ amount = "/amount" }}

[[pipelines.onboard.steps]]
name = "notify"
provider = "sim"
needs = ["review", "open"]
request = {{ method = "POST", path = "/v1/charge", body = '{{"ref": "notify-{{{{ record.id }}}}", "amount": 1}}' }}

[[pipelines.onboard.steps]]
name = "audit"
provider = "sim"
needs = ["open"]
when = "input.audit"
request = {{ method = "POST", path = "/v1/charge", body = '{{"ref": "audit-{{{{ record.id }}}}", "amount": 1}}' }}
"#
    );
    let config = Config::parse(&text, Path::new("onboard.toml")).unwrap();
    config.validate(&|_| None).unwrap();
    Arc::new(config)
}

fn run<'r>(runs: &'r [StepRun], step: &str) -> &'r StepRun {
    runs.iter().find(|r| r.step == step).unwrap()
}

/// The references the sim was called with, sorted.
fn called(sim: &SimHandle) -> Vec<String> {
    let mut refs: Vec<String> = sim
        .arrivals()
        .iter()
        .filter_map(|a| a.client_reference.clone())
        .collect();
    refs.sort();
    refs
}

async fn a_branch_is_taken_and_the_join_runs_after_it(backend: Backend) {
    let Some(t) = TestDb::migrated(backend, "branches").await else {
        return;
    };
    let sim = SimHandle::spawn(Profile::clean(1)).await.unwrap();
    let config = onboarding(&sim.base_url());
    let start = crate::helpers::wall_ms();
    let (engine, _clock) = manual_engine_at(&t.db, config, "n1", start).await;
    let mut ids = Vec::new();
    for (key, input) in [
        ("small", json!({ "amount": 5, "audit": true })),
        ("large", json!({ "amount": 500, "audit": false })),
    ] {
        let e = Enqueue::new("onboard", Some(key), input);
        ids.push(engine.enqueue(e).await.unwrap().record.id);
    }
    drain(&engine).await;
    for id in &ids {
        let rec = t.db.get_record(*id).await.unwrap().unwrap();
        assert_eq!(rec.state, RecordState::Succeeded, "{:?}", rec.reason);
    }
    let (small, large) = (ids[0], ids[1]);
    // The small one: no review, the fast path, the join, no notify, an
    // audit; the skipped review keeps its expression and what it read.
    let runs = t.db.step_runs(small).await.unwrap();
    let review = run(&runs, "review");
    assert_eq!(review.state, StepState::Skipped);
    assert_eq!(
        review.output,
        Some(json!({
            "when": "steps.check.output.amount > 100",
            "read": { "steps.check.output.amount": 5 },
        }))
    );
    let said = review.reason.as_deref().unwrap_or("");
    assert!(
        said.contains("`when` is false") && said.contains("steps.check.output.amount = 5"),
        "{said}"
    );
    assert_eq!(review.attempts, 0);
    assert_eq!(run(&runs, "fast").state, StepState::Succeeded);
    assert_eq!(run(&runs, "open").state, StepState::Succeeded);
    let notify = run(&runs, "notify");
    assert_eq!(notify.state, StepState::Skipped);
    assert!(
        notify.reason.as_deref().unwrap_or("").contains("`review`"),
        "{:?}",
        notify.reason
    );
    assert_eq!(run(&runs, "audit").state, StepState::Succeeded);
    // The large one: the review, no fast path, the join, notify, no audit.
    let runs = t.db.step_runs(large).await.unwrap();
    assert_eq!(run(&runs, "review").state, StepState::Succeeded);
    assert_eq!(run(&runs, "fast").state, StepState::Skipped);
    assert_eq!(run(&runs, "notify").state, StepState::Succeeded);
    let audit = run(&runs, "audit");
    assert_eq!(
        (audit.state, &audit.output),
        (
            StepState::Skipped,
            &Some(json!({ "when": "input.audit", "read": { "input.audit": false } }))
        )
    );
    // Each call made once, the join's body reading which branch ran.
    let expected = [
        format!("audit-{small}"),
        format!("check-{large}"),
        format!("check-{small}"),
        format!("fast-{small}"),
        format!("notify-{large}"),
        format!("open-{large}"),
        format!("open-{small}"),
        format!("review-{large}"),
    ];
    let mut expected = expected.to_vec();
    expected.sort();
    assert_eq!(called(&sim), expected);
    for (id, amount) in [(small, 3), (large, 2)] {
        let runs = t.db.step_runs(id).await.unwrap();
        assert_eq!(run(&runs, "open").output, Some(json!({ "amount": amount })));
    }
    sim.stop();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn sqlite_a_branch_is_taken_and_the_join_runs_after_it() {
    a_branch_is_taken_and_the_join_runs_after_it(Backend::Sqlite).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn postgres_a_branch_is_taken_and_the_join_runs_after_it() {
    a_branch_is_taken_and_the_join_runs_after_it(Backend::Postgres).await;
}

/// A condition reading what the input lacks parks its record
/// (`when_invalid`) with the reason; a retry with an input that has it
/// judges it again, and a step skipped behind it runs.
async fn a_condition_that_cannot_be_judged_parks_until_a_new_input(backend: Backend) {
    let Some(t) = TestDb::migrated(backend, "unjudgeable").await else {
        return;
    };
    let sim = SimHandle::spawn(Profile::clean(1)).await.unwrap();
    let config = onboarding(&sim.base_url());
    let start = crate::helpers::wall_ms();
    let (engine, clock) = manual_engine_at(&t.db, config.clone(), "n1", start).await;
    let e = Enqueue::new("onboard", Some("no-audit"), json!({ "amount": 5 }));
    let id = engine.enqueue(e).await.unwrap().record.id;
    drain(&engine).await;
    let rec = t.db.get_record(id).await.unwrap().unwrap();
    assert_eq!(
        (rec.state, rec.error_code.as_deref(), rec.step.as_deref()),
        (RecordState::Parked, Some("when_invalid"), Some("audit")),
        "{:?}",
        rec.reason
    );
    assert!(
        rec.reason.as_deref().unwrap_or("").contains("input.audit"),
        "{:?}",
        rec.reason
    );
    let ops = ballast::engine::Ops::new(&t.db, &config, Some(&engine), &clock);
    let extra = ballast::engine::ActExtra {
        input: Some(ballast::store::InputEdit {
            new: json!({ "amount": 5, "audit": true }),
            was: None,
        }),
        ..Default::default()
    };
    let why = Some("audit it".to_owned());
    ops.act_with(id, OperatorAction::Retry, "ann", why, extra)
        .await
        .unwrap();
    drain(&engine).await;
    let rec = t.db.get_record(id).await.unwrap().unwrap();
    assert_eq!(rec.state, RecordState::Succeeded, "{:?}", rec.reason);
    let runs = t.db.step_runs(id).await.unwrap();
    assert_eq!(run(&runs, "audit").state, StepState::Succeeded);
    // The review its condition skipped stays skipped, its evidence kept
    // (its branch's join may have run): a retry re-runs what did not run
    // for want of a step that did not succeed, not a branch not taken.
    let review = run(&runs, "review");
    assert_eq!(review.state, StepState::Skipped);
    assert_eq!(
        review.output.as_ref().map(|o| &o["when"]),
        Some(&json!("steps.check.output.amount > 100"))
    );
    assert!(called(&sim).contains(&format!("audit-{id}")));
    sim.stop();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn sqlite_a_condition_that_cannot_be_judged_parks_until_a_new_input() {
    a_condition_that_cannot_be_judged_parks_until_a_new_input(Backend::Sqlite).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn postgres_a_condition_that_cannot_be_judged_parks_until_a_new_input() {
    a_condition_that_cannot_be_judged_parks_until_a_new_input(Backend::Postgres).await;
}

#[test]
fn check_config_refuses_a_condition_or_join_it_cannot_follow() {
    let good = onboarding("http://127.0.0.1:9");
    assert!(ballast::pipeline::compile(&good).is_ok());
    let base = |step: &str| {
        format!(
            r#"
[providers.sim]
base_url = "http://127.0.0.1:9"
[[pipelines.p.steps]]
name = "a"
provider = "sim"
request = {{ path = "/a" }}
[[pipelines.p.steps]]
name = "b"
provider = "sim"
request = {{ path = "/b" }}
[[pipelines.p.steps]]
name = "c"
provider = "sim"
request = {{ path = "/c" }}
{step}
"#
        )
    };
    let cases = [
        (r#"when = "steps.a.output.x""#, "not upstream", "when"),
        (r#"when = "secret == 1""#, "not available", "when"),
        (r#"when = "input.x ==""#, "syntax", "when"),
        (r#"needs_any = ["z"]"#, "unknown step `z`", "needs_any"),
        (r#"needs_any = ["c"]"#, "cannot need itself", "needs_any"),
        (
            "needs = [\"a\"]\nneeds_any = [\"a\", \"b\"]",
            "in `needs` too",
            "needs_any",
        ),
    ];
    for (step, expected, field) in cases {
        let text = base(step);
        let err = Config::parse(&text, Path::new("p.toml"))
            .and_then(|c| ballast::pipeline::compile(&c).map(|_| ()))
            .err()
            .map(|e| e.to_string())
            .unwrap_or_default();
        assert!(
            err.to_lowercase().contains(&expected.to_lowercase()),
            "expected {expected:?} for {step:?}: {err}"
        );
        assert!(
            err.contains(&format!("pipelines.p.steps[c].{field}")),
            "{err}"
        );
    }
    // A cycle through a join is a cycle.
    let cycle = base("needs_any = [\"a\"]").replace(
        "name = \"a\"\nprovider = \"sim\"",
        "name = \"a\"\nprovider = \"sim\"\nneeds = [\"c\"]",
    );
    let err = Config::parse(&cycle, Path::new("p.toml"))
        .and_then(|c| ballast::pipeline::compile(&c).map(|_| ()))
        .unwrap_err()
        .to_string();
    assert!(err.contains("form a cycle"), "{err}");
    // A condition and a join leave a pinned definition without them as
    // it was: its hash does not move.
    let plain = Config::parse(&base(""), Path::new("p.toml")).unwrap();
    let def = serde_json::to_value(&plain.pipelines["p"]).unwrap();
    assert!(!def.to_string().contains("needs_any") && !def.to_string().contains("when"));
}
