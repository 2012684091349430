//! Operator commands: retry, park, resume, cancel and replay a record, the
//! same in bulk, pause and resume a provider, reset its breaker. The pages,
//! the JSON API and the CLI all call [`Ops`], so a command means the same
//! thing, checked the same way, wherever an operator gives it.

use std::sync::Arc;

use serde_json::json;

use super::Engine;
use crate::config::Config;
use crate::domain::kind::Made;
use crate::domain::park::ParkUntil;
use crate::domain::{Clock, OperatorAction, ProviderState, Record, RecordState, StepRun};
use crate::store::{ActionRequest, Db, RecordFilter, StoreError, Took};

/// Why a command was refused, or the store error that stopped it.
#[derive(Debug, thiserror::Error)]
pub enum OpsError {
    /// The command is malformed or not possible here, with a stable code.
    #[error("{message}")]
    Refused { code: &'static str, message: String },
    /// The command names a provider the configuration does not have.
    #[error("unknown provider `{name}` (configured: {configured})")]
    UnknownProvider { name: String, configured: String },
    #[error(transparent)]
    Store(#[from] StoreError),
}

impl OpsError {
    fn refused(code: &'static str, message: impl Into<String>) -> OpsError {
        OpsError::Refused {
            code,
            message: message.into(),
        }
    }
}

impl From<crate::domain::action::Refused> for OpsError {
    fn from(r: crate::domain::action::Refused) -> Self {
        match r {
            crate::domain::action::Refused::Invalid { code, message } => {
                OpsError::Refused { code, message }
            }
            transition => OpsError::Store(transition.into()),
        }
    }
}

/// Which records a bulk command is for.
#[derive(Debug, Clone)]
pub enum Selection {
    /// These ids (duplicates and unknown ids are dropped).
    Ids(Vec<i64>),
    /// Every record the filter matches (its page and cursor are ignored).
    Matching(Box<RecordFilter>),
}

/// What a bulk command found and did.
#[derive(Debug, Default)]
pub struct BulkOutcome {
    /// Records the selection named.
    pub matched: usize,
    /// Those whose state allows the action (acted on when applied).
    pub allowed_ids: Vec<i64>,
    /// Those whose state does not.
    pub refused: usize,
    /// Allowed records the action still failed for, and why.
    pub failed: Vec<(i64, OpsError)>,
}

/// Operator commands over the store and, where this node runs workers, the
/// engine (which knows the pipeline graph for replays and is woken when
/// work becomes due).
#[derive(Clone)]
pub struct Ops<'a> {
    db: &'a Db,
    /// The configuration as it was when the command started (a reload
    /// does not change it under a command).
    config: Arc<Config>,
    engine: Option<&'a Engine>,
    clock: &'a dyn Clock,
}

impl<'a> Ops<'a> {
    pub fn new(
        db: &'a Db,
        config: &Arc<Config>,
        engine: Option<&'a Engine>,
        clock: &'a dyn Clock,
    ) -> Self {
        Ops {
            db,
            config: config.clone(),
            engine,
            clock,
        }
    }

    /// Reads an action's name as the pages, the API and the CLI spell it.
    pub fn parse_action(s: &str) -> Result<OperatorAction, OpsError> {
        s.parse::<OperatorAction>()
            .map_err(|_| OpsError::refused("unknown_action", format!("unknown action `{s}`")))
    }

    /// One action on one record, through the transition table and audited.
    /// Parking needs a reason, and may name when the record resumes by
    /// itself (`until`, see [`Ops::until`]); a replay needs the pipelines
    /// (this node's engine) and `step`, where it starts.
    pub async fn act(
        &self,
        id: i64,
        action: OperatorAction,
        actor: &str,
        reason: Option<String>,
        step: Option<&str>,
        until: Option<&str>,
    ) -> Result<Record, OpsError> {
        let extra = ActExtra {
            step,
            until,
            ..ActExtra::default()
        };
        self.act_with(id, action, actor, reason, extra).await
    }

