//! One record's pass: read its steps, start every ready step, start a
//! step's dependants as soon as it succeeds (its output committed first,
//! in a checkpoint), and hand the record's verdict to the committer. What
//! the steps' states mean for the record is `domain::pass`'s decision.

use std::collections::{HashMap, HashSet, VecDeque};
use std::sync::Arc;

use futures_util::StreamExt;
use futures_util::stream::FuturesUnordered;
use tracing::Instrument as _;

use super::step::{self, StepOutput};
use super::{Engine, Inner, NotHere, Stopping};
use crate::domain::pass::{PassFacts, may_start_more, ready, skip_blocked, verdict};
use crate::domain::step::{Decision, Park};
use crate::domain::{Record, StepRun, StepState, UnixMs, WorkResult};
use crate::pipeline::{Pipeline, Step, Templates};
use crate::store::{Commit, Lease, NewAttempt, PendingCallback, StepWrite, StoreError};

/// How long a record whose pipeline version this node cannot run waits
/// before it is tried again (here after a reload, or on another node).
const NOT_HERE_RETRY_MS: i64 = 5_000;

/// A record whose pipeline version this node's configuration cannot run
/// (`why`): while another node may run it or this one may be reloaded
/// (`wait`, `Versions::version_waits`) it is deferred; one no node can run
/// any more waits for a person.
fn version_unavailable(rec: &Record, lease: Lease, why: &str, wait: bool, now: UnixMs) -> Commit {
    let c = if wait {
        let mut c = Commit::new(lease, now, Some(WorkResult::Deferred));
        c.next_run_at = Some(now + NOT_HERE_RETRY_MS);
        c.reason = Some(format!(
            "{why}: waiting for this node's reload (or another node's claim)"
        ));
        c
    } else {
        let mut c = Commit::new(lease, now, Some(WorkResult::Parked));
        c.wake = rec.parent_id;
        c.error_code = Some("version_unavailable".into());
        c.reason = Some(format!(
            "{why}: reload the nodes with a file that has what it needs and resume it, \
             or replay it on the current version"
        ));
        c
    };
    tracing::warn!(
        record.id = rec.id,
        reason = c.reason.as_deref().unwrap_or(""),
        parked = !wait,
        "cannot run its pipeline version here"
    );
    c
}

/// What a pass has done: the steps it changed, what is not yet committed
/// (attempts, applied deliveries), and what it learned on the way.
#[derive(Default)]
struct Progress {
    /// Every step the pass changed (the final commit writes them all).
    changed: Vec<String>,
    /// Attempts not yet committed.
    attempts: Vec<NewAttempt>,
    /// Deliveries applied and not yet committed.
    callbacks_done: Vec<i64>,
    /// Confirmations to schedule, not yet committed.
    confirms: Vec<crate::domain::confirm::Pending>,
    /// Intents whose attempts are in `attempts` (`at_most_once`).
    intents_done: Vec<i64>,
    /// The park the record takes, and the step (and its provider) that
    /// asked for it.
    park: Option<Park>,
    park_at: Option<(String, Option<String>)>,
    breaker: Vec<(String, super::gate::BreakerNews)>,
    throttled: Vec<(String, UnixMs)>,
    stopped: bool,
    /// The pass's last attempt: (step, provider, error code).
    last: Option<(String, Option<String>, Option<String>)>,
    /// The steps whose run may be stored: read with the claim (or by the
    /// pass), or written by a checkpoint (tried: one whose outcome is not
    /// known may have landed). Any other step's run is new: none is
    /// written under another's lease, and an operator acts on no running
    /// record.
    stored: HashSet<String>,
}

impl Progress {
    fn absorb(&mut self, out: StepOutput, states: &mut HashMap<String, StepWrite>) {
        self.stopped |= out.stopped;
        // The first park wins, but one that needs a human wins over one
        // that would resume by itself.
        if let Some(p) = out.park {
            match &self.park {
                Some(first) if first.until.is_none() || p.until.is_some() => {}
                _ => {
                    self.park = Some(p);
                    self.park_at = Some((out.write.step.clone(), out.write.provider.clone()));
                }
            }
        }
        self.breaker.extend(out.breaker);
        self.throttled.extend(out.throttled);
        if let Some(a) = out.attempts.last() {
            self.last = Some((a.step.clone(), a.provider.clone(), a.error_code.clone()));
        }
        self.attempts.extend(out.attempts);
        self.callbacks_done.extend(out.callbacks_done);
        self.confirms.extend(out.confirm);
        self.intents_done.extend(out.intents_done);
        self.changed.push(out.write.step.clone());
        states.insert(out.write.step.clone(), out.write);
    }

