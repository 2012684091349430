//! A step for each item (`domain::each`) in a pass: the step's items
//! due now run, and new ones start in item order while fewer than
//! `max_parallel` are unfinished, each as a step of its own (`STEP#INDEX`:
//! its own call, attempts, idempotency key, intent, permits and breaker
//! verdicts), up to a few rounds per pass; the step's own run is then
//! judged from the items' tally. Only the items a pass runs are read: the
//! rest are counted in SQL (a scan of the step's items on its index).
//! Each running item's call holds a copy of the record's context (with
//! the list in it).

use std::collections::HashMap;

use futures_util::StreamExt;
use futures_util::stream::FuturesUnordered;
use serde_json::Value;

use super::pass::{PendingStep, step_call};
use super::step::StepOutput;
use crate::domain::each::{Each, Tally, assembled, item_name, item_of, items, judge};
use crate::domain::step::{Decision, defer};
use crate::domain::{StepState, StepWrite, UnixMs};
use crate::pipeline::Step;

/// Step `s` as its item `index` runs: its name the item's, its condition
/// judged already for the whole step, and (when only some items must
/// succeed) an item that cannot be made fails rather than parks.
pub(super) fn item_step(s: &Step, each: &Each, index: i64) -> Step {
    let mut item = s.clone();
    item.name = item_name(&s.name, index);
    item.each = None;
    item.when = None;
    item.required = each.required.is_none() && s.required;
    item
}

/// The run of a step's item that an earlier pass left with its call open
/// (`at_most_once`), to be judged as such: the item's step and its run as
/// stored (a fresh one of the step's generation when none was kept).
pub(super) async fn left_open_item(
    i: &super::Inner,
    record_id: i64,
    steps: (&[Step], &HashMap<String, StepWrite>),
    name: &str,
) -> Result<Option<(Step, StepWrite)>, crate::store::StoreError> {
    let (pipeline, states) = steps;
    let Some((of, index)) = item_of(name) else {
        return Ok(None);
    };
    let Some((s, each)) = pipeline
        .iter()
        .find(|s| s.name == of)
        .and_then(|s| Some((s, s.each.as_ref()?)))
    else {
        return Ok(None);
    };
    let Some(aggregate) = states.get(of) else {
        return Ok(None);
    };
    let stored = i.db.item_runs(record_id, of, index, 1).await?;
    let write = match stored.first().filter(|r| r.step == name) {
        Some(run) => StepWrite::from(run),
        None => fresh(&item_name(of, index), &s.provider, aggregate.generation),
    };
    Ok(Some((item_step(s, each, index), write)))
}

/// The items of a record's steps parked on a call whose outcome is not
/// known, when the record is parked on one (with its steps' runs, what
/// "it took effect" answers for, and refuses when there are several);
/// none otherwise.
pub async fn uncertain_items_of(
    db: &crate::store::Db,
    rec: &crate::domain::Record,
) -> Result<Vec<crate::domain::StepRun>, crate::store::StoreError> {
    match rec.error_code.as_deref() == Some(crate::domain::OUTCOME_UNCERTAIN) {
        true => db.uncertain_items(rec.id).await,
        false => Ok(Vec::new()),
    }
}

/// The items of the record's steps for each item that a lost pass
/// started but left no trace of: below the highest item whose call it
/// left open (in `states`, judged this pass) and above the highest
/// stored, with no call of their own. Fresh runs, to be written with the
/// pass.
pub(super) async fn unstarted(
    i: &super::Inner,
    record_id: i64,
    (pipeline, states): (&[Step], &HashMap<String, StepWrite>),
    now: UnixMs,
) -> Result<Vec<StepWrite>, crate::store::StoreError> {
    let mut out = Vec::new();
    for s in pipeline.iter().filter(|s| s.each.is_some()) {
        let known: std::collections::BTreeSet<i64> = states
            .keys()
            .filter_map(|n| item_of(n).filter(|(of, _)| *of == s.name).map(|(_, i)| i))
            .collect();
        let (Some(&top), Some(aggregate)) = (known.last(), states.get(&s.name)) else {
            continue;
        };
        let (tally, _) = i.db.items(record_id, &s.name, now, 0).await?;
        for index in (tally.next..top).filter(|k| !known.contains(k)) {
            let name = item_name(&s.name, index);
            out.push(fresh(&name, &s.provider, aggregate.generation));
        }
    }
    Ok(out)
}