    /// [`Ops::act`] with all it can carry: a retry or a replay may also
    /// give the record a new input (`extra.input`; the audit entry keeps
    /// the old and the new).
    pub async fn act_with(
        &self,
        id: i64,
        action: OperatorAction,
        actor: &str,
        reason: Option<String>,
        extra: ActExtra<'_>,
    ) -> Result<Record, OpsError> {
        // The store refuses an input with any action but a retry or a
        // replay, inside the record's transaction.
        let ActExtra {
            step,
            until,
            input,
            on_current,
            failed_items,
        } = extra;
        let until = until.map(str::trim).filter(|t| !t.is_empty());
        let command = crate::domain::action::Command {
            reason: reason.is_some(),
            until: until.is_some(),
            on_current,
            failed_items,
        };
        crate::domain::action::check_command(action, &command)?;
        let until = match until {
            // Parked again without saying until when: it keeps what it
            // waits for (`never` clears it).
            None if action == OperatorAction::Park => self
                .db
                .get_record(id)
                .await?
                .filter(|r| r.state == RecordState::Parked)
                .and_then(|r| r.park_until)
                .filter(|u| crate::domain::park::check(u, self.clock.now_ms()).is_ok()),
            None => None,
            Some(text) => self.until(id, text).await?,
        };
        let req = ActionRequest {
            until,
            input,
            // The step it names (a decision's); a replay's and a retry's
            // are worked out from the pipeline.
            steps: step.map(|s| vec![s.to_owned()]).unwrap_or_default(),
            failed_items,
            ..ActionRequest::new(id, action, actor, reason, self.clock.now_ms())
        };
        let rec = match self.engine {
            Some(engine) => act_on(engine, req, step, on_current).await?,
            None if action == OperatorAction::ReplayFrom => {
                return Err(OpsError::refused(
                    "replay_unavailable",
                    "replay needs the pipeline definitions (no pipelines configured)",
                ));
            }
            None => self.db.act(&req).await?,
        };
        tracing::info!(record.id = id, action = %action, actor, "operator action");
        self.family_follows(&rec, action, actor).await;
        Ok(rec)
    }

    /// After an action on `rec`: a cancelled parent cancels its
    /// unfinished children (and theirs), each audited. (A child the
    /// action brought to rest woke its parent in the action's own
    /// transaction.)
    async fn family_follows(&self, rec: &Record, action: OperatorAction, actor: &str) {
        if action != OperatorAction::Cancel || rec.state != RecordState::Cancelled {
            return;
        }
        let reason = format!("cancelled with its parent record {}", rec.id);
        let now = self.clock.now_ms();
        super::child::cancel_family(self.db, rec.id, actor, &reason, now).await;
    }

    /// A signal for step `step` of record `id`: its JSON body becomes the
    /// step's output. With an id (`signal_id`), idempotent: the same
    /// signal again, once taken, changes nothing and answers as the first
    /// did (`SignalTaken::again`). Audited as `signal`, by `actor`.
    pub async fn signal(
        &self,
        id: i64,
        step: &str,
        actor: &str,
        body: serde_json::Value,
        signal_id: Option<String>,
    ) -> Result<SignalTaken, OpsError> {
        let taken = |runs: &[crate::domain::StepRun]| {
            runs.iter().any(|r| {
                r.step == step
                    && r.state == crate::domain::StepState::Succeeded
                    && signal_id.is_some()
                    && r.job_id == signal_id
            })
        };
        let req = ActionRequest {
            steps: vec![step.to_owned()],
            signal: Some(crate::domain::action::Signalled {
                body,
                id: signal_id.clone(),
            }),
            ..ActionRequest::new(id, OperatorAction::Signal, actor, None, self.clock.now_ms())
        };
        match self.db.act(&req).await {
            Ok(record) => {
                if let Some(engine) = self.engine {
                    engine.wake();
                }
                tracing::info!(record.id = id, step, actor, "signal taken");
                Ok(SignalTaken {
                    record,
                    again: false,
                })
            }
            // Refused because the step has its signal: this one (sent
            // again, or twice at once) when the id is the same.
            Err(e) if taken(&self.db.step_runs(id).await?) => {
                tracing::debug!(record.id = id, error = %e, "signal taken by its twin");
                self.signal_again(id).await
            }
            Err(e) => Err(e.into()),
        }
    }