    /// A commit of everything so far, with no result (a checkpoint): the
    /// pass keeps what it holds, for its last commit should this one not
    /// land. The steps it writes count as stored from now on, whatever
    /// comes back (a commit whose outcome is not known may have landed).
    fn checkpoint(
        &mut self,
        lease: Lease,
        now: UnixMs,
        states: &HashMap<String, StepWrite>,
    ) -> Commit {
        let mut c = self.commit_of_steps(Commit::new(lease, now, None), states);
        c.attempts = self.attempts.clone();
        c.callbacks_done = self.callbacks_done.clone();
        c.confirms = self.confirms.clone();
        c.intents_done = self.intents_done.clone();
        self.stored.extend(c.new_steps.iter().cloned());
        c
    }

    /// The pass's last commit: what it holds moves into it (not copied).
    fn last_commit(
        &mut self,
        lease: Lease,
        now: UnixMs,
        result: WorkResult,
        states: &HashMap<String, StepWrite>,
    ) -> Commit {
        let mut c = self.commit_of_steps(Commit::new(lease, now, Some(result)), states);
        c.attempts = std::mem::take(&mut self.attempts);
        c.callbacks_done = std::mem::take(&mut self.callbacks_done);
        c.confirms = std::mem::take(&mut self.confirms);
        c.intents_done = std::mem::take(&mut self.intents_done);
        c
    }

    /// `c` with the steps the pass changed and where the record is.
    fn commit_of_steps(&self, mut c: Commit, states: &HashMap<String, StepWrite>) -> Commit {
        let mut changed = self.changed.clone();
        changed.sort();
        changed.dedup();
        c.steps = changed
            .iter()
            .filter_map(|n| states.get(n).cloned())
            .collect();
        // An item's run is read on its own (not with the claim): never
        // taken for new.
        c.new_steps = changed
            .into_iter()
            .filter(|n| !self.stored.contains(n) && crate::domain::each::item_of(n).is_none())
            .collect();
        let result = c.result;
        // A record is at a step (an item's step, for an item: the item
        // itself is found by its state).
        let at = |step: &str| Some(crate::domain::each::step_of(step).to_owned());
        if let Some((step, provider, _)) = &self.last {
            c.step = at(step);
            c.provider = provider.clone();
        }
        // A parked record is at the step that parked it (an outage parks
        // one that may never have made a call).
        if let (Some(WorkResult::Parked), Some((step, provider))) = (result, &self.park_at) {
            c.step = at(step);
            c.provider = provider.clone().or_else(|| c.provider.clone());
        }
        c
    }
}

/// Whether `a` is a call found left open by an earlier pass, stated as an
/// uncertain attempt (no reply, `outcome_uncertain`): the attempts a pass
/// makes itself carry their own verdict's code.
fn restated(a: &NewAttempt) -> bool {
    a.http_status.is_none() && a.error_code.as_deref() == Some(crate::domain::OUTCOME_UNCERTAIN)
}

/// Counts the step runs a committed pass ended: those it settled, and the
/// one that parked the record. A run's length is from its first call (a
/// run parked, then resumed or retried, counts again when it next ends,
/// its length still from that first call).
fn runs_ended(stats: &super::stats::StatsRecorder, commit: &Commit, after: &Record) {
    use super::stats::RunEnd;
    let parked_at = (after.state == crate::domain::RecordState::Parked)
        .then_some(after.step.as_deref())
        .flatten();
    // An item's run is no run of its step (which counts once, ending).
    let steps = commit.steps.iter();
    for w in steps.filter(|w| crate::domain::each::item_of(&w.step).is_none()) {
        let (end, done) = match w.state {
            StepState::Succeeded => (RunEnd::Succeeded, w.finished_at.unwrap_or(commit.now)),
            StepState::Failed => (RunEnd::Failed, w.finished_at.unwrap_or(commit.now)),
            _ if parked_at == Some(w.step.as_str()) => (RunEnd::Parked, commit.now),
            _ => continue,
        };
        let took = done - w.started_at.unwrap_or(done);
        // Filed under the commit's minute, which the recorder still
        // holds (a run finished minutes into a long pass would start a
        // row for a minute already written, and overwrite it).
        let provider = w.provider.as_deref().unwrap_or("");
        stats.run_ended(commit.now, &after.pipeline, &w.step, provider, end, took);
    }
}