/// A new item's run, `name`: pending, in its step's `generation`.
fn fresh(name: &str, provider: &str, generation: i32) -> StepWrite {
    let mut w = StepWrite::pending(name);
    w.provider = Some(provider.to_owned());
    w.generation = generation;
    w
}

/// The items a pass runs: those due (`due`, as stored or as this pass
/// judged them already), the `known` ones (calls left open) still to
/// run, and any item a lost pass started that left no trace (between
/// the last stored and the last known); the rest are counted in `tally`.
/// The stored items are a prefix of the list (a pass commits all it
/// started), so a known item below the stored `next` has a stored,
/// unfinished run, counted by the store.
fn with_known(
    (s, generation): (&Step, i32),
    (tally, due): (&mut Tally, Vec<crate::domain::StepRun>),
    known: Vec<StepWrite>,
    now: UnixMs,
) -> Vec<StepWrite> {
    let mut known: std::collections::BTreeMap<i64, StepWrite> = known
        .into_iter()
        .filter_map(|w| Some((item_of(&w.step)?.1, w)))
        .collect();
    let mut todo = Vec::new();
    // An item that ended, or is due later, is counted and not run.
    let mut take = |w: StepWrite, tally: &mut Tally| match w.next_run_at {
        _ if crate::domain::pass::is_done(w.state) => tally.add(&w, now),
        Some(t) if t > now => tally.add(&w, now),
        _ => todo.push(w),
    };
    for run in &due {
        let index = item_of(&run.step).map_or(-1, |(_, i)| i);
        let w = known.remove(&index).unwrap_or_else(|| StepWrite::from(run));
        take(w, tally);
    }
    let stored_next = tally.next;
    let top = known
        .keys()
        .next_back()
        .map_or(stored_next, |k| (k + 1).max(stored_next))
        .min(tally.total.max(stored_next));
    for index in stored_next..top {
        if !known.contains_key(&index) {
            take(
                fresh(&item_name(&s.name, index), &s.provider, generation),
                tally,
            );
        }
    }
    for (index, w) in known {
        if index < stored_next {
            // Counted unfinished by the store; counted again here (as
            // started or not: a start the store did not count is counted
            // once, never twice).
            tally.open -= 1;
            tally.started = (tally.started - 1).max(0);
        }
        take(w, tally);
    }
    tally.next = top;
    todo
}

/// The items of child step `s` waiting on their child records, all of
/// them (a child at rest wakes the record: the pass must find it; they
/// are at most `max_parallel` but after a lost pass): those whose child
/// came to rest since join `due`, to be run (the child read again); the
/// rest are counted in `tally`, held. A child that cannot be read puts
/// the step off (a wake would otherwise find it again at once).
async fn with_news(
    i: &super::Inner,
    (record_id, s): (i64, &Step),
    (tally, due): (&mut Tally, &mut Vec<crate::domain::StepRun>),
    now: UnixMs,
) -> Result<(), crate::store::StoreError> {
    let all = i64::try_from(crate::domain::each::MAX_ITEMS).unwrap_or(i64::MAX);
    let held = i.db.held_items(record_id, &s.name, all).await?;
    // Counted unfinished (and started) by the store; counted again here.
    let n = i64::try_from(held.len()).unwrap_or(0);
    tally.open -= n;
    tally.started -= n;
    // Their children, read in one statement.
    let writes: Vec<StepWrite> = held.iter().map(StepWrite::from).collect();
    let ids: Vec<i64> = writes
        .iter()
        .filter_map(crate::domain::child::child_of)
        .collect();
    let states: std::collections::HashMap<i64, crate::domain::RecordState> =
        i.db.get_records(&ids)
            .await?
            .into_iter()
            .map(|r| (r.id, r.state))
            .collect();
    for (run, w) in held.into_iter().zip(writes) {
        let state = crate::domain::child::child_of(&w).and_then(|id| states.get(&id));
        match state.is_some_and(|state| crate::domain::child::has_news(&w, *state)) {
            true => due.push(run),
            false => tally.add(&w, now),
        }
    }
    Ok(())
}

/// The step's run failed with `code` before any item ran (its list is
/// not one).
fn failed(mut write: StepWrite, code: &str, reason: String, now: UnixMs) -> StepOutput {
    write.state = StepState::Failed;
    write.error_code = Some(code.to_owned());
    write.reason = Some(reason);
    write.next_run_at = None;
    write.finished_at = Some(now);
    StepOutput::new(Decision::keep(write))
}