    async fn signal_again(&self, id: i64) -> Result<SignalTaken, OpsError> {
        let record = self.db.get_record(id).await?.ok_or(StoreError::NotFound {
            what: "record",
            key: id.to_string(),
        })?;
        Ok(SignalTaken {
            record,
            again: true,
        })
    }

    /// A call whose outcome was not known (`outcome_uncertain`) did take
    /// effect, the operator found with the provider: a job step follows
    /// the job it made (`job_id`), a request step succeeds with the
    /// outputs the operator read there (`output`, an object of the step's
    /// output names); nothing is sent again. Audited as `took_effect`.
    pub async fn took_effect(
        &self,
        id: i64,
        actor: &str,
        reason: Option<String>,
        job_id: Option<&str>,
        output: Option<serde_json::Value>,
    ) -> Result<Record, OpsError> {
        let rec = self.db.get_record(id).await?.ok_or(StoreError::NotFound {
            what: "record",
            key: id.to_string(),
        })?;
        let engine = self.engine.ok_or_else(|| {
            OpsError::refused("no_workers", "this node runs no workers to check the step")
        })?;
        let mut runs = self.db.step_runs(rec.id).await?;
        runs.extend(super::each::uncertain_items_of(self.db, &rec).await?);
        let run = uncertain_run(engine, &rec, &runs).await?;
        let Some(step) = engine.versions().step_of(&rec, &run.step).await else {
            return Err(OpsError::refused(
                "unknown_step",
                format!("step `{}` is not in the record's pipeline", run.step),
            ));
        };
        let took = self.took(&run, step, job_id, output)?;
        let described = match &took {
            Took::Job(job) => format!("job {job}"),
            Took::Output { output, .. } => format!("outputs {output}"),
        };
        let req = ActionRequest {
            steps: vec![run.step.clone()],
            took: Some(took),
            ..ActionRequest::new(
                id,
                OperatorAction::TookEffect,
                actor,
                reason,
                self.clock.now_ms(),
            )
        };
        let rec = self.db.act(&req).await?;
        engine.wake();
        tracing::info!(
            record.id = id,
            actor,
            took = %described,
            "operator: the call took effect"
        );
        Ok(rec)
    }

    /// What the operator says the call of `run` (a step `step`) made, as
    /// its kind takes it: a job id for a job step, outputs for a request
    /// step (confirmed like any other result).
    fn took(
        &self,
        run: &StepRun,
        step: crate::pipeline::Step,
        job_id: Option<&str>,
        output: Option<serde_json::Value>,
    ) -> Result<Took, OpsError> {
        let job = job_id.map(str::trim).filter(|j| !j.is_empty());
        if job.is_some() && output.is_some() {
            return Err(OpsError::refused(
                "job_id_or_output",
                "say what the call made one way: a job id for a job step, outputs for a request step",
            ));
        }
        let name = &run.step;
        match (step.kind.made(), job) {
            (Made::Job, Some(job)) => Ok(Took::Job(job.to_owned())),
            (Made::Job, None) => Err(OpsError::refused(
                "job_id_required",
                format!("step `{name}` follows a job: name the job the provider made (`job_id`)"),
            )),
            (Made::Output, Some(_)) => Err(OpsError::refused(
                "output_required",
                format!(
                    "step `{name}` makes no job: give its outputs (`output`) instead of a job id"
                ),
            )),
            (Made::Output, None) => Ok(Took::Output {
                output: crate::domain::step::took_outputs(&step.outputs, output).map_err(
                    |why| OpsError::refused("bad_output", format!("step `{name}`: {why}")),
                )?,
                confirm: step.confirm.map(|spec| {
                    crate::domain::confirm::first(
                        run.record_id,
                        name,
                        run.generation,
                        spec,
                        self.clock.now_ms(),
                    )
                }),
            }),
            (Made::Neither(why), _) => Err(OpsError::refused(
                "not_a_job_step",
                format!("step `{name}` {why}"),
            )),
        }
    }