impl Engine {
    /// One pass over one leased record; always ends with a commit (or a
    /// dropped result when the lease was lost). `slot` is the record's
    /// place among the node's `max_in_flight`: given up once the pass's
    /// calls are done, so the next record starts while this one waits for
    /// its group commit (a held slot idled through every commit: B, 50 ms
    /// calls, lost that commit's milliseconds per record). The commit and
    /// its follow-ups (late deliveries) run under the `committing` bound
    /// instead. The keeper stops extending the lease before the commit, as
    /// before: a commit that waits longer than the lease (a database stall
    /// with a short `engine.lease`) can find the record claimed again and
    /// is refused as a lost lease.
    pub(super) async fn process(
        &self,
        rec: Record,
        runs: Option<Vec<StepRun>>,
        stopping: &Stopping,
        slot: Option<tokio::sync::OwnedSemaphorePermit>,
    ) {
        // With traces on, the root of the pass's trace: its step runs and
        // calls below it, and the state it left the record in.
        let span = tracing::debug_span!(
            "pass",
            record.id = rec.id,
            pipeline = %rec.pipeline,
            node.id = %self.inner.opts.node_id,
            outcome = tracing::field::Empty,
        );
        let outcome = process_in(&self.inner, rec, runs, stopping, slot)
            .instrument(span.clone())
            .await;
        span.record("outcome", outcome);
    }
}

/// [`Engine::process`] within its span; says how it ended: the record's
/// state after the commit, or why there was none.
async fn process_in(
    i: &Inner,
    rec: Record,
    runs: Option<Vec<StepRun>>,
    stopping: &Stopping,
    slot: Option<tokio::sync::OwnedSemaphorePermit>,
) -> &'static str {
    let Some(lease) = rec.lease() else {
        return "not_leased";
    };
    // A pass is not aborted when its lease is lost: a call already sent is
    // let finish so that its exchange still lands in the history.
    let pass = Pass {
        i,
        rec: &rec,
        lease: lease.clone(),
        stopping,
    };
    let commit = pass.run(runs).await;
    super::leases::forget_lease(i, &lease);
    let Some(commit) = commit else {
        return "dropped";
    };
    // The semaphore is never closed; `None` would only skip the bound.
    let _committing = i.committing.acquire().await.ok();
    drop(slot);
    let Some((commit, result)) = i.committer.commit(commit).await else {
        tracing::error!(
            record.id = rec.id,
            "commit lost with the committer; the lease will expire"
        );
        return "commit_lost";
    };
    match result {
        Ok(after) => {
            committed(i, &rec, &commit, &after).await;
            after.state.as_str()
        }
        Err(StoreError::LeaseLost { record_id }) => {
            lease_lost(i, record_id, &commit).await;
            "lease_lost"
        }
        Err(e) => {
            // The lease will expire and another pass will redo the work;
            // idempotency keys keep that from paying twice.
            tracing::error!(record.id = rec.id, error = %e, "commit failed");
            "commit_failed"
        }
    }
}

/// After a pass's commit: wakes the workers when the record (or its
/// group) has room again, counts what it did, and follows up deliveries
/// its callback steps could not see.
async fn committed(i: &Inner, rec: &Record, commit: &Commit, after: &Record) {
    // A lease of a capped group ended: the group has room again.
    let capped = i
        .setup()
        .group_caps
        .iter()
        .any(|(p, _)| *p == after.pipeline);
    if after.state == crate::domain::RecordState::Pending || capped {
        i.wake.notify_one();
    }
    i.stats.attempts(&after.pipeline, &commit.attempts);
    runs_ended(&i.stats, commit, after);
    if after.state.is_at_rest() {
        i.stats.finished(
            commit.now,
            &after.pipeline,
            after.step.as_deref().unwrap_or(""),
            after.provider.as_deref().unwrap_or(""),
            after.state,
        );
        metrics::counter!(
            "ballast_records_finished_total",
            "pipeline" => after.pipeline.clone(),
            "state" => after.state.as_str(),
        )
        .increment(1);
    }
    super::deliveries::follow_up_deliveries(i, rec, after.state, &commit.steps).await;
    super::child::parent_cancelled(i, after).await;
}