/// The step's run put off to `at` (its items could not be read).
fn put_off(write: StepWrite, why: &str, now: UnixMs) -> Vec<StepOutput> {
    vec![StepOutput::new(Decision::keep(defer(
        write,
        now + 1_000,
        why,
        now,
    )))]
}

/// One pass of for-each step `p` (`each`): the items it runs, each its
/// own step output, then the step's own run, last. `known`: the item
/// runs this pass already judged (calls left open by an earlier pass).
pub(super) async fn run(p: PendingStep<'_>, each: &Each, known: Vec<StepWrite>) -> Vec<StepOutput> {
    let call = &p.call;
    let (i, rec, s, now) = (call.engine, call.record, call.step, call.now);
    if let Some(d) = call.judged() {
        return vec![StepOutput::new(d)];
    }
    let list = match items(each, call.ctx.json()) {
        Ok(list) => list,
        Err((code, reason)) => return vec![failed(call.write.clone(), code, reason, now)],
    };
    let limit = i64::from(each.max_parallel);
    let (mut tally, mut due) = match i.db.items(rec.id, &s.name, now, limit).await {
        Ok(found) => found,
        Err(e) => {
            tracing::warn!(record.id = rec.id, error = %e, "cannot read the step's items");
            return put_off(call.write.clone(), "its items could not be read", now);
        }
    };
    if s.kind.child().is_some() {
        if let Err(e) = with_news(i, (rec.id, s), (&mut tally, &mut due), now).await {
            tracing::warn!(record.id = rec.id, error = %e, "cannot read the step's items");
            return put_off(call.write.clone(), "its items could not be read", now);
        }
    }
    tally.total = i64::try_from(list.len()).unwrap_or(i64::MAX);
    let todo = with_known((s, call.write.generation), (&mut tally, due), known, now);
    let room = each.per_pass().saturating_sub(todo.len());
    let new = usize::try_from(tally.total - tally.next)
        .unwrap_or(0)
        .min(room);
    let first_new = tally.next;
    // Every item this pass may run, made before any runs (the calls
    // borrow them).
    let steps: Vec<Step> = todo
        .iter()
        .filter_map(|w| item_of(&w.step).map(|(_, index)| index))
        .chain((0..new as i64).map(|k| first_new + k))
        .map(|index| item_step(s, each, index))
        .collect();
    let mut outs = run_items(&p, each, list, (&steps, todo), &mut tally).await;
    let ended_at = i.clock.now_ms();
    let mut w = judge(each, call.write.clone(), &tally, ended_at);
    if w.state == StepState::Succeeded {
        match i.db.item_outputs(rec.id, &s.name).await {
            Ok(stored) => {
                let made = outs.iter().filter_map(|o| {
                    let (_, index) = item_of(&o.write.step)?;
                    let out = o.write.output.clone();
                    (o.write.state == StepState::Succeeded)
                        .then(|| (index, out.unwrap_or(Value::Null)))
                });
                w.output = Some(assembled(tally.total, stored.into_iter().chain(made)));
            }
            Err(e) => {
                tracing::warn!(record.id = rec.id, error = %e, "cannot read the items' outputs");
                outs.extend(put_off(
                    call.write.clone(),
                    "its items' outputs could not be read",
                    ended_at,
                ));
                return outs;
            }
        }
    }
    outs.push(StepOutput::new(Decision::keep(w)));
    outs
}

/// Item step `s`'s call, from `write`, as of `at`: its templates see its
/// item of `list` as `item` and its index as `item_index`.
fn start<'b>(
    call: &super::step::StepCall<'b>,
    list: &[Value],
    s: &'b Step,
    write: StepWrite,
    at: UnixMs,
) -> impl std::future::Future<Output = StepOutput> + 'b {
    let index = item_of(&s.name).map_or(0, |(_, index)| index);
    let item = usize::try_from(index).ok().and_then(|k| list.get(k));
    // The pass's context is shared, not copied: an item holds only its
    // own value while it runs.
    let mut pending = step_call(
        call.engine,
        call.record,
        s,
        write,
        &call.ctx,
        &call.templates,
        Vec::new(),
        call.stopping,
    );
    pending.call.item = Some((item.cloned().unwrap_or(Value::Null), index));
    pending.with_now(at)
}