    /// Reads when a record parked now resumes by itself, as an operator
    /// writes it: `never` (a human decides: no condition), `provider`
    /// (once the provider of the record's current step takes calls
    /// again), a duration from now (`2h`, `30m`), or a UTC time
    /// (`2026-12-02T09:00Z`).
    pub async fn until(&self, id: i64, text: &str) -> Result<Option<ParkUntil>, OpsError> {
        let now = self.clock.now_ms();
        let until = match text.trim() {
            "never" => return Ok(None),
            "time" => {
                return Err(OpsError::refused(
                    "bad_until",
                    "give the time to resume at (UTC), or a duration like `2h`",
                ));
            }
            "provider" => {
                let rec = self.db.get_record(id).await?.ok_or(StoreError::NotFound {
                    what: "record",
                    key: id.to_string(),
                })?;
                let provider = rec.provider.unwrap_or_default();
                if !provider.is_empty() && !self.config.providers.contains_key(&provider) {
                    return Err(OpsError::refused(
                        "bad_until",
                        format!(
                            "provider `{provider}` is not configured: nothing would tell when it is healthy"
                        ),
                    ));
                }
                ParkUntil::Provider { provider }
            }
            t if t.starts_with(|c: char| c.is_ascii_digit()) && !t.contains('-') => {
                let d = crate::config::parse_duration(t)
                    .map_err(|e| OpsError::refused("bad_until", e))?;
                let ms = i64::try_from(d.as_millis()).unwrap_or(i64::MAX / 4);
                ParkUntil::Time {
                    at: now.saturating_add(ms),
                }
            }
            t => ParkUntil::Time {
                at: crate::domain::time::parse_utc(t).map_err(|e| {
                    OpsError::refused(
                        "bad_until",
                        format!("{e}; or `never`, `provider`, or a duration like `2h`"),
                    )
                })?,
            },
        };
        crate::domain::park::check(&until, now).map_err(|e| OpsError::refused("bad_until", e))?;
        Ok(Some(until))
    }

    /// The records `selection` names, refused when more than `cap`.
    pub async fn select(&self, selection: Selection, cap: usize) -> Result<Vec<Record>, OpsError> {
        let too_many = |n: String| {
            OpsError::refused(
                "bulk_too_large",
                format!(
                    "{n} records selected; one bulk action may touch at most {cap}. Narrow the filter."
                ),
            )
        };
        let mut out = Vec::new();
        match selection {
            Selection::Matching(mut filter) => {
                filter.limit = crate::store::MAX_PAGE;
                filter.before = None;
                loop {
                    let page = self.db.list_records(&filter).await?;
                    out.extend(page.items);
                    if out.len() > cap {
                        return Err(too_many(format!("more than {cap}")));
                    }
                    match page.next {
                        Some(n) => filter.before = Some(n),
                        None => break,
                    }
                }
            }
            Selection::Ids(mut ids) => {
                ids.sort_unstable();
                ids.dedup();
                if ids.is_empty() {
                    return Err(OpsError::refused(
                        "nothing_selected",
                        "select records first",
                    ));
                }
                if ids.len() > cap {
                    return Err(too_many(ids.len().to_string()));
                }
                for id in ids {
                    if let Some(r) = self.db.get_record(id).await? {
                        out.push(r);
                    }
                }
            }
        }
        Ok(out)
    }

    /// One action on many records: those whose state allows it, counted
    /// (a preview) or, with `apply`, acted on one by one, each audited with
    /// `reason`, which a bulk action always needs.
    pub async fn bulk(
        &self,
        targets: &[Record],
        action: OperatorAction,
        actor: &str,
        reason: &str,
        step: Option<&str>,
        apply: bool,
    ) -> BulkOutcome {
        let (allowed, refused): (Vec<&Record>, Vec<&Record>) = targets
            .iter()
            .partition(|r| crate::domain::action::in_bulk(action, r));
        let mut failed = Vec::new();
        if apply {
            for r in &allowed {
                let done = self
                    .act(r.id, action, actor, Some(reason.to_owned()), step, None)
                    .await;
                if let Err(e) = done {
                    tracing::warn!(record.id = r.id, action = %action, error = ?e, "bulk action refused for one record");
                    failed.push((r.id, e));
                }
            }
            tracing::info!(action = %action, actor, records = allowed.len(), failed = failed.len(), "bulk action");
        }
        BulkOutcome {
            matched: targets.len(),
            allowed_ids: allowed.iter().map(|r| r.id).collect(),
            refused: refused.len(),
            failed,
        }
    }