/// A pass whose lease was lost before its commit. Another worker owns the
/// record now: its state is theirs, but the exchanges made are still
/// history. The calls' intents stay open: what they got (a job id, a
/// charge's success) was dropped with the result, so for the record they
/// are calls that went out with no reply kept, which the next pass treats
/// as uncertain instead of sending again.
async fn lease_lost(i: &Inner, record_id: i64, commit: &Commit) {
    tracing::warn!(
        record.id = record_id,
        "lease lost before commit; result dropped, attempts kept, calls left uncertain"
    );
    // The calls this pass found left open and stated as uncertain attempts
    // are not kept here: their intents stay open too, and the next pass
    // states them again.
    let made: Vec<NewAttempt> = commit
        .attempts
        .iter()
        .filter(|a| !restated(a))
        .cloned()
        .collect();
    let kept = i.db.append_attempts(record_id, &made, &[]);
    if let Err(e) = kept.await {
        tracing::warn!(record.id = record_id, error = %e, "could not keep the attempts");
    }
}

/// A commit that defers the record by `after_ms`.
fn deferred(lease: Lease, now: UnixMs, after_ms: i64) -> Commit {
    let mut c = Commit::new(lease, now, Some(WorkResult::Deferred));
    c.next_run_at = Some(now + after_ms);
    c
}

/// A record whose required step failed, in a pipeline that undoes on
/// failure: the undo steps of its succeeded steps are to run first (each
/// a new generation of its run, the commit's `rerun`), and the record
/// goes on to run them; with nothing to undo it fails as `v` says.
fn undo_first(
    whole: &Pipeline,
    v: crate::domain::pass::Verdict,
    states: &HashMap<String, StepWrite>,
    now: UnixMs,
) -> (crate::domain::pass::Verdict, Option<(Vec<String>, String)>) {
    if let Some(waits) = crate::domain::undo::waits(whole, &v, states) {
        return (waits, None);
    }
    let failed = v.step.clone().unwrap_or_default();
    let why = v.reason.clone().unwrap_or_default();
    let names = crate::domain::undo::to_run(whole, states);
    if names.is_empty() {
        return (v, None);
    }
    let undoing = crate::domain::pass::Verdict {
        result: WorkResult::Advanced,
        next_run_at: Some(now),
        step: v.step,
        error_code: Some("undoing".into()),
        reason: Some(format!("undoing: `{failed}` failed ({why})")),
        park_until: None,
    };
    (
        undoing,
        Some((names, format!("undo after `{failed}` failed"))),
    )
}

/// One pass over one leased record.
struct Pass<'a> {
    i: &'a Inner,
    rec: &'a Record,
    lease: Lease,
    stopping: &'a Stopping,
}

