//! A step for each item (`for_each`): one run of the step per item of a
//! list in what its templates see, each a step run of its own named
//! `STEP#INDEX` (its own attempts, idempotency key, intent, permits,
//! breaker verdicts and history lane), at most `max_parallel` of one
//! record unfinished at once. The step's own run stands for them all: it
//! ends when enough items succeeded and the rest ended (its output the
//! items' outputs in item order), or fails once too many failed.

use serde_json::Value;

use super::{StepState, StepWrite, UnixMs};

/// The most items one step runs over.
pub const MAX_ITEMS: usize = 10_000;
/// `max_parallel` when unset.
pub const DEFAULT_PARALLEL: u32 = 10;
/// The most `max_parallel` may be.
pub const MAX_PARALLEL: u32 = 1_000;
/// How many items one pass takes, in multiples of `max_parallel`: the
/// rest wait for the next pass (a pass commits what it did, so a crash
/// never loses more than one pass's items).
const PER_PASS: u32 = 4;

/// What separates a step's name from an item's index (no step name has
/// one).
const SEP: char = '#';

/// A step's `for_each`, compiled.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Each {
    /// A JSON pointer into what the step's templates see (`/input/...`,
    /// `/steps/NAME/output/...`), naming a list.
    pub pointer: String,
    pub max_parallel: u32,
    /// How many items must succeed (`None`: all).
    pub required: Option<u32>,
}

impl Each {
    /// The most items one pass of the step runs.
    pub fn per_pass(&self) -> usize {
        (self.max_parallel.saturating_mul(PER_PASS)) as usize
    }
}

/// The run name of item `index` of step `step`.
pub fn item_name(step: &str, index: i64) -> String {
    format!("{step}{SEP}{index}")
}

/// The step and index an item's run name stands for, when it is one.
pub fn item_of(name: &str) -> Option<(&str, i64)> {
    let (step, index) = name.rsplit_once(SEP)?;
    Some((step, index.parse().ok().filter(|i: &i64| *i >= 0)?))
}

/// The step a run name belongs to: its own, or an item's step.
pub fn step_of(name: &str) -> &str {
    item_of(name).map_or(name, |(s, _)| s)
}

/// The list the step runs over, read from its templates' context; or
/// why there is none (an error code and the evidence).
pub fn items<'v>(each: &Each, ctx: &'v Value) -> Result<&'v [Value], (&'static str, String)> {
    let found = ctx.pointer(&each.pointer).ok_or_else(|| {
        (
            "for_each_missing",
            format!("`for_each = \"{}\"` names nothing", each.pointer),
        )
    })?;
    let list = found.as_array().ok_or_else(|| {
        let kind = match found {
            Value::Null => "null",
            Value::Bool(_) => "a boolean",
            Value::Number(_) => "a number",
            Value::String(_) => "a string",
            Value::Object(_) => "an object",
            Value::Array(_) => "a list",
        };
        (
            "for_each_not_a_list",
            format!("`for_each = \"{}\"` names {kind}, not a list", each.pointer),
        )
    })?;
    if list.len() > MAX_ITEMS {
        return Err((
            "too_many_items",
            format!(
                "`for_each = \"{}\"` names {} items (at most {MAX_ITEMS})",
                each.pointer,
                list.len()
            ),
        ));
    }
    Ok(list)
}

/// Where a step's items stand after a pass.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct Tally {
    /// How many items there are.
    pub total: i64,
    /// The next item not started (items start in order).
    pub next: i64,
    pub succeeded: i64,
    /// Failed (or skipped).
    pub failed: i64,
    /// Not ended (fresh runs to start included).
    pub open: i64,
    /// Of those, the started ones ([`started`]: a call made, a job or a
    /// child): what `max_parallel` bounds.
    pub started: i64,
    /// Some started unfinished item is due now.
    pub due_now: bool,
    /// Some item not started yet (made fresh by a retry or a replay) is
    /// due: it starts once fewer than `max_parallel` have started.
    pub fresh_due: bool,
    /// The earliest time an unfinished item is due, when later.
    pub later_at: Option<UnixMs>,
    /// Some unfinished item waits on a job; some backs off.
    pub waiting: bool,
    pub retrying: bool,
    /// Some unfinished item waits with no time: on its child record
    /// (`domain::child`), which wakes the record when it comes to rest;
    /// and whether one of those children is parked.
    pub held: bool,
    pub child_parked: bool,
}