    /// Pauses (`paused`) or resumes a provider for every node (they see it
    /// within one provider-sync round), audited as `provider_paused` /
    /// `provider_resumed`. A resume wakes this node's workers.
    pub async fn pause_provider(
        &self,
        name: &str,
        paused: bool,
        actor: &str,
        reason: Option<String>,
    ) -> Result<ProviderState, OpsError> {
        self.known(name)?;
        let now = self.clock.now_ms();
        let state = self
            .db
            .set_provider_pause(name, paused, actor, reason.as_deref(), now)
            .await?;
        if let (false, Some(engine)) = (paused, self.engine) {
            engine.wake();
        }
        Ok(state)
    }

    /// Closes a provider's breaker on this node and in the shared state,
    /// audited as `breaker_reset`; needs this node's workers.
    pub async fn reset_breaker(&self, name: &str, actor: &str) -> Result<(), OpsError> {
        self.known(name)?;
        let engine = self
            .engine
            .ok_or_else(|| OpsError::refused("no_workers", "this node runs no workers"))?;
        Ok(reset_breaker(engine, name, actor).await?)
    }

    /// Sends a notice again (one delivered or given up), due now, after
    /// those of its subject before it; audited.
    pub async fn redeliver_notice(
        &self,
        id: i64,
        actor: &str,
    ) -> Result<crate::store::Notice, OpsError> {
        let now = self.clock.now_ms();
        Ok(self.db.redeliver_notice(id, actor, now).await?)
    }

    /// Turns a configured `[[notify]]` subscription on (its failing spell
    /// forgotten; what it missed is sent) or off, for every node; audited.
    pub async fn turn_subscription(
        &self,
        name: &str,
        on: bool,
        actor: &str,
    ) -> Result<crate::store::SubscriptionState, OpsError> {
        if !self.config.notify.iter().any(|n| n.name == name) {
            let m = format!("no subscription `{name}` is configured");
            return Err(OpsError::refused("unknown_subscription", m));
        }
        let now = self.clock.now_ms();
        Ok(self.db.turn_subscription(name, on, actor, now).await?)
    }

    fn known(&self, name: &str) -> Result<(), OpsError> {
        if self.config.providers.contains_key(name) {
            return Ok(());
        }
        let configured = self.config.providers.keys().cloned().collect::<Vec<_>>();
        Err(OpsError::UnknownProvider {
            name: name.to_owned(),
            configured: configured.join(", "),
        })
    }
}

/// A signal taken: the record after it, and whether this was the same
/// signal again (nothing changed).
#[derive(Debug)]
pub struct SignalTaken {
    pub record: Record,
    pub again: bool,
}

/// What an operator action carries beyond its record, action, actor and
/// reason (see [`Ops::act_with`]).
#[derive(Debug, Default)]
pub struct ActExtra<'a> {
    /// Where a replay starts, or the step a decision is about.
    pub step: Option<&'a str>,
    /// For a park: when the record resumes by itself.
    pub until: Option<&'a str>,
    /// For a retry or a replay: the record's input from now on.
    pub input: Option<crate::store::InputEdit>,
    /// For a replay: on the pipeline's current version (the steps from
    /// `step` on as it defines them), the record pinned to it from now;
    /// otherwise on the version the record started with.
    pub on_current: bool,
    /// For a replay from a step for each item: only its items that did
    /// not succeed run again (those that did keep their results).
    pub failed_items: bool,
}