impl Pass<'_> {
    /// Works out and runs the record's ready steps; returns what to commit.
    /// A step whose needs are met starts then: when a step succeeds while
    /// its siblings are still out, its output is committed (a checkpoint:
    /// nothing finished is paid for twice) and its ready dependants start
    /// at once instead of waiting for the slowest sibling.
    async fn run(&self, runs: Option<Vec<StepRun>>) -> Option<Commit> {
        let (i, rec) = (self.i, self.rec);
        let now = i.clock.now_ms();
        let (pipeline, templates) = match i.versions().compiled_for(rec).await {
            Ok(c) => c,
            Err(not) => return Some(self.not_here(not, now).await),
        };
        let (mut states, stored) = match self.step_states(&pipeline, runs).await {
            Ok(read) => read,
            Err(e) => {
                tracing::warn!(record.id = rec.id, error = %e, "cannot read steps; deferring");
                return Some(deferred(self.lease.clone(), now, 1000));
            }
        };
        // An undo under way runs its chain of undo steps and nothing else.
        let whole = pipeline.clone();
        let undoing = crate::domain::undo::under_way(&states);
        let pipeline = match undoing {
            true => Arc::new(crate::domain::undo::chain(&whole, &states)),
            false => pipeline,
        };
        let mut progress = Progress {
            changed: skip_blocked(&pipeline.steps, &mut states, now),
            stored,
            ..Progress::default()
        };
        // Calls an earlier pass left open (its node stopped mid-call): it
        // is not known whether they took effect, and nothing else runs.
        if let Err(e) = self
            .open_intents(&pipeline, &mut states, &mut progress, now)
            .await
        {
            tracing::warn!(record.id = rec.id, error = %e, "cannot read open intents; deferring");
            return Some(deferred(self.lease.clone(), now, 1000));
        }
        let steps = (&*pipeline, &templates);
        self.run_steps(steps, &mut states, &mut progress, now).await;
        for (name, news) in &progress.breaker {
            if let Some(rt) = i.provider(name) {
                super::sync::publish_breaker(i, &rt, *news).await;
            }
        }
        for (name, until) in &progress.throttled {
            super::sync::publish_throttle(i, name, *until).await;
        }
        let now = i.clock.now_ms();
        let facts = PassFacts {
            park: progress.park.as_ref(),
            stopped: progress.stopped,
            last_error: progress.last.as_ref().and_then(|l| l.2.as_deref()),
            now,
        };
        let mut v = verdict(&pipeline.steps, &states, &facts);
        let mut rerun = None;
        if undoing {
            let parked_at = progress.park_at.as_ref().map(|(s, _)| s.as_str());
            v = crate::domain::undo::verdict_of(v, &pipeline, parked_at);
        } else if v.result == WorkResult::Failed && whole.undo_on_failure {
            (v, rerun) = undo_first(&whole, v, &states, now);
        }
        let mut commit = progress.last_commit(self.lease.clone(), now, v.result, &states);
        commit.rerun = rerun;
        commit.next_run_at = v.next_run_at;
        if v.step.is_some() {
            commit.step = v.step;
        }
        commit.error_code = v.error_code;
        commit.reason = v.reason;
        commit.park_until = v.park_until;
        commit.wake = super::child::parent_to_wake(rec, v.result);
        commit.awaits_children = states
            .values()
            .any(|w| crate::domain::child::holds(w.state, w.error_code.as_deref()));
        Some(commit)
    }

    /// What to commit for a record whose pipeline version does not run
    /// here.
    async fn not_here(&self, not: NotHere, now: UnixMs) -> Commit {
        let (rec, lease) = (self.rec, self.lease.clone());
        match not {
            NotHere::Unknown => {
                let mut c = Commit::new(lease, now, Some(WorkResult::Parked));
                c.wake = rec.parent_id;
                c.error_code = Some("unknown_pipeline".into());
                c.reason = Some(format!(
                    "pipeline `{}` is not configured on this node",
                    rec.pipeline
                ));
                c
            }
            NotHere::Unread(why) => {
                tracing::warn!(record.id = rec.id, reason = %why, "deferring");
                let mut c = deferred(lease, now, NOT_HERE_RETRY_MS);
                c.reason = Some(why);
                c
            }
            NotHere::Mismatch(why, version) => {
                let wait = self.i.versions().version_waits(version).await;
                version_unavailable(rec, lease, &why, wait, now)
            }
        }
    }

    /// Runs the ready steps as waves: each success while siblings are still
    /// out is checkpointed and starts the steps it made ready.
    async fn run_steps(
        &self,
        (pipeline, templates): (&Pipeline, &Arc<Templates>),
        states: &mut HashMap<String, StepWrite>,
        progress: &mut Progress,
        now: UnixMs,
    ) {
        let (i, rec) = (self.i, self.rec);
        let deliveries = self.deliveries(pipeline, states).await;
        let children = super::child::with_news(i, pipeline, states).await;
        let has_deliveries = |n: &str| deliveries.contains_key(n) || children.contains(n);
        let mut started: HashSet<String> = HashSet::new();
        let mut running = FuturesUnordered::new();
        let mut wave = match progress.park {
            Some(_) => Vec::new(),
            None => ready(&pipeline.steps, states, now, &has_deliveries, &|_| false),
        };
        let mut wave_at = now;
        let mut may_start = true;
        // Steps that ended while a checkpoint was being written.
        let mut finished = VecDeque::new();
        loop {
            // A wave waits for the steps that ended during its checkpoint.
            if !wave.is_empty() && finished.is_empty() {
                let ctx = Arc::new(crate::pipeline::PassContext::new(step::context(
                    rec, states,
                )));
                for s in wave.drain(..) {
                    started.insert(s.name.clone());
                    let write = states[&s.name].clone();
                    let callbacks = deliveries.get(&s.name).cloned().unwrap_or_default();
                    let call =
                        step_call(i, rec, s, write, &ctx, templates, callbacks, self.stopping);
                    running.push(started_step(call, states, wave_at));
                }
            }
            let next = match finished.pop_front() {
                Some(outs) => Some(outs),
                None => running.next().await,
            };
            let Some(outs) = next else {
                break;
            };
            let mut ended = false;
            for out in outs {
                ended = matches!(out.write.state, StepState::Succeeded | StepState::Skipped);
                progress.absorb(out, states);
            }
            // What it ended skips the steps that can no longer run.
            wave_at = i.clock.now_ms();
            let skipped = skip_blocked(&pipeline.steps, states, wave_at);
            progress.changed.extend(skipped);
            // Once the record parks or fails, no step starts (a waiting
            // wave included). Only a success (or a skip) while siblings are
            // still out (running, ended during the checkpoint, or in a
            // waiting wave) starts more in this pass; otherwise the verdict
            // reschedules the record.
            if !may_start_more(&pipeline.steps, states, progress.park.as_ref()) {
                wave.clear();
                continue;
            }
            let out = !running.is_empty() || !finished.is_empty() || !wave.is_empty();
            if !(ended && may_start && out && !self.stopping.is_set()) {
                continue;
            }
            let is_started = |n: &str| started.contains(n);
            wave = ready(
                &pipeline.steps,
                states,
                wave_at,
                &has_deliveries,
                &is_started,
            );
            if !wave.is_empty()
                && !self
                    .checkpoint_beside(states, progress, &mut running, &mut finished)
                    .await
            {
                // Not committed: nothing that needs the step may start.
                wave.clear();
                may_start = false;
            }
        }
    }

    /// Judges the calls an earlier pass left open (`at_most_once`: its
    /// node stopped between writing a call down and keeping its reply):
    /// each becomes an attempt whose outcome is not known, and its step
    /// waits for a person (`domain::step::uncertain_outcome`). Read only
    /// for pipelines with such a provider.
    async fn open_intents(
        &self,
        pipeline: &Pipeline,
        states: &mut HashMap<String, StepWrite>,
        progress: &mut Progress,
        now: UnixMs,
    ) -> Result<(), StoreError> {
        let (i, rec) = (self.i, self.rec);
        // Intents are written only under a lease: a record on its first
        // lease (token 1; only a claim moves it) has none.
        if rec.lease_token <= 1 {
            return Ok(());
        }
        let setup = i.setup();
        let at_most_once = |s: &Step| {
            setup
                .providers
                .get(&s.provider)
                .is_some_and(|rt| s.at_most_once(rt.config.at_most_once))
        };
        let left_open = super::lock(&i.left_open).clone();
        let may_have = |s: &Step| at_most_once(s) || left_open.contains(&s.provider);
        if !pipeline.steps.iter().any(may_have) {
            return Ok(());
        }
        for intent in i.db.open_intents(rec.id).await? {
            let item;
            let (s, write) = match (pipeline.step(&intent.step), states.get(&intent.step)) {
                (Some(s), Some(w)) => (s, w.clone()),
                // An item of a step for each item.
                _ => {
                    let steps = (pipeline.steps.as_slice(), &*states);
                    item = super::each::left_open_item(i, rec.id, steps, &intent.step).await?;
                    match &item {
                        Some((s, w)) => (s, w.clone()),
                        None => continue,
                    }
                }
            };
            let by = intent.node.as_deref().unwrap_or("a node");
            let evidence = format!(
                "sent at {} by {by}, whose pass ended before it kept the result",
                crate::domain::time::format_ms(intent.sent_at)
            );
            // The provider may still be working on it: a lookup asks no
            // sooner than a call's timeout after it left.
            let timeout = setup.providers.get(&s.provider).map_or(0, |rt| {
                i64::try_from(s.call_timeout(rt.config.timeout.0).as_millis()).unwrap_or(i64::MAX)
            });
            let d = crate::domain::step::left_open(
                s,
                write.clone(),
                intent.attempt_no,
                at_most_once(s),
                &evidence,
                (now, intent.sent_at.saturating_add(timeout)),
            );
            let attempt = NewAttempt {
                step: intent.step.clone(),
                provider: intent.provider.clone(),
                attempt_no: intent.attempt_no,
                node: intent.node.clone(),
                started_at: intent.sent_at,
                duration_ms: (now - intent.sent_at).max(0),
                http_status: None,
                outcome: crate::domain::Outcome::Unknown,
                // No status and this code: how `restated` knows it.
                error_code: Some(crate::domain::OUTCOME_UNCERTAIN.into()),
                excerpt: Some(format!("no reply recorded: {evidence}")),
                request: intent.request.clone(),
            };
            progress.absorb(
                StepOutput {
                    attempts: vec![attempt],
                    intents_done: vec![intent.id],
                    ..StepOutput::new(d)
                },
                states,
            );
        }
        // Items the lost pass started without a call left open (waiting
        // for a permit): written now, whatever this pass does next, so a
        // step's items stay a list without holes.
        let steps = (pipeline.steps.as_slice(), &*states);
        for w in super::each::unstarted(i, rec.id, steps, now).await? {
            progress.absorb(StepOutput::new(Decision::keep(w)), states);
        }
        Ok(())
    }

    /// The record's steps as they stand: read with the claim (`runs`) or
    /// now, and a fresh pending run for each step not started yet; and
    /// the steps whose run was read (stored).
    async fn step_states(
        &self,
        pipeline: &Pipeline,
        runs: Option<Vec<StepRun>>,
    ) -> Result<(HashMap<String, StepWrite>, HashSet<String>), StoreError> {
        let runs = match runs {
            Some(runs) => runs,
            None => self.i.db.step_runs(self.rec.id).await?,
        };
        let runs: HashMap<String, StepRun> =
            runs.into_iter().map(|s| (s.step.clone(), s)).collect();
        let stored = runs.keys().cloned().collect();
        let mut states: HashMap<String, StepWrite> = pipeline
            .steps
            .iter()
            .map(|s| {
                let w = runs.get(&s.name).map(StepWrite::from).unwrap_or_else(|| {
                    let mut w = StepWrite::pending(&s.name);
                    // None for a kind that calls no provider.
                    w.provider = Some(s.provider.clone()).filter(|p| !p.is_empty());
                    w
                });
                (s.name.clone(), w)
            })
            .collect();
        // The undo steps' runs, when an undo ever started them.
        for u in &pipeline.undo {
            if let Some(run) = runs.get(&u.name) {
                states.insert(u.name.clone(), StepWrite::from(run));
            }
        }
        Ok((states, stored))
    }

    /// Deliveries waiting for the record's waiting callback steps (they
    /// make those steps ready at once).
    async fn deliveries(
        &self,
        pipeline: &Pipeline,
        states: &HashMap<String, StepWrite>,
    ) -> HashMap<String, Vec<PendingCallback>> {
        let mut found_all = HashMap::new();
        for s in &pipeline.steps {
            let w = &states[&s.name];
            let (Some(_), StepState::Waiting, Some(job)) = (s.callback(), w.state, &w.job_id)
            else {
                continue;
            };
            match self.i.db.pending_callbacks(&s.provider, job).await {
                Ok(found) if !found.is_empty() => {
                    found_all.insert(s.name.clone(), found);
                }
                Ok(_) => {}
                Err(e) => {
                    tracing::warn!(record.id = self.rec.id, error = %e, "cannot read callbacks")
                }
            }
        }
        found_all
    }

    /// [`Self::checkpoint`], while the steps under way go on: a slow
    /// commit does not hold up a sibling's call (its slot taken, its
    /// request sent, a redirect followed or its body read before the
    /// deadline). What they end meanwhile is kept in `finished`, in order.
    async fn checkpoint_beside<'f>(
        &self,
        states: &HashMap<String, StepWrite>,
        progress: &mut Progress,
        running: &mut FuturesUnordered<futures_util::future::BoxFuture<'f, Vec<StepOutput>>>,
        finished: &mut VecDeque<Vec<StepOutput>>,
    ) -> bool {
        let committed = self.checkpoint(states, progress);
        tokio::pin!(committed);
        loop {
            tokio::select! {
                biased;
                ok = &mut committed => return ok,
                Some(outs) = running.next(), if !running.is_empty() => finished.push_back(outs),
            }
        }
    }

    /// Commits what the pass has done so far, keeping the lease; true when
    /// it landed. On failure the uncommitted attempts stay for the final
    /// commit (which a lost lease turns into kept history).
    async fn checkpoint(
        &self,
        states: &HashMap<String, StepWrite>,
        progress: &mut Progress,
    ) -> bool {
        let (i, rec) = (self.i, self.rec);
        let c = progress.checkpoint(self.lease.clone(), i.clock.now_ms(), states);
        match i.committer.commit(c).await {
            Some((c, Ok(_))) => {
                i.stats.attempts(&rec.pipeline, &c.attempts);
                progress.attempts.clear();
                progress.callbacks_done.clear();
                progress.confirms.clear();
                progress.intents_done.clear();
                true
            }
            Some((_, Err(e))) => {
                tracing::warn!(record.id = rec.id, error = %e, "checkpoint not committed");
                false
            }
            None => false,
        }
    }
}