/// Runs the items: those in `todo` at once, then new ones in order (the
/// rest of `steps`) while fewer than `max_parallel` are unfinished, none
/// parked the record and the node is not stopping. Counts each in
/// `tally` as it ends; returns their outputs.
async fn run_items(
    p: &PendingStep<'_>,
    each: &Each,
    list: &[Value],
    (steps, todo): (&[Step], Vec<StepWrite>),
    tally: &mut Tally,
) -> Vec<StepOutput> {
    let call = &p.call;
    let i = call.engine;
    let mut running = FuturesUnordered::new();
    let mut steps = steps.iter();
    // No item runs for a step that can no longer succeed.
    let mut go_on = !tally.lost(each);
    // Items already started run (their call, job or child is out
    // anyway), `max_parallel` at most in this pass: after a lost pass more
    // may be unfinished, and counting those not loaded would leave every
    // pass running none. A run not started yet (made fresh by a retry or
    // a replay) starts only while fewer than `max_parallel` have. The
    // rest wait, counted as due. (No new item starts until fewer than
    // `max_parallel` are unfinished.)
    let cap = i64::from(each.max_parallel);
    for w in todo {
        let Some(s) = steps.next() else { break };
        let under_way = i64::try_from(running.len()).unwrap_or(i64::MAX);
        let room = match crate::domain::each::started(w.attempts, w.job_id.as_deref()) {
            true => under_way < cap,
            false => tally.started + under_way < cap,
        };
        match go_on && room {
            true => running.push(start(call, list, s, w, call.now)),
            false => tally.add(&w, call.now),
        }
    }
    let mut outs = Vec::new();
    loop {
        while go_on
            && tally.open + i64::try_from(running.len()).unwrap_or(i64::MAX)
                < i64::from(each.max_parallel)
            && tally.next < tally.total
        {
            let Some(s) = steps.next() else { break };
            tally.next += 1;
            let w = fresh(&s.name, &s.provider, call.write.generation);
            running.push(start(call, list, s, w, i.clock.now_ms()));
        }
        let Some(out) = running.next().await else {
            break;
        };
        tally.add(&out.write, i.clock.now_ms());
        // No new item once the record parks, the node stops, or the step
        // can no longer succeed.
        go_on &= out.park.is_none() && !out.stopped && !call.stopping.is_set() && !tally.lost(each);
        outs.push(out);
    }
    outs
}

#[cfg(test)]
mod tests {
    use super::*;

    fn step() -> Step {
        let text = r#"
[providers.p]
base_url = "http://127.0.0.1:9"
[[pipelines.fan.steps]]
name = "each"
provider = "p"
for_each = "/input/items"
request = { path = "/x/{{ item }}" }
"#;
        let config = crate::config::Config::parse(text, std::path::Path::new("t.toml")).unwrap();
        let compiled = crate::pipeline::compile(&config).unwrap();
        compiled.pipelines["fan"].steps[0].clone()
    }

    fn left_open(index: i64) -> StepWrite {
        fresh(&item_name("each", index), "p", 2)
    }

    /// A lost pass that started items 3 to 6 left calls open on 3 and 6
    /// only (4 and 5 waited for a permit): all four run again, 4 and 5 as
    /// new runs, and the stored count of unfinished items (3) is not
    /// counted twice.
    #[test]
    fn items_a_lost_pass_started_are_all_run_and_counted_once() {
        let s = step();
        let mut tally = Tally {
            total: 10,
            next: 4,
            succeeded: 3,
            open: 1,
            ..Tally::default()
        };
        let todo = with_known(
            (&s, 2),
            (&mut tally, Vec::new()),
            vec![left_open(6), left_open(3)],
            50,
        );
        let mut names: Vec<&str> = todo.iter().map(|w| w.step.as_str()).collect();
        names.sort_unstable();
        assert_eq!(names, ["each#3", "each#4", "each#5", "each#6"]);
        assert!(todo.iter().all(|w| w.generation == 2));
        assert_eq!((tally.next, tally.open), (7, 0));
    }

    /// An item a pass found ended (an uncertain call failed where only
    /// some items must succeed) is counted, never run again.
    #[test]
    fn an_ended_item_is_never_run_again() {
        let s = step();
        let mut tally = Tally {
            total: 10,
            next: 2,
            succeeded: 1,
            open: 1,
            ..Tally::default()
        };
        let mut failed = left_open(1);
        failed.state = StepState::Failed;
        let todo = with_known((&s, 2), (&mut tally, Vec::new()), vec![failed], 50);
        assert!(todo.is_empty(), "{todo:?}");
        assert_eq!((tally.open, tally.failed, tally.next), (0, 1, 2));
    }
}