/// An operator action on one record, through the transition table and
/// audited: `req` with its time and steps filled in here. For a replay,
/// `step` names where to start; the steps downstream of it come from
/// the record's pinned pipeline, or (`on_current`) from the current
/// one, which the record is then pinned to.
async fn act_on(
    engine: &Engine,
    mut req: ActionRequest,
    step: Option<&str>,
    on_current: bool,
) -> Result<Record, StoreError> {
    let i = &engine.inner;
    let (record_id, action) = (req.record_id, req.action);
    let mut steps = std::mem::take(&mut req.steps);
    if action == crate::domain::OperatorAction::ReplayFrom {
        steps = replay_steps(engine, &mut req, step, on_current).await?;
    }
    if action == crate::domain::OperatorAction::Retry {
        steps = reversed_and_after(engine, record_id).await?;
    }
    if action == crate::domain::OperatorAction::Undo {
        let rec = i.db.get_record(record_id).await?;
        let runs = i.db.step_runs(record_id).await?;
        if let Some(rec) = rec {
            steps = engine.versions().undo_steps(&rec, &runs).await;
        }
    }
    req.now = i.clock.now_ms();
    req.steps = steps;
    let after = i.db.act(&req).await?;
    if after.next_run_at.is_some() {
        i.wake.notify_one();
    }
    Ok(after)
}

/// The steps a replay of `req`'s record runs: `step` and every step
/// downstream of it, in the record's pinned pipeline or (`on_current`)
/// the current one (`req.repin` then set). Refused for an unknown step,
/// only the failed items of a step that has none, a replay that would
/// leave an undone step as it is, and "current" while the nodes disagree
/// on it.
async fn replay_steps(
    engine: &Engine,
    req: &mut ActionRequest,
    step: Option<&str>,
    on_current: bool,
) -> Result<Vec<String>, StoreError> {
    let i = &engine.inner;
    let record_id = req.record_id;
    let rec =
        i.db.get_record(record_id)
            .await?
            .ok_or(StoreError::NotFound {
                what: "record",
                key: record_id.to_string(),
            })?;
    let Some(step) = step else {
        return Err(StoreError::Invalid(
            "replay needs a step to start from".into(),
        ));
    };
    let compiled = if on_current {
        let current = engine.versions().current(&rec.pipeline).ok_or_else(|| {
            StoreError::Invalid(format!(
                "pipeline `{}` is not configured here: there is no current version",
                rec.pipeline
            ))
        })?;
        // While nodes run different files, "current" depends on
        // the node asked: a record could be moved backwards.
        let nodes = i.db.list_nodes().await?;
        let split = crate::domain::host::config_split(&nodes, i.clock.now_ms());
        if !split.is_empty() {
            let who: Vec<String> = split.iter().map(|(n, v)| format!("{n} runs {v}")).collect();
            return Err(StoreError::Invalid(format!(
                "the nodes run different configurations ({}): reload them with the \
                 same file, then replay on the current version",
                who.join(", ")
            )));
        }
        if rec.pipeline_version != Some(current) {
            req.repin = Some(current);
        }
        // The version and its steps read together (a reload
        // between two reads could pair them wrongly).
        engine.versions().pinned(current)
    } else {
        engine.versions().compiled(&rec).await
    };
    let version = req.repin.or(rec.pipeline_version);
    if req.failed_items
        && compiled
            .as_ref()
            .and_then(|c| c.0.step(step))
            .is_some_and(|s| s.each.is_none())
    {
        return Err(StoreError::Declined {
            code: "items_need_each",
            message: format!(
                "step `{step}` does not run for each item: replay it whole (without \
                 only its failed items)"
            ),
        });
    }
    // Only the failed items: not while one's call is uncertain (a new key
    // would send it again); settled first, as an undo asks.
    if req.failed_items && !i.db.uncertain_items(record_id).await?.is_empty() {
        return Err(StoreError::Declined {
            code: crate::domain::OUTCOME_UNCERTAIN,
            message: "an item's call may have taken effect: settle it first ('it took effect' \
                      or retry), then replay the failed items"
                .into(),
        });
    }
    let undone = undone_steps(i, record_id).await?;
    let steps = compiled.and_then(|c| c.0.from_step(step)).ok_or_else(|| {
        let which = version.map(|v| format!(" version {v}")).unwrap_or_default();
        StoreError::Invalid(format!(
            "pipeline `{}`{which} has no step `{step}`",
            rec.pipeline
        ))
    })?;
    // A replay that would leave an undone step as it is would go on on
    // top of its undone effect.
    if let Some(left) = undone.iter().find(|u| !steps.contains(u)) {
        return Err(StoreError::Declined {
            code: "replay_past_undone",
            message: format!(
                "step `{left}` was undone: replay from it or an earlier step, so that it runs again"
            ),
        });
    }
    Ok(steps)
}