/// One step's call, ready to run.
#[allow(clippy::too_many_arguments)]
pub(super) fn step_call<'a>(
    i: &'a Inner,
    rec: &'a Record,
    s: &'a Step,
    write: StepWrite,
    ctx: &Arc<crate::pipeline::PassContext>,
    templates: &Arc<Templates>,
    callbacks: Vec<PendingCallback>,
    stopping: &'a Stopping,
) -> PendingStep<'a> {
    PendingStep {
        rt: i.provider(&s.provider),
        call: step::StepCall {
            record: rec,
            step: s,
            write,
            ctx: ctx.clone(),
            item: None,
            templates: templates.clone(),
            node: &i.opts.node_id,
            installation: &i.installation,
            clock: &*i.clock,
            db: &i.db,
            intents: &i.intents,
            now: 0,
            callbacks,
            max_wait: i.opts.lease / 4,
            stopping,
            engine: i,
        },
    }
}

/// A step's pass started as of `now`: its outputs (a step for each item
/// gives its items' first, its own last). A step for each item is given
/// the item runs the pass judged already (calls left open).
fn started_step<'a>(
    call: PendingStep<'a>,
    states: &HashMap<String, StepWrite>,
    now: UnixMs,
) -> futures_util::future::BoxFuture<'a, Vec<StepOutput>> {
    use futures_util::FutureExt as _;
    let Some(each) = call.call.step.each.as_ref() else {
        return call.with_now(now).map(|out| vec![out]).boxed();
    };
    let name = call.call.step.name.as_str();
    let known: Vec<StepWrite> = states
        .values()
        .filter(|w| crate::domain::each::item_of(&w.step).is_some_and(|(of, _)| of == name))
        .cloned()
        .collect();
    let mut call = call;
    call.call.now = now;
    super::each::run(call, each, known).boxed()
}