impl Tally {
    /// Counts an item run a pass left in state `w` (it was unfinished or
    /// new before the pass).
    pub fn add(&mut self, w: &StepWrite, now: UnixMs) {
        match w.state {
            StepState::Succeeded => self.succeeded += 1,
            StepState::Failed | StepState::Skipped => self.failed += 1,
            state => {
                let begun = started(w.attempts, w.job_id.as_deref());
                self.open += 1;
                self.started += i64::from(begun);
                self.retrying |= state == StepState::Retrying;
                match w.next_run_at {
                    None if held(w) => {
                        self.held = true;
                        self.child_parked |= w.error_code.as_deref() == Some(super::child::PARKED);
                    }
                    Some(t) if t > now => {
                        self.waiting |= state == StepState::Waiting;
                        self.later_at = Some(self.later_at.map_or(t, |l| l.min(t)));
                    }
                    _ if begun => self.due_now = true,
                    _ => self.fresh_due = true,
                }
            }
        }
    }

    /// Whether another item may start: one is left, and fewer than
    /// `max_parallel` are unfinished.
    pub fn may_start(&self, each: &Each) -> bool {
        self.next < self.total && self.open < i64::from(each.max_parallel)
    }

    /// Whether the step can no longer succeed: more items failed than
    /// may (or more must succeed than there are).
    pub fn lost(&self, each: &Each) -> bool {
        let need = required(each, self.total);
        need > self.total || self.failed > self.total - need
    }

    /// The step's progress in words (kept as its run's reason).
    pub fn said(&self) -> String {
        format!(
            "{} of {} items done: {} succeeded, {} failed",
            self.succeeded + self.failed,
            self.total,
            self.succeeded,
            self.failed
        )
    }
}

/// Whether an item's run has started: a call made (an attempt), or a job
/// or child record it follows. A run not started (new, or made fresh by a
/// retry or a replay) starts only while fewer than `max_parallel` of the
/// step's items have.
pub fn started(attempts: i32, job_id: Option<&str>) -> bool {
    attempts > 0 || job_id.is_some()
}

/// Whether an item's run waits with no time: on its child record (only
/// the child, coming to rest, tells it something new).
pub fn held(w: &StepWrite) -> bool {
    w.next_run_at.is_none() && super::child::holds(w.state, w.error_code.as_deref())
}

/// How many items must succeed, of `total`.
fn required(each: &Each, total: i64) -> i64 {
    each.required.map_or(total, i64::from)
}

/// What the items' tally makes of the step's run `w`: succeeded once
/// enough items succeeded and the rest ended (its output then given by
/// the caller), failed once too many failed, else unfinished and due
/// when the next item may start or an unfinished one is due.
pub fn judge(each: &Each, mut w: StepWrite, t: &Tally, now: UnixMs) -> StepWrite {
    let need = required(each, t.total);
    w.started_at = w.started_at.or(Some(now));
    w.reason = Some(t.said());
    w.error_code = None;
    if t.lost(each) {
        w.state = StepState::Failed;
        w.error_code = Some("items_failed".into());
        w.reason = Some(match need > t.total {
            true => format!("{} items, fewer than the {need} that must succeed", t.total),
            false => format!("{}; {need} of them must succeed", t.said()),
        });
        w.next_run_at = None;
        w.finished_at = Some(now);
    } else if t.succeeded + t.failed == t.total {
        w.state = StepState::Succeeded;
        w.next_run_at = None;
        w.finished_at = Some(now);
    } else {
        let room = t.started < i64::from(each.max_parallel);
        let now_due = t.due_now || (t.fresh_due && room) || t.may_start(each);
        // Unfinished items have a time or wait on their children (which
        // wake the record); otherwise (never expected) the step looks
        // again a minute on rather than at once.
        w.next_run_at = match now_due {
            true => Some(now),
            false if t.held => t.later_at,
            false => t.later_at.or(Some(now + 60_000)),
        };
        w.state = if now_due {
            StepState::Pending
        } else if t.waiting || t.held {
            StepState::Waiting
        } else {
            StepState::Retrying
        };
        // Waiting on children: the step says so (a parked one first), and
        // the record's commit looks for any that came to rest meanwhile.
        if !now_due && t.held {
            use super::child::{AWAITING, PARKED};
            let (code, why) = match t.child_parked {
                true => (PARKED, "waiting on a parked child"),
                false => (AWAITING, "waiting for child records"),
            };
            w.error_code = Some(code.into());
            w.reason = Some(format!("{why}: {}", t.said()));
        }
    }
    w
}