/// The steps a retry runs again for a record parked by a reversal: each
/// step whose result its provider reversed (`REVERSED`) and every step
/// downstream of it, in pipeline order; none otherwise.
async fn reversed_and_after(engine: &Engine, record_id: i64) -> Result<Vec<String>, StoreError> {
    let i = &engine.inner;
    let runs = i.db.step_runs(record_id).await?;
    let reversed: Vec<&str> = runs
        .iter()
        .filter(|r| {
            r.state == crate::domain::StepState::Succeeded
                && r.error_code.as_deref() == Some(crate::domain::REVERSED)
        })
        .map(|r| r.step.as_str())
        .collect();
    if reversed.is_empty() {
        return Ok(Vec::new());
    }
    let Some(rec) = i.db.get_record(record_id).await? else {
        return Ok(Vec::new());
    };
    let Some(compiled) = engine.versions().compiled(&rec).await else {
        return Ok(Vec::new());
    };
    let mut wanted: std::collections::BTreeSet<String> = Default::default();
    for step in reversed {
        wanted.extend(compiled.0.from_step(step).unwrap_or_default());
    }
    Ok(compiled
        .0
        .steps
        .iter()
        .filter(|s| wanted.contains(&s.name))
        .map(|s| s.name.clone())
        .collect())
}

/// Closes a provider's breaker on this node and in the shared state,
/// audited as `breaker_reset`.
async fn reset_breaker(engine: &Engine, name: &str, actor: &str) -> Result<(), StoreError> {
    let i = &engine.inner;
    let Some(rt) = i.provider(name) else {
        return Err(StoreError::NotFound {
            what: "provider",
            key: name.to_owned(),
        });
    };
    let now = i.clock.now_ms();
    rt.breaker().reset(now);
    let op = crate::domain::breaker::SharedOp::Reset;
    i.db.breaker_op(name, op, None, now).await?;
    i.db.append_event(&crate::store::NewEvent {
        record_id: None,
        at: now,
        kind: "breaker_reset".into(),
        actor: actor.to_owned(),
        audit: true,
        step: None,
        reason: None,
        detail: Some(json!({ "provider": name })),
    })
    .await?;
    engine.wake();
    Ok(())
}

/// The one call of `rec` (with its step runs `runs`) whose outcome is
/// uncertain and that an operator may settle: what the record page offers
/// and `took_effect` acts on (see [`crate::domain::action::uncertain_call`]).
pub async fn uncertain_run(
    engine: &Engine,
    rec: &Record,
    runs: &[StepRun],
) -> Result<StepRun, OpsError> {
    let mut looks_up = std::collections::HashSet::new();
    for r in runs
        .iter()
        .filter(|r| crate::domain::action::open_uncertain(r))
    {
        if engine
            .versions()
            .step_of(rec, &r.step)
            .await
            .is_some_and(|s| s.lookup.is_some())
        {
            looks_up.insert(r.step.clone());
        }
    }
    crate::domain::action::uncertain_call(rec, runs, |step| looks_up.contains(step))
        .cloned()
        .map_err(|(code, message)| OpsError::refused(code, message))
}

/// The steps of record `id` that have an undo run (undone, or being
/// undone).
async fn undone_steps(i: &super::Inner, id: i64) -> Result<Vec<String>, StoreError> {
    let runs = i.db.step_runs(id).await?;
    Ok(runs
        .iter()
        .filter_map(|r| crate::domain::undo::undone_step(&r.step).map(str::to_owned))
        .collect())
}