/// A step's call waiting for its start time and its provider's runtime.
pub(super) struct PendingStep<'a> {
    pub(super) rt: Option<Arc<super::limits::ProviderRuntime>>,
    pub(super) call: step::StepCall<'a>,
}

impl<'a> PendingStep<'a> {
    /// Runs the step as of `now`.
    pub(super) async fn with_now(mut self, now: UnixMs) -> StepOutput {
        self.call.now = now;
        let span = tracing::debug_span!(
            "step",
            step = %self.call.step.name,
            provider = %self.call.step.provider,
            outcome = tracing::field::Empty,
        );
        let out = self
            .call
            .execute(self.rt.as_deref())
            .instrument(span.clone())
            .await;
        span.record("outcome", out.write.state.as_str());
        out
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn lease() -> Lease {
        Lease {
            record_id: 1,
            owner: "n".into(),
            token: 1,
        }
    }

    #[test]
    fn a_commit_names_as_new_only_steps_with_no_run_stored_and_no_items() {
        let item = crate::domain::each::item_name("each", 3);
        let names = ["read", "fresh", item.as_str(), "unread"];
        let states: HashMap<String, StepWrite> = names
            .iter()
            .map(|n| (n.to_string(), StepWrite::pending(n)))
            .collect();
        let mut progress = Progress {
            changed: names.iter().map(|n| n.to_string()).collect(),
            stored: HashSet::from(["read".to_owned()]),
            ..Progress::default()
        };
        let c = progress.checkpoint(lease(), 5, &states);
        assert_eq!(c.steps.len(), 4);
        let mut new = c.new_steps.clone();
        new.sort();
        assert_eq!(new, ["fresh", "unread"]);
        // Once a checkpoint has (or may have) written them, they are not new.
        let last = progress.last_commit(lease(), 6, WorkResult::Completed, &states);
        assert!(last.new_steps.is_empty());
        assert_eq!(last.steps.len(), 4);
    }
}