/// The step's output: each item's output in item order (`null` for an
/// item that did not succeed), from `outputs` (index, output).
pub fn assembled(total: i64, outputs: impl IntoIterator<Item = (i64, Value)>) -> Value {
    let mut all = vec![Value::Null; usize::try_from(total).unwrap_or(0)];
    for (i, v) in outputs {
        if let Some(slot) = usize::try_from(i).ok().and_then(|i| all.get_mut(i)) {
            *slot = v;
        }
    }
    Value::Array(all)
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    fn each(max_parallel: u32, required: Option<u32>) -> Each {
        Each {
            pointer: "/input/items".into(),
            max_parallel,
            required,
        }
    }

    #[test]
    fn item_names_say_their_step_and_index() {
        assert_eq!(item_name("chunks", 7), "chunks#7");
        assert_eq!(item_of("chunks#7"), Some(("chunks", 7)));
        assert_eq!(item_of("chunks"), None);
        assert_eq!(item_of("chunks#x"), None);
        assert_eq!(item_of("chunks#-1"), None);
        assert_eq!(step_of("chunks#12"), "chunks");
        assert_eq!(step_of("undo:pay"), "undo:pay");
    }

    #[test]
    fn the_list_is_read_or_the_step_is_told_why_not() {
        let e = each(2, None);
        let ctx = json!({ "input": { "items": [1, 2] } });
        assert_eq!(items(&e, &ctx).map(<[Value]>::len), Ok(2));
        let code = |ctx: Value| items(&e, &ctx).map(|_| ()).map_err(|(c, _)| c);
        assert_eq!(
            code(json!({ "input": { "items": "a" } })),
            Err("for_each_not_a_list")
        );
        assert_eq!(code(json!({ "input": {} })), Err("for_each_missing"));
        let many = vec![0; MAX_ITEMS + 1];
        assert_eq!(
            code(json!({ "input": { "items": many } })),
            Err("too_many_items")
        );
    }

    fn tally(total: i64, next: i64, succeeded: i64, failed: i64) -> Tally {
        Tally {
            total,
            next,
            succeeded,
            failed,
            open: next - succeeded - failed,
            ..Tally::default()
        }
    }

    #[test]
    fn a_step_succeeds_when_enough_items_did_and_the_rest_ended() {
        let w = StepWrite::pending("s");
        let all = each(2, None);
        assert_eq!(
            judge(&all, w.clone(), &tally(3, 3, 3, 0), 5).state,
            StepState::Succeeded
        );
        let failed = judge(&all, w.clone(), &tally(3, 2, 1, 1), 5);
        assert_eq!(failed.state, StepState::Failed);
        assert_eq!(failed.error_code.as_deref(), Some("items_failed"));
        let two = each(2, Some(2));
        // One failed, two still may succeed: not yet judged.
        let going = judge(&two, w.clone(), &tally(3, 2, 1, 1), 5);
        assert_eq!(
            (going.state, going.next_run_at),
            (StepState::Pending, Some(5))
        );
        assert_eq!(
            judge(&two, w.clone(), &tally(3, 3, 2, 1), 5).state,
            StepState::Succeeded
        );
        // More required than there are items.
        assert_eq!(
            judge(&each(2, Some(4)), w.clone(), &tally(3, 0, 0, 0), 5).state,
            StepState::Failed
        );
        // No items: nothing to wait for.
        assert_eq!(
            judge(&all, w, &tally(0, 0, 0, 0), 5).state,
            StepState::Succeeded
        );
    }

    /// Items waiting on their child records hold the step with no time
    /// (the children wake the record), saying so; a parked one first.
    #[test]
    fn items_on_children_hold_the_step_until_one_comes_to_rest() {
        let e = each(2, None);
        let mut on_child = StepWrite::pending("s#0");
        on_child.state = StepState::Waiting;
        on_child.error_code = Some(crate::domain::child::AWAITING.into());
        let mut t = tally(3, 2, 0, 0);
        t.open = 0;
        t.add(&on_child, 5);
        t.add(&on_child, 5);
        assert!(t.held && !t.due_now, "{t:?}");
        let w = judge(&e, StepWrite::pending("s"), &t, 5);
        assert_eq!((w.state, w.next_run_at), (StepState::Waiting, None));
        assert_eq!(w.error_code.as_deref(), Some("awaiting_child"));
        let mut parked = on_child.clone();
        parked.error_code = Some(crate::domain::child::PARKED.into());
        t.add(&parked, 5);
        let w = judge(&e, StepWrite::pending("s"), &t, 5);
        assert_eq!(w.error_code.as_deref(), Some("child_parked"));
        assert!(w.reason.unwrap().starts_with("waiting on a parked child: "));
        // Another item due later: the step looks then.
        t.later_at = Some(90);
        assert_eq!(
            judge(&e, StepWrite::pending("s"), &t, 5).next_run_at,
            Some(90)
        );
    }

    #[test]
    fn an_unfinished_step_is_due_when_an_item_may_start_or_is_due() {
        let w = StepWrite::pending("s");
        let e = each(2, None);
        // Two open (the cap), backing off until 90.
        let mut t = tally(5, 2, 0, 0);
        t.retrying = true;
        t.later_at = Some(90);
        let later = judge(&e, w.clone(), &t, 5);
        assert_eq!(
            (later.state, later.next_run_at),
            (StepState::Retrying, Some(90))
        );
        t.waiting = true;
        assert_eq!(judge(&e, w.clone(), &t, 5).state, StepState::Waiting);
        // One ended: another may start now.
        let mut t = tally(5, 2, 1, 0);
        t.later_at = Some(90);
        assert_eq!(judge(&e, w, &t, 5).next_run_at, Some(5));
    }

    /// Runs made fresh (a retry, a replay) wait for room: the step is not
    /// due while `max_parallel` items have started, however many wait.
    #[test]
    fn fresh_runs_wait_for_room() {
        let e = each(2, None);
        let mut t = tally(5, 5, 0, 0);
        t.open = 5;
        t.started = 2;
        t.fresh_due = true;
        t.later_at = Some(90);
        let w = judge(&e, StepWrite::pending("s"), &t, 5);
        assert_eq!(w.next_run_at, Some(90), "no room: not due");
        t.started = 1;
        let w = judge(&e, StepWrite::pending("s"), &t, 5);
        assert_eq!(w.next_run_at, Some(5), "room for one: due now");
    }

    #[test]
    fn a_tally_counts_what_a_pass_left() {
        let mut t = Tally::default();
        let mut w = StepWrite::pending("s#0");
        // Not started (made fresh): due once there is room.
        t.add(&w, 10);
        assert!(t.fresh_due && !t.due_now && t.started == 0);
        w.attempts = 1;
        t.add(&w, 10);
        assert!(t.due_now && t.started == 1);
        w.state = StepState::Retrying;
        w.next_run_at = Some(50);
        t.add(&w, 10);
        w.state = StepState::Succeeded;
        t.add(&w, 10);
        assert_eq!(
            (t.open, t.succeeded, t.later_at, t.retrying),
            (3, 1, Some(50), true)
        );
    }

    #[test]
    fn outputs_come_in_item_order_with_nulls_for_the_rest() {
        let out = assembled(3, [(2, json!("c")), (0, json!("a")), (9, json!("x"))]);
        assert_eq!(out, json!(["a", null, "c"]));
    }
}
