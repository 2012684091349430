//! Child pipelines: a `pipeline` step starts one record of another
//! pipeline, keyed from its parent, waits for it holding no worker, and
//! takes its outputs; a parked child shows on its parent; cancelling the
//! parent cancels the child. Both backends, on a clock the test moves.

use std::path::Path;
use std::sync::Arc;
use std::time::Duration;

use ballast::config::Config;
use ballast::domain::{Clock, StepWrite, WorkResult};
use ballast::domain::{OperatorAction, Record, RecordState, Role, StepRun, StepState};
use ballast::engine::{ActExtra, Enqueue, Ops};
use ballast::sim::{Profile, SimHandle};
use ballast::store::{Backend, ClaimRequest, Commit, Db, NewRecord};
use serde_json::{Value, json};

use crate::engine::{drain, manual_engine_at};
use crate::helpers::TestDb;

/// `onboard` checks, runs a `kyc` child (a check of the amount, then an
/// analyst's approval), then opens the account with what the child found.
fn onboarding(base_url: &str) -> Arc<Config> {
    let text = onboarding_toml(base_url);
    let config = Config::parse(&text, Path::new("children.toml")).unwrap();
    config.validate(&|_| None).unwrap();
    ballast::pipeline::compile(&config).unwrap();
    Arc::new(config)
}

fn onboarding_toml(base_url: &str) -> String {
    format!(
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
name = "kyc"
kind = "pipeline"
pipeline = "kyc"
needs = ["check"]
input = '{{"amount": {{{{ steps.check.output.amount }}}}, "who": {{{{ input.who | tojson }}}}}}'

[[pipelines.onboard.steps]]
name = "open"
provider = "sim"
needs = ["kyc"]
request = {{ method = "POST", path = "/v1/charge", body = '{{"ref": "open-{{{{ record.id }}}}", "amount": {{{{ steps.kyc.output.verify.amount + 1 }}}}}}' }}

[[pipelines.kyc.steps]]
name = "verify"
provider = "sim"
request = {{ method = "POST", path = "/v1/charge", body = '{{"ref": "verify-{{{{ input.who }}}}", "amount": {{{{ input.amount }}}}}}' }}
outputs = {{ amount = "/amount" }}

[[pipelines.kyc.steps]]
name = "review"
kind = "approval"
needs = ["verify"]

[[pipelines.batch.steps]]
name = "kycs"
kind = "pipeline"
pipeline = "kyc"
for_each = "/input/people"
max_parallel = 2
items_required = 2
priority = 2

[[pipelines.batchall.steps]]
name = "kycs"
kind = "pipeline"
pipeline = "kyc"
for_each = "/input/people"
max_parallel = 2
"#
    )
}

/// A test database, a clean simulator, the [`onboarding`] configuration
/// and an engine on a clock the test moves.
struct Onboarding {
    t: TestDb,
    sim: SimHandle,
    config: Arc<Config>,
    engine: ballast::engine::Engine,
    clock: ballast::domain::ManualClock,
}

impl Onboarding {
    async fn start(backend: Backend, name: &str) -> Option<Onboarding> {
        let t = TestDb::migrated(backend, name).await?;
        let sim = SimHandle::spawn(Profile::clean(1)).await.unwrap();
        let config = onboarding(&sim.base_url());
        let start = crate::helpers::wall_ms();
        let (engine, clock) = manual_engine_at(&t.db, config.clone(), "n1", start).await;
        Some(Onboarding {
            t,
            sim,
            config,
            engine,
            clock,
        })
    }

    /// Enqueues `input` on `pipeline` under `key`, then runs what is due:
    /// the record's id.
    async fn enqueue(&self, pipeline: &str, key: &str, input: Value) -> i64 {
        let e = Enqueue::new(pipeline, Some(key), input);
        let id = self.engine.enqueue(e).await.unwrap().record.id;
        drain(&self.engine).await;
        id
    }

    /// `action` on record `id` by `ann`, for `reason`, then what is due.
    async fn act(&self, id: i64, action: OperatorAction, reason: &str, extra: ActExtra<'_>) {
        let ops = Ops::new(&self.t.db, &self.config, Some(&self.engine), &self.clock);
        ops.act_with(id, action, "ann", Some(reason.to_owned()), extra)
            .await
            .unwrap();
        drain(&self.engine).await;
    }
}

fn run<'r>(runs: &'r [StepRun], step: &str) -> &'r StepRun {
    runs.iter().find(|r| r.step == step).unwrap()
}

async fn record(db: &Db, id: i64) -> Record {
    db.get_record(id).await.unwrap().unwrap()
}

/// The one child of `parent`.
async fn only_child(db: &Db, parent: i64) -> Record {
    let children = db.children(parent).await.unwrap();
    assert_eq!(children.len(), 1, "one child, never a second: {children:?}");
    children.into_iter().next().unwrap()
}

