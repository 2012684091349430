//! Confirmations after success, decided purely: a step with `confirm` asks
//! the provider again after it succeeded (a job step by polling its job, a
//! synchronous step with its own `confirm.path`), and a reply that no
//! longer says success is a reversal. What each reply means, and when to
//! ask next.

use std::time::Duration;

use super::{Outcome, UnixMs};
use crate::domain::pipeline::Confirm;

/// A confirmation still to make, as stored.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Pending {
    pub record_id: i64,
    pub step: String,
    /// The step's generation that succeeded: a later one (a replay) makes
    /// this confirmation moot.
    pub generation: i32,
    pub due_at: UnixMs,
    /// Confirmations left, this one included.
    pub remaining: i32,
    /// Times this confirmation got no clear answer.
    pub tries: i32,
}

/// The first confirmation of a step that succeeded at `at`.
pub fn first(record_id: i64, step: &str, generation: i32, spec: Confirm, at: UnixMs) -> Pending {
    Pending {
        record_id,
        step: step.to_owned(),
        generation,
        due_at: at + ms(spec.after),
        remaining: i32::try_from(spec.times).unwrap_or(i32::MAX),
        tries: 0,
    }
}

/// How often a confirmation with no clear answer is asked again before it
/// is given up (and counted as made, unconfirmed).
pub const MAX_TRIES: i32 = 5;

/// What a confirmation poll's reply means.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Said {
    /// Still success.
    Confirmed,
    /// No longer success: the rules call it `fail`, or the job is back to
    /// `pending` (running again).
    Reversed,
    /// Nothing clear (a transport failure, a 5xx, a throttle, a reply no
    /// rule understood): ask again.
    Unclear,
}

/// What a poll's `outcome` (and its HTTP status) says. Only a 2xx reply
/// can reverse a result: a 401 (a token refused), a 404 (a job the
/// provider purged) or any other error status says nothing about the job,
/// whatever the rules call it.
pub fn said(outcome: Outcome, http_status: Option<i32>) -> Said {
    let answered = http_status.is_some_and(|s| (200..300).contains(&s));
    match outcome {
        Outcome::Success => Said::Confirmed,
        Outcome::Fail | Outcome::Pending if answered => Said::Reversed,
        _ => Said::Unclear,
    }
}

/// What follows a confirmation.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Next {
    /// Ask again (the next confirmation, or this one retried).
    Again(Pending),
    /// All made: nothing left.
    Done,
    /// The provider changed its mind: apply the step's reversal policy.
    Reverse,
    /// This confirmation was given up after [`MAX_TRIES`] unclear answers,
    /// and none is left.
    GaveUp,
}

/// What follows `p` given what its poll `said` at `now`.
pub fn next(p: &Pending, said: Said, spec: Confirm, now: UnixMs) -> Next {
    match said {
        Said::Reversed => Next::Reverse,
        Said::Unclear if p.tries + 1 < MAX_TRIES => Next::Again(Pending {
            due_at: now + retry_ms(spec.after, p.tries),
            tries: p.tries + 1,
            ..p.clone()
        }),
        Said::Unclear | Said::Confirmed if p.remaining > 1 => Next::Again(Pending {
            due_at: now + ms(spec.after),
            remaining: p.remaining - 1,
            tries: 0,
            ..p.clone()
        }),
        Said::Unclear => Next::GaveUp,
        Said::Confirmed => Next::Done,
    }
}

/// The wait before asking again after an unclear answer: a quarter of
/// `after` doubled per try, between 1 s and `after`.
fn retry_ms(after: Duration, tries: i32) -> i64 {
    let base = (ms(after) / 4).max(1_000);
    (base << tries.clamp(0, 10)).min(ms(after).max(1_000))
}

fn ms(d: Duration) -> i64 {
    i64::try_from(d.as_millis()).unwrap_or(i64::MAX / 4)
}

#[cfg(test)]
mod tests {
    use super::*;

    const SPEC: Confirm = Confirm {
        after: Duration::from_secs(30),
        times: 2,
    };

    #[test]
    fn each_confirmation_comes_after_the_last_until_none_is_left() {
        let p = first(1, "render", 0, SPEC, 1_000);
        assert_eq!((p.due_at, p.remaining, p.tries), (31_000, 2, 0));
        let Next::Again(q) = next(&p, Said::Confirmed, SPEC, 31_500) else {
            panic!("a second confirmation")
        };
        assert_eq!((q.due_at, q.remaining), (61_500, 1));
        assert_eq!(next(&q, Said::Confirmed, SPEC, 61_500), Next::Done);
    }

    #[test]
    fn a_reply_that_no_longer_says_success_is_a_reversal() {
        let p = first(1, "render", 0, SPEC, 0);
        for o in [Outcome::Fail, Outcome::Pending] {
            assert_eq!(
                next(&p, said(o, Some(200)), SPEC, 1),
                Next::Reverse,
                "{o:?}"
            );
            // An error status says nothing of the job (a refused token, a
            // purged job), whatever the rules call it.
            for status in [Some(401), Some(404), Some(500), None] {
                assert_eq!(said(o, status), Said::Unclear, "{o:?} {status:?}");
            }
        }
        assert_eq!(said(Outcome::Success, Some(200)), Said::Confirmed);
        for o in [Outcome::Retry, Outcome::Unknown, Outcome::Throttled] {
            assert_eq!(said(o, Some(200)), Said::Unclear, "{o:?}");
        }
    }

    #[test]
    fn unclear_answers_are_asked_again_sooner_then_given_up() {
        let spec = Confirm {
            after: Duration::from_secs(30),
            times: 1,
        };
        let mut p = first(1, "render", 0, spec, 0);
        let mut waits = Vec::new();
        loop {
            match next(&p, Said::Unclear, spec, 100_000) {
                Next::Again(q) => {
                    waits.push(q.due_at - 100_000);
                    p = q;
                }
                other => {
                    assert_eq!(other, Next::GaveUp);
                    break;
                }
            }
        }
        assert_eq!(waits, vec![7_500, 15_000, 30_000, 30_000]);
        // With confirmations left, the next one is asked instead.
        let mut p = first(1, "render", 0, SPEC, 0);
        p.tries = MAX_TRIES - 1;
        let Next::Again(q) = next(&p, Said::Unclear, SPEC, 5) else {
            panic!("the next confirmation")
        };
        assert_eq!((q.remaining, q.tries, q.due_at), (1, 0, 30_005));
    }
}