async fn a_parent_waits_for_its_child_and_takes_its_outputs(backend: Backend) {
    let Some(Onboarding {
        t,
        sim,
        config,
        engine,
        clock,
    }) = Onboarding::start(backend, "children").await
    else {
        return;
    };
    let e = Enqueue::new(
        "onboard",
        Some("ann"),
        json!({ "amount": 40, "who": "ann" }),
    )
    .with_priority(Some(8));
    let parent = engine.enqueue(e).await.unwrap().record.id;
    drain(&engine).await;

    // The parent started its child and waits; the child waits for its
    // analyst. Nothing is due, however long that takes.
    let p = record(&t.db, parent).await;
    assert_eq!(p.state, RecordState::Waiting, "{:?}", p.reason);
    assert_eq!(p.error_code.as_deref(), Some("awaiting_child"));
    let child = only_child(&t.db, parent).await;
    assert_eq!(child.pipeline, "kyc");
    assert_eq!(child.parent_id, Some(parent));
    assert_eq!(child.parent_step.as_deref(), Some("kyc"));
    assert_eq!(child.input, json!({ "amount": 40, "who": "ann" }));
    assert_eq!(child.priority, 8, "a child takes its parent's priority");
    assert_eq!(child.state, RecordState::Waiting);
    assert_eq!(child.error_code.as_deref(), Some("awaiting_approval"));
    let kyc = run(&t.db.step_runs(parent).await.unwrap(), "kyc").clone();
    assert_eq!(kyc.job_id, Some(child.id.to_string()));
    clock.advance(7 * 24 * 3600 * 1000);
    assert_eq!(drain(&engine).await, 0, "a wait costs no pass");

    // The analyst approves the child: it finishes, wakes its parent, and
    // the parent goes on with the child's outputs.
    let ops = Ops::new(&t.db, &config, Some(&engine), &clock);
    let extra = ActExtra {
        step: Some("review"),
        ..Default::default()
    };
    let comment = Some("documents match".to_owned());
    ops.act_with(child.id, OperatorAction::Approve, "ann", comment, extra)
        .await
        .unwrap();
    drain(&engine).await;
    let child = record(&t.db, child.id).await;
    assert_eq!(child.state, RecordState::Succeeded, "{:?}", child.reason);
    let p = record(&t.db, parent).await;
    assert_eq!(p.state, RecordState::Succeeded, "{:?}", p.reason);
    let runs = t.db.step_runs(parent).await.unwrap();
    let kyc = run(&runs, "kyc");
    assert_eq!(kyc.state, StepState::Succeeded);
    let output = kyc.output.clone().unwrap();
    assert_eq!(output["verify"]["amount"], json!(40));
    assert_eq!(output["review"]["decision"], json!("approved"));
    let opened = sim
        .arrivals()
        .iter()
        .any(|a| a.client_reference.as_deref() == Some(&format!("open-{parent}")));
    assert!(opened, "open ran after the child");
    only_child(&t.db, parent).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn sqlite_a_parent_waits_for_its_child_and_takes_its_outputs() {
    a_parent_waits_for_its_child_and_takes_its_outputs(Backend::Sqlite).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn postgres_a_parent_waits_for_its_child_and_takes_its_outputs() {
    a_parent_waits_for_its_child_and_takes_its_outputs(Backend::Postgres).await;
}

async fn a_parked_child_shows_on_its_parent_and_a_cancel_reaches_it(backend: Backend) {
    let Some(Onboarding {
        t,
        config,
        engine,
        clock,
        ..
    }) = Onboarding::start(backend, "children_parked").await
    else {
        return;
    };
    let e = Enqueue::new("onboard", Some("bob"), json!({ "amount": 7, "who": "bob" }));
    let parent = engine.enqueue(e).await.unwrap().record.id;
    drain(&engine).await;
    let child = only_child(&t.db, parent).await;
    let ops = Ops::new(&t.db, &config, Some(&engine), &clock);
    let reason = Some("the documents are unreadable".to_owned());
    ops.act_with(
        child.id,
        OperatorAction::Park,
        "ann",
        reason,
        ActExtra::default(),
    )
    .await
    .unwrap();
    drain(&engine).await;
    let p = record(&t.db, parent).await;
    assert_eq!(p.state, RecordState::Waiting);
    assert_eq!(p.error_code.as_deref(), Some("child_parked"));
    let said = p.reason.clone().unwrap_or_default();
    assert!(
        said.contains("waiting on a parked child") && said.contains(&child.id.to_string()),
        "{said}"
    );
    assert_eq!(drain(&engine).await, 0, "a parked child is news once");

    let reason = Some("customer withdrew".to_owned());
    let cancelled = ops
        .act_with(
            parent,
            OperatorAction::Cancel,
            "ann",
            reason,
            ActExtra::default(),
        )
        .await
        .unwrap();
    assert_eq!(cancelled.state, RecordState::Cancelled);
    let child = record(&t.db, child.id).await;
    assert_eq!(child.state, RecordState::Cancelled);
    let said = child.reason.clone().unwrap_or_default();
    assert!(
        said.contains(&format!("cancelled with its parent record {parent}")),
        "{said}"
    );
    let audited = t.db.record_events(child.id).await.unwrap();
    assert!(
        audited.iter().any(|e| e.kind == "cancel" && e.audit),
        "{audited:?}"
    );
}

/// The child of `parent`'s item `item` of step `kycs`.
async fn child_of_item(db: &Db, parent: i64, item: usize) -> Record {
    let step = format!("kycs#{item}");
    let children = db.children(parent).await.unwrap();
    let found = children
        .into_iter()
        .find(|c| c.parent_step.as_deref() == Some(&step));
    found.unwrap_or_else(|| panic!("no child for {step}"))
}

/// A `pipeline` step for each item: one child per item (its input the
/// item), at most `max_parallel` unfinished at once, each followed on its
/// own (a parked one shows on the parent, a cancelled one fails its
/// item), the step's output the children's outputs in item order.
async fn a_child_for_each_item(backend: Backend) {
    let Some(o) = Onboarding::start(backend, "children_each").await else {
        return;
    };
    let (t, engine) = (&o.t, &o.engine);
    let people: Vec<Value> = ["a", "b", "c"]
        .iter()
        .zip(1..)
        .map(|(who, amount)| json!({ "who": who, "amount": amount }))
        .collect();
    let parent = o.enqueue("batch", "abc", json!({ "people": people })).await;

    // Two children (the cap), each waiting for its analyst; the parent
    // waits on them, costing nothing meanwhile.
    let children = t.db.children(parent).await.unwrap();
    assert_eq!(children.len(), 2, "{children:?}");
    assert!(
        children.iter().all(|c| c.priority == 2),
        "the step's priority, not the parent's"
    );
    assert_eq!(
        (
            child_of_item(&t.db, parent, 0).await.input.clone(),
            child_of_item(&t.db, parent, 1).await.input.clone()
        ),
        (people[0].clone(), people[1].clone())
    );
    let p = record(&t.db, parent).await;
    assert_eq!(
        (p.state, p.error_code.as_deref()),
        (RecordState::Waiting, Some("awaiting_child")),
        "{:?}",
        p.reason
    );
    let items = t.db.item_runs(parent, "kycs", 0, 10).await.unwrap();
    assert_eq!(
        items[0].job_id,
        Some(child_of_item(&t.db, parent, 0).await.id.to_string())
    );
    o.clock.advance(7 * 24 * 3600 * 1000);
    assert_eq!(drain(engine).await, 0, "a wait costs no pass");

    // Item 0's child parks: the parent says so, once.
    let act = async |item: usize, action: OperatorAction, extra: ActExtra<'_>| {
        let child = child_of_item(&t.db, parent, item).await.id;
        let reason = format!("{action} item {item}'s child");
        o.act(child, action, &reason, extra).await;
    };
    act(0, OperatorAction::Park, ActExtra::default()).await;
    let p = record(&t.db, parent).await;
    assert_eq!(
        p.error_code.as_deref(),
        Some("child_parked"),
        "{:?}",
        p.reason
    );
    let said = p.reason.clone().unwrap_or_default();
    assert!(said.contains("waiting on a parked child"), "{said}");
    assert_eq!(drain(engine).await, 0, "a parked child is news once");

    // Item 1's child is approved: its item succeeds and item 2's child
    // starts (one unfinished beside the parked one).
    let review = || ActExtra {
        step: Some("review"),
        ..Default::default()
    };
    act(1, OperatorAction::Approve, review()).await;
    let children = t.db.children(parent).await.unwrap();
    assert_eq!(children.len(), 3, "{children:?}");
    assert_eq!(child_of_item(&t.db, parent, 2).await.input, people[2]);
    act(2, OperatorAction::Approve, review()).await;
    let p = record(&t.db, parent).await;
    assert_eq!(
        p.state,
        RecordState::Waiting,
        "the parked child's item has not ended"
    );

    // Its child cancelled, item 0 fails; two of three was enough.
    act(0, OperatorAction::Cancel, ActExtra::default()).await;
    let p = record(&t.db, parent).await;
    assert_eq!(p.state, RecordState::Succeeded, "{:?}", p.reason);
    let step = run(&t.db.step_runs(parent).await.unwrap(), "kycs").clone();
    let output = step.output.unwrap();
    assert_eq!(output[0], Value::Null, "{output}");
    assert_eq!(output[1]["verify"]["amount"], json!(2), "{output}");
    assert_eq!(
        output[2]["review"]["decision"],
        json!("approved"),
        "{output}"
    );
    let items = t.db.item_runs(parent, "kycs", 0, 10).await.unwrap();
    assert_eq!(items[0].error_code.as_deref(), Some("child_cancelled"));
    assert_eq!(
        t.db.children(parent).await.unwrap().len(),
        3,
        "one child per item"
    );
    for who in ["a", "b", "c"] {
        let reference = format!("verify-{who}");
        let sent = o
            .sim
            .arrivals()
            .iter()
            .filter(|a| a.client_reference.as_deref() == Some(&reference))
            .count();
        assert_eq!(sent, 1, "{reference}");
    }
}

/// A retry of a parent whose item's child was cancelled reads that child
/// again (the item keeps it: no second child) and fails as before, never
/// looping on the item.
async fn a_retry_reads_an_items_child_again(backend: Backend) {
    let Some(o) = Onboarding::start(backend, "children_each_retry").await else {
        return;
    };
    let t = &o.t;
    let people = json!({ "people": [{ "who": "f", "amount": 1 }, { "who": "g", "amount": 2 }] });
    let parent = o.enqueue("batch", "fg", people).await;
    let act = async |id: i64, action: OperatorAction| {
        o.act(id, action, &format!("{action}"), ActExtra::default())
            .await;
        record(&t.db, parent).await
    };
    let child = child_of_item(&t.db, parent, 0).await.id;
    let p = act(child, OperatorAction::Cancel).await;
    assert_eq!(
        (p.state, p.error_code.as_deref()),
        (RecordState::Failed, Some("items_failed")),
        "{:?}",
        p.reason
    );
    let p = act(parent, OperatorAction::Retry).await;
    assert_eq!(
        (p.state, p.error_code.as_deref()),
        (RecordState::Failed, Some("items_failed")),
        "{:?}",
        p.reason
    );
    let items = t.db.item_runs(parent, "kycs", 0, 10).await.unwrap();
    assert_eq!(items[0].error_code.as_deref(), Some("child_cancelled"));
    assert_eq!(items[0].job_id, Some(child.to_string()));
    assert_eq!(t.db.children(parent).await.unwrap().len(), 2);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn sqlite_a_retry_reads_an_items_child_again() {
    a_retry_reads_an_items_child_again(Backend::Sqlite).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn postgres_a_retry_reads_an_items_child_again() {
    a_retry_reads_an_items_child_again(Backend::Postgres).await;
}

/// The newest child of `parent`'s item `item` (a replay gives an item a
/// new one).
async fn newest_child_of_item(db: &Db, parent: i64, item: usize) -> Record {
    let step = format!("kycs#{item}");
    let children = db.children(parent).await.unwrap();
    let mine = children
        .into_iter()
        .filter(|c| c.parent_step.as_deref() == Some(&step));
    mine.max_by_key(|c| c.id)
        .unwrap_or_else(|| panic!("no child for {step}"))
}

/// `parent`'s children not at rest, by their item, in item order (items
/// start together: their children's ids need not be).
async fn unfinished_children(db: &Db, parent: i64) -> Vec<String> {
    let children = db.children(parent).await.unwrap();
    let running = children.into_iter().filter(|c| !c.state.is_at_rest());
    let mut items: Vec<String> = running.filter_map(|c| c.parent_step).collect();
    items.sort();
    items
}

/// A replay of only the failed items starts their new children within
/// `max_parallel` (a fresh run starts only while fewer have started), the
/// parent never loops on children it does not read, and every item
/// succeeds in the end.
async fn a_replay_of_failed_items_keeps_the_cap(backend: Backend) {
    let Some(o) = Onboarding::start(backend, "children_each_replay").await else {
        return;
    };
    let t = &o.t;
    let people: Vec<Value> = (0..6)
        .map(|n| json!({ "who": format!("p{n}"), "amount": n + 1 }))
        .collect();
    let parent = o.enqueue("batch", "six", json!({ "people": people })).await;
    let act = async |item: usize, action: OperatorAction| {
        let child = newest_child_of_item(&t.db, parent, item).await.id;
        let extra = ActExtra {
            step: (action == OperatorAction::Approve).then_some("review"),
            ..Default::default()
        };
        o.act(child, action, &format!("{action}"), extra).await;
        let open = unfinished_children(&t.db, parent).await;
        assert!(open.len() <= 2, "more children than max_parallel: {open:?}");
    };
    for item in 0..3 {
        act(item, OperatorAction::Cancel).await;
    }
    for item in 3..6 {
        act(item, OperatorAction::Approve).await;
    }
    assert_eq!(record(&t.db, parent).await.state, RecordState::Succeeded);

    let only_failed = ActExtra {
        step: Some("kycs"),
        failed_items: true,
        ..Default::default()
    };
    o.act(
        parent,
        OperatorAction::ReplayFrom,
        "documents found",
        only_failed,
    )
    .await;
    assert_eq!(
        unfinished_children(&t.db, parent).await,
        ["kycs#0", "kycs#1"]
    );
    for item in 0..3 {
        act(item, OperatorAction::Approve).await;
    }
    let p = record(&t.db, parent).await;
    assert_eq!(p.state, RecordState::Succeeded, "{:?}", p.reason);
    let output = run(&t.db.step_runs(parent).await.unwrap(), "kycs")
        .output
        .clone();
    let output = output.unwrap();
    let done = (0..6).filter(|n| output[n]["review"]["decision"] == "approved");
    assert_eq!(done.count(), 6, "{output}");
    assert_eq!(
        t.db.children(parent).await.unwrap().len(),
        9,
        "three items twice"
    );
}

/// A replay of only the failed items leaves an item whose child still
/// runs alone (a new key would start a second child): only the failed
/// item gets a new one.
async fn a_replay_of_failed_items_leaves_unfinished_items_alone(backend: Backend) {
    let Some(o) = Onboarding::start(backend, "children_each_replay_open").await else {
        return;
    };
    let t = &o.t;
    let people = json!({ "people": [{ "who": "q0", "amount": 1 }, { "who": "q1", "amount": 2 }] });
    let parent = o.enqueue("batchall", "two", people).await;
    let first = newest_child_of_item(&t.db, parent, 0).await.id;
    let nothing = ActExtra::default();
    o.act(first, OperatorAction::Cancel, "wrong person", nothing)
        .await;
    let p = record(&t.db, parent).await;
    assert_eq!(
        (p.state, p.error_code.as_deref()),
        (RecordState::Parked, Some("child_cancelled"))
    );
    let only_failed = ActExtra {
        step: Some("kycs"),
        failed_items: true,
        ..Default::default()
    };
    o.act(
        parent,
        OperatorAction::ReplayFrom,
        "the right person",
        only_failed,
    )
    .await;
    let open = unfinished_children(&t.db, parent).await;
    assert_eq!(open, ["kycs#0", "kycs#1"], "one child each");
    assert_eq!(t.db.children(parent).await.unwrap().len(), 3);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn sqlite_a_replay_of_failed_items_keeps_the_cap() {
    a_replay_of_failed_items_keeps_the_cap(Backend::Sqlite).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn postgres_a_replay_of_failed_items_keeps_the_cap() {
    a_replay_of_failed_items_keeps_the_cap(Backend::Postgres).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn sqlite_a_replay_of_failed_items_leaves_unfinished_items_alone() {
    a_replay_of_failed_items_leaves_unfinished_items_alone(Backend::Sqlite).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn postgres_a_replay_of_failed_items_leaves_unfinished_items_alone() {
    a_replay_of_failed_items_leaves_unfinished_items_alone(Backend::Postgres).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn sqlite_a_child_for_each_item() {
    a_child_for_each_item(Backend::Sqlite).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn postgres_a_child_for_each_item() {
    a_child_for_each_item(Backend::Postgres).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn sqlite_a_parked_child_shows_on_its_parent_and_a_cancel_reaches_it() {
    a_parked_child_shows_on_its_parent_and_a_cancel_reaches_it(Backend::Sqlite).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn postgres_a_parked_child_shows_on_its_parent_and_a_cancel_reaches_it() {
    a_parked_child_shows_on_its_parent_and_a_cancel_reaches_it(Backend::Postgres).await;
}

#[test]
fn check_config_refuses_unknown_cyclic_and_deep_children() {
    let pipeline = |name: &str, child: &str| {
        format!(
            r#"
[[pipelines.{name}.steps]]
name = "run"
kind = "pipeline"
pipeline = "{child}"
"#
        )
    };
    let leaf = r#"
[[pipelines.leaf.steps]]
name = "wait"
kind = "sleep"
for = "1h"
"#;
    let whole = |body: &str| {
        Config::parse(body, Path::new("children.toml"))
            .and_then(|c| ballast::pipeline::compile(&c).map(|_| ()))
            .err()
            .map(|e| e.to_string())
            .unwrap_or_default()
    };
    // A priority belongs to a child step alone.
    let sleepy = whole(&format!("{leaf}priority = 3\n"));
    assert!(sleepy.contains("takes no `priority`"), "{sleepy}");
    // Five levels below `p0` are allowed; six are not.
    let chain = |levels: usize| {
        let mut text = String::from(leaf);
        for i in 0..levels {
            let child = if i + 1 == levels {
                "leaf".to_owned()
            } else {
                format!("p{}", i + 1)
            };
            text.push_str(&pipeline(&format!("p{i}"), &child));
        }
        text
    };
    assert_eq!(whole(&chain(5)), "", "five levels of children");
    let deep = whole(&chain(6));
    assert!(deep.contains("deeper than 5 levels"), "{deep}");
    assert!(deep.contains("p0 → p1"), "{deep}");
    let cases = [
        (pipeline("a", "nowhere"), "unknown pipeline `nowhere`"),
        (pipeline("a", "a"), "cycle: a → a"),
        (
            format!("{}{}", pipeline("a", "b"), pipeline("b", "a")),
            "cycle: a → b → a",
        ),
        (
            pipeline("a", "leaf").replace("pipeline = \"leaf\"", ""),
            "needs `pipeline`",
        ),
        (
            format!(
                "{}input = '{{{{ steps.x.output }}}}'",
                pipeline("a", "leaf")
            ),
            "`x`",
        ),
        (
            format!("{}job_id = \"/id\"", pipeline("a", "leaf")),
            "takes no `job_id`",
        ),
        (
            format!("{}priority = 10", pipeline("a", "leaf")),
            "priority 10 is out of range",
        ),
    ];
    for (body, expected) in cases {
        let err = whole(&format!("{leaf}{body}"));
        assert!(
            err.contains(expected),
            "expected {expected:?}: {err}\n{body}"
        );
        assert!(err.contains("steps[run]"), "{err}");
    }
}

/// Parent and child link each other in the API and on their pages.
async fn parent_and_child_link_each_other(backend: Backend) {
    let sim = SimHandle::spawn(Profile::clean(1)).await.unwrap();
    let text = onboarding_toml(&sim.base_url());
    let Some(app) = crate::web::WebApp::spawn(backend, "children_links", &text).await else {
        sim.stop();
        return;
    };
    let op = app.token(Role::Operator).await;
    let create = async |body: Value| -> i64 {
        let made: Value = app
            .client
            .post(app.url("/api/v1/records"))
            .bearer_auth(&op)
            .json(&body)
            .send()
            .await
            .unwrap()
            .json()
            .await
            .unwrap();
        made["record"]["id"].as_i64().unwrap()
    };
    let parent = create(
        json!({ "pipeline": "onboard", "key": "cy", "input": { "amount": 3, "who": "cy" } }),
    )
    .await;
    let detail = async |id: i64| -> Value {
        let r = app.client.get(app.url(&format!("/api/v1/records/{id}")));
        r.bearer_auth(&op)
            .send()
            .await
            .unwrap()
            .json()
            .await
            .unwrap()
    };
    // The record, once it waits on `n` children.
    let waits_on = async |id: i64, n: usize| -> Value {
        let what = format!("record {id} waits on {n} children");
        crate::wait::until(&what, Duration::from_secs(30), async || {
            let r = detail(id).await;
            match r["children"].as_array().map(Vec::len) {
                Some(k) if k == n && r["record"]["error_code"] == "awaiting_child" => Ok(r),
                _ => Err(r),
            }
        })
        .await
    };
    let found = waits_on(parent, 1).await;
    let child = found["children"][0]["id"].as_i64().unwrap();
    assert_eq!(found["children"][0]["pipeline"], "kyc");
    assert_eq!(found["children"][0]["step"], "kyc");
    let c = detail(child).await;
    assert_eq!(c["record"]["parent_id"], json!(parent));
    assert_eq!(c["record"]["parent_step"], "kyc");
    app.user("v", Role::Viewer).await;
    let login = app.login("v").await;
    let page = app.text(&format!("/records/{parent}"), Some(&login)).await;
    assert!(
        page.contains(&format!(
            r#"<a href="/records/{child}">record {child}</a> (kyc"#
        )),
        "{page}"
    );
    let page = app.text(&format!("/records/{child}"), Some(&login)).await;
    assert!(
        page.contains(&format!(
            r#"<a href="/records/{parent}">record {parent}</a>, its step kyc"#
        )),
        "{page}"
    );

    // A child per item: each item's row links its child.
    let people =
        json!({ "people": [{ "who": "dee", "amount": 4 }, { "who": "eve", "amount": 5 }] });
    let batch = create(json!({ "pipeline": "batch", "key": "dee", "input": people })).await;
    let found = waits_on(batch, 2).await;
    // Items start together: their children's ids need not be in item order.
    let kids = found["children"].as_array().unwrap();
    let first = kids.iter().find(|c| c["step"] == "kycs#0");
    let kid = first.and_then(|c| c["id"].as_i64()).unwrap();
    let page = app.text(&format!("/records/{batch}"), Some(&login)).await;
    assert!(
        page.contains(&format!(
            r#"<td class="mono"><a href="/records/{kid}">record {kid}</a></td>"#
        )),
        "{page}"
    );
    app.stop().await;
    sim.stop();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn sqlite_parent_and_child_link_each_other() {
    parent_and_child_link_each_other(Backend::Sqlite).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn postgres_parent_and_child_link_each_other() {
    parent_and_child_link_each_other(Backend::Postgres).await;
}

/// A pass that leaves `parent` waiting on `child` at its step `kyc`.
fn parent_waits(lease: ballast::store::Lease, child: i64, code: &str, now: i64) -> Commit {
    let mut c = Commit::new(lease, now, Some(WorkResult::Waiting));
    let mut w = StepWrite::pending("kyc");
    w.state = StepState::Waiting;
    w.job_id = Some(child.to_string());
    w.error_code = Some(code.into());
    c.steps = vec![w];
    c.awaits_children = true;
    c
}

/// Claims every due record for `owner`; by id.
async fn claim_all(db: &Db, owner: &str, now: i64) -> std::collections::HashMap<i64, Record> {
    let claimed = db
        .claim_due(&ClaimRequest {
            owner: owner.into(),
            now,
            lease: Duration::from_secs(60),
            limit: 10,
            group_caps: Vec::new(),
        })
        .await
        .unwrap();
    claimed.into_iter().map(|r| (r.id, r)).collect()
}

/// Whichever of a child's commit (at rest) and its parent's (waiting on
/// it) lands first, the parent ends due: the child's wakes a parent
/// already waiting; the parent's finds its child already at rest. A child
/// parked, which the parent already says it waits on, wakes it no more.
async fn a_child_and_its_parent_never_miss_each_other(backend: Backend) {
    let Some(t) = TestDb::migrated(backend, "children_race").await else {
        return;
    };
    let now = crate::helpers::wall_ms();
    // (child's end, the parent's code, child's commit first, woken)
    let rounds = [
        (WorkResult::Completed, "awaiting_child", true, true),
        (WorkResult::Completed, "awaiting_child", false, true),
        (WorkResult::Parked, "awaiting_child", false, true),
        (WorkResult::Parked, "child_parked", true, false),
    ];
    for (round, (ended, code, child_first, woken)) in rounds.into_iter().enumerate() {
        let new = |key: String| NewRecord {
            pipeline: "onboard".into(),
            pipeline_version: None,
            external_key: Some(key),
            group: None,
            priority: ballast::domain::DEFAULT_PRIORITY,
            input: json!({}),
            run_at: now,
        };
        let made =
            t.db.create_records(
                vec![new(format!("p{round}")), new(format!("c{round}"))],
                now,
            )
            .await
            .unwrap();
        let (parent, child) = (made[0].record.id, made[1].record.id);
        t.db.link_child(child, parent, "kyc", now).await.unwrap();
        let held = claim_all(&t.db, "n1", now).await;
        let lease = |id: i64| held[&id].lease().unwrap();
        let mut done = Commit::new(lease(child), now, Some(ended));
        if ended == WorkResult::Parked {
            done.error_code = Some("parked_by_test".into());
            done.reason = Some("a test parks it".into());
        }
        done.wake = Some(parent);
        let waits = parent_waits(lease(parent), child, code, now);
        let order = if child_first {
            [done, waits]
        } else {
            [waits, done]
        };
        for c in order {
            t.db.commit(&c).await.unwrap();
        }
        let p = record(&t.db, parent).await;
        assert_eq!(p.state, RecordState::Waiting);
        let due = woken.then_some(now);
        assert_eq!(p.next_run_at, due, "round {round}");
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn sqlite_a_child_and_its_parent_never_miss_each_other() {
    a_child_and_its_parent_never_miss_each_other(Backend::Sqlite).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn postgres_a_child_and_its_parent_never_miss_each_other() {
    a_child_and_its_parent_never_miss_each_other(Backend::Postgres).await;
}

/// A child running when its parent is cancelled refuses the cancel (its
/// pass is under way); the commit of that pass cancels it.
async fn a_running_child_is_cancelled_when_its_pass_ends(backend: Backend) {
    let Some(t) = TestDb::migrated(backend, "children_running").await else {
        return;
    };
    let sim = SimHandle::spawn(Profile::clean(1)).await.unwrap();
    let mut text = onboarding_toml(&sim.base_url());
    text.push_str(
        r#"
[[pipelines.kyc.steps]]
name = "sign-off"
kind = "approval"
needs = ["review"]
"#,
    );
    let config = Arc::new(Config::parse(&text, Path::new("children.toml")).unwrap());
    let start = crate::helpers::wall_ms();
    let (engine, clock) = manual_engine_at(&t.db, config.clone(), "n1", start).await;
    let e = Enqueue::new("onboard", Some("dee"), json!({ "amount": 9, "who": "dee" }));
    let parent = engine.enqueue(e).await.unwrap().record.id;
    drain(&engine).await;
    let child = only_child(&t.db, parent).await.id;
    let ops = Ops::new(&t.db, &config, Some(&engine), &clock);
    let extra = ActExtra {
        step: Some("review"),
        ..Default::default()
    };
    ops.act_with(
        child,
        OperatorAction::Approve,
        "ann",
        Some("ok".into()),
        extra,
    )
    .await
    .unwrap();
    // Another worker holds the child when the parent is cancelled.
    let held = claim_all(&t.db, "other", clock.now_ms()).await;
    let lease = held[&child].lease().unwrap();
    ops.act_with(
        parent,
        OperatorAction::Cancel,
        "ann",
        Some("withdrawn".into()),
        ActExtra::default(),
    )
    .await
    .unwrap();
    assert_eq!(record(&t.db, child).await.state, RecordState::Running);
    // That worker gives it back; this node's pass over it ends waiting for
    // its sign-off, and its commit cancels it.
    t.db.release(&[lease], clock.now_ms()).await.unwrap();
    drain(&engine).await;
    let c = record(&t.db, child).await;
    assert_eq!(c.state, RecordState::Cancelled, "{:?}", c.reason);
    let said = c.reason.unwrap_or_default();
    assert!(
        said.contains(&format!("cancelled with its parent record {parent}")),
        "{said}"
    );
    sim.stop();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn sqlite_a_running_child_is_cancelled_when_its_pass_ends() {
    a_running_child_is_cancelled_when_its_pass_ends(Backend::Sqlite).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn postgres_a_running_child_is_cancelled_when_its_pass_ends() {
    a_running_child_is_cancelled_when_its_pass_ends(Backend::Postgres).await;
}

/// Issue 48 item 10, "a parent and child through a kill": `ballast serve`
/// killed with SIGKILL at random points of its work over `order` records
/// that pay, run a `verify` child (one check of their own), then ship,
/// against a provider that ignores idempotency keys (`at_most_once` with a
/// lookup), and restarted until every record is at rest. Every parent has
/// at most one child, every child is linked to its parent, a parent that
/// succeeded took its child's output, one whose child parked says so, and
/// no job of either is charged twice or missing from the history.
async fn a_parent_and_its_child_survive_kills(backend: Backend) {
    use crate::faults::{Serve, due_now, full_run, kill_while_working};
    let (n, kills) = if full_run() { (400, 10) } else { (45, 3) };
    assert_eq!(n % kills, 0, "records arrive in equal parts");
    let Some(t) = TestDb::migrated(backend, "children_kills").await else {
        return;
    };
    let mut profile = Profile::chaos_scaled(50, 0.02);
    profile.p_job_never = 0.0;
    profile.ignore_keys = true;
    profile.p_reset_after_effect = 0.03;
    profile.p_stall_after_effect = 0.01;
    let sim = SimHandle::spawn(profile).await.unwrap();
    let dir = tempfile::tempdir().unwrap();
    std::fs::write(
        dir.path().join("ballast.toml"),
        format!(
            "[database]\nurl = \"{}\"\n[engine]\nlease = \"2s\"\n{}{}",
            t.url,
            crate::engine::sim_provider_toml(&sim.base_url(), "at_most_once = true"),
            family_toml(),
        ),
    )
    .unwrap();
    let env = [("BALLAST_ADMIN_PASSWORD", "children-kill-admin-pw")];
    let mut rng = fastrand::Rng::with_seed(50);
    let part = n / kills;
    for round in 0..kills {
        let records = due_now(
            "order",
            "o-",
            round * part..(round + 1) * part,
            |i| json!({ "amount": i }),
        );
        t.db.create_records(records, crate::helpers::wall_ms())
            .await
            .unwrap();
        let node = Serve::start(dir.path(), &env).await;
        kill_while_working(node, &t.db, &sim, &mut rng).await;
    }
    let last = Serve::start(dir.path(), &env).await;
    let limit = Duration::from_secs(if full_run() { 900 } else { 300 });
    let settled = crate::wait::until("every family at rest", limit * 2, async || {
        family_at_rest(&t.db, n).await
    });
    if tokio::time::timeout(limit, settled).await.is_err() {
        // The stall's evidence: the records, the database's sessions, the log.
        crate::faults::stall_report(&t, dir.path()).await;
        panic!(
            "not at rest after {limit:?}: {:?}",
            family_at_rest(&t.db, n).await
        );
    }
    last.stop().await;
    crate::helpers::assert_counters_match(&t.db).await;

    let mut ledger = crate::faults::KeyLedger::of(&sim);
    let all = crate::helpers::all_records(&t.db, None).await;
    let mut jobs = 0;
    let mut by_state = std::collections::BTreeMap::<String, usize>::new();
    for r in &all {
        assert!(r.lease_owner.is_none(), "record {} still leased", r.id);
        assert!(
            t.db.open_intents(r.id).await.unwrap().is_empty(),
            "record {} at rest with a call left open",
            r.id
        );
        let attempts = t.db.attempts(r.id).await.unwrap();
        for run in t.db.step_runs(r.id).await.unwrap() {
            if run.step != "kyc" {
                ledger.check(&run, &attempts);
                jobs += usize::from(run.state == StepState::Succeeded);
            }
        }
        *by_state
            .entry(format!("{} {}", r.pipeline, r.state))
            .or_default() += 1;
        if r.pipeline == "order" {
            family_agrees(&t.db, r).await;
        } else {
            let parent = r.parent_id.expect("every child linked to its parent");
            assert_eq!(r.parent_step.as_deref(), Some("kyc"));
            let p = record(&t.db, parent).await;
            assert_eq!(p.pipeline, "order", "child {} of {parent}", r.id);
        }
    }
    println!(
        "{} parent and child kill -9 loop: {n} parents, {kills} kills: {by_state:?}; {jobs} jobs \
         done, {} submits reached the provider, {} double charges, {} calls with no attempt",
        backend.as_str(),
        ledger.calls(),
        sim.ledger().double_charges,
        ledger.holes,
    );
    assert_eq!(sim.ledger().double_charges, 0, "0 double charges");
    ledger.assert_whole();
    let parents_done = by_state.get("order succeeded").copied().unwrap_or(0);
    assert!(parents_done > 0, "some parents succeeded: {by_state:?}");
}

/// `order` pays, runs a `verify` child, then ships; `verify` checks. Every
/// call is a keyless job found again by its client reference.
fn family_toml() -> String {
    let job = |pipeline: &str, name: &str, needs: &str| {
        format!(
            r#"
[[pipelines.{pipeline}.steps]]
name = "{name}"
provider = "sim"
kind = "submit_poll"
needs = [{needs}]
request = {{ method = "POST", path = "/v1/jobs", body = '{{"client_reference": "{{{{ key }}}}", "amount": {{{{ input.amount }}}}}}' }}
job_id = "/id"
poll = {{ path = "/v1/jobs/{{{{ job_id }}}}", every = "50ms", deadline = "20s" }}
lookup = {{ path = "/v1/jobs?client_reference={{{{ key | urlencode }}}}", job_id = "/data/0/id" }}
outputs = {{ url = "/result/url" }}
"#
        )
    };
    format!(
        r#"{}
[[pipelines.order.steps]]
name = "kyc"
kind = "pipeline"
pipeline = "verify"
needs = ["pay"]
input = '{{"amount": {{{{ input.amount }}}}}}'
{}{}"#,
        job("order", "pay", ""),
        job("order", "ship", r#""kyc""#),
        job("verify", "check", ""),
    )
}

/// Every child at rest, and every parent at rest or waiting on a child
/// that parked (which only a person moves on); else those that are not,
/// by pipeline, state and code.
async fn family_at_rest(db: &Db, parents: i64) -> Result<(), String> {
    let all = crate::helpers::all_records(db, None).await;
    let settled = |r: &Record| {
        r.state.is_at_rest()
            || (r.pipeline == "order"
                && r.state == RecordState::Waiting
                && r.error_code.as_deref() == Some("child_parked"))
    };
    let orders = all.iter().filter(|r| r.pipeline == "order").count();
    // By pipeline, state and code: how many, and one of them.
    let mut unsettled = std::collections::BTreeMap::<String, (usize, i64)>::new();
    for r in all.iter().filter(|r| !settled(r)) {
        let code = r.error_code.as_deref().unwrap_or("-");
        let seen = format!("{} {} {code}", r.pipeline, r.state);
        unsettled.entry(seen).or_insert((0, r.id)).0 += 1;
    }
    if orders as i64 == parents && unsettled.is_empty() {
        return Ok(());
    }
    Err(format!("{orders} parents; not at rest: {unsettled:?}"))
}

/// A parent at rest agrees with its one child (if it got that far).
async fn family_agrees(db: &Db, parent: &Record) {
    let children = db.children(parent.id).await.unwrap();
    assert!(children.len() <= 1, "never a second child: {children:?}");
    let runs = db.step_runs(parent.id).await.unwrap();
    let kyc = runs.iter().find(|r| r.step == "kyc");
    let Some(child) = children.first() else {
        assert!(
            kyc.is_none_or(|k| k.job_id.is_none()),
            "record {} names a child it does not have: {kyc:?}",
            parent.id
        );
        return;
    };
    let kyc = kyc.expect("a parent with a child has its step");
    assert_eq!(
        kyc.job_id,
        Some(child.id.to_string()),
        "parent {}",
        parent.id
    );
    match parent.state {
        RecordState::Succeeded => {
            assert_eq!(child.state, RecordState::Succeeded);
            let check = run(&db.step_runs(child.id).await.unwrap(), "check").clone();
            assert_eq!(kyc.output, Some(json!({ "check": check.output.unwrap() })));
        }
        RecordState::Waiting => assert_eq!(child.state, RecordState::Parked),
        _ => assert!(
            child.state.is_at_rest(),
            "parent {} {} with child {} {}",
            parent.id,
            parent.state,
            child.id,
            child.state
        ),
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn sqlite_a_parent_and_its_child_survive_kills() {
    a_parent_and_its_child_survive_kills(Backend::Sqlite).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn postgres_a_parent_and_its_child_survive_kills() {
    a_parent_and_its_child_survive_kills(Backend::Postgres).await;
}
