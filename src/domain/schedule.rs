//! When scheduled work falls due: a record enqueued for later (`run_at`,
//! `delay`), and the ticks of a pipeline's cron schedule that fire now.

use std::time::Duration;

use serde::{Deserialize, Serialize};

use super::UnixMs;

/// The furthest ahead a record may be enqueued: a year and a month.
pub const MAX_AHEAD: Duration = Duration::from_secs(400 * 86_400);

/// When a record enqueued at `now` falls due: at `run_at` (a UTC moment as
/// [`parse_utc`](super::time::parse_utc) reads it), or `delay` after `now`,
/// or now. Not both; at most [`MAX_AHEAD`] ahead. A moment already past is
/// due now (a late enqueue runs at once, as a queue would).
pub fn due_at(
    run_at: Option<&str>,
    delay: Option<Duration>,
    now: UnixMs,
) -> Result<UnixMs, String> {
    let max = i64::try_from(MAX_AHEAD.as_millis()).unwrap_or(i64::MAX);
    let at = match (run_at.map(str::trim).filter(|t| !t.is_empty()), delay) {
        (Some(_), Some(_)) => {
            return Err("give `run_at` or `delay`, not both".into());
        }
        (Some(text), None) => super::time::parse_utc(text)?,
        (None, Some(d)) => now.saturating_add(i64::try_from(d.as_millis()).unwrap_or(i64::MAX)),
        (None, None) => now,
    };
    if at > now.saturating_add(max) {
        return Err(format!(
            "`{}` is more than {} days ahead",
            super::time::format_ms(at),
            MAX_AHEAD.as_secs() / 86_400
        ));
    }
    Ok(at.max(now))
}

/// A cron expression, read in UTC: five fields (minute, hour, day of
/// month, month, day of week) or six with seconds first, plus the
/// extensions of `croner` (`L`, `#`, `W`, names, `@daily` …).
#[derive(Debug, Clone)]
pub struct Cron {
    cron: croner::Cron,
    text: String,
}

impl Cron {
    pub fn parse(text: &str) -> Result<Cron, String> {
        use croner::parser::{CronParser, Seconds, Year};
        let text = text.trim();
        // Five or six fields, no year: a schedule that runs out is a
        // mistake waiting to happen.
        let cron = CronParser::builder()
            .seconds(Seconds::Optional)
            .year(Year::Disallowed)
            .build()
            .parse(text)
            .map_err(|e| format!("`{text}` is not a cron expression: {e}"))?;
        let parsed = Cron {
            cron,
            text: text.to_owned(),
        };
        // One that never fires (`0 0 31 2 *`) is a mistake, not a schedule.
        if parsed.next_after(0).is_none() {
            return Err(format!("`{text}` never fires"));
        }
        Ok(parsed)
    }

    pub fn as_str(&self) -> &str {
        &self.text
    }

    /// The first tick strictly after `t`.
    pub fn next_after(&self, t: UnixMs) -> Option<UnixMs> {
        // Ticks are whole seconds: after `t` is after its second.
        let at = chrono::DateTime::from_timestamp_millis(t - t.rem_euclid(1_000))?;
        let next = self.cron.find_next_occurrence(&at, false).ok()?;
        Some(next.timestamp_millis())
    }

    /// The last tick at or before `t`.
    pub fn last_at_or_before(&self, t: UnixMs) -> Option<UnixMs> {
        let at = chrono::DateTime::from_timestamp_millis(t - t.rem_euclid(1_000))?;
        let prev = self.cron.find_previous_occurrence(&at, true).ok()?;
        Some(prev.timestamp_millis())
    }
}

/// What happens to the ticks that passed while no node was running.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum Missed {
    /// However many were missed, the latest fires once.
    #[default]
    FireOnce,
    /// None fires; the schedule goes on from the next tick.
    Skip,
}

/// How late a tick may fire and still be on time: a node that was
/// briefly busy or cut off from the database fires each tick it owes;
/// older ones were missed.
pub const ON_TIME_MS: UnixMs = 60_000;

/// The most on-time ticks fired in one pass (a cron with seconds fires at
/// most once a second, so a minute holds at most 60).
const MAX_ON_TIME: usize = 60;

/// What a pass over one schedule does at `now`.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Plan {
    /// The ticks to fire, oldest first: a record each, keyed by its tick.
    pub fire: Vec<UnixMs>,
    /// The latest missed tick when `missed = "skip"` left it unfired.
    pub skipped: Option<UnixMs>,
    /// Every tick at or before this one has been dealt with.
    pub watermark: UnixMs,
}

/// The ticks of `cron` to fire at `now`, given the stored watermark (every
/// tick at or before it was dealt with; none: the schedule is new, and
/// begins now rather than firing its past). Ticks within [`ON_TIME_MS`]
/// of `now` fire each; older ones since the watermark were missed (every
/// node was down) and fire once, or not, as `missed` says.
pub fn plan(cron: &Cron, watermark: Option<UnixMs>, now: UnixMs, missed: Missed) -> Plan {
    let Some(w) = watermark else {
        return Plan {
            fire: Vec::new(),
            skipped: None,
            watermark: now,
        };
    };
    let mut plan = Plan {
        fire: Vec::new(),
        skipped: None,
        watermark: w.max(now),
    };
    if now <= w {
        return plan;
    }
    let on_time_from = w.max(now - ON_TIME_MS);
    if on_time_from > w {
        let late = cron.last_at_or_before(on_time_from).filter(|&t| t > w);
        match (late, missed) {
            (Some(t), Missed::FireOnce) => plan.fire.push(t),
            (Some(t), Missed::Skip) => plan.skipped = Some(t),
            (None, _) => {}
        }
    }
    let mut t = on_time_from;
    let mut on_time = 0;
    while let Some(next) = cron.next_after(t).filter(|&n| n <= now) {
        if on_time >= MAX_ON_TIME {
            // The rest waits for the next pass: the watermark stops at the
            // last tick planned, so none is passed over.
            plan.watermark = t;
            break;
        }
        plan.fire.push(next);
        on_time += 1;
        t = next;
    }
    plan
}

/// A key a person or a client gives a record: 1–200 characters, and not
/// one of the keys schedules fire by (a record keyed `schedule:<tick>`
/// would take that tick's place, with another input).
pub fn check_key(key: &str) -> Result<(), String> {
    if key.is_empty() || key.len() > 200 {
        return Err("key must be 1-200 characters".into());
    }
    if key.starts_with(TICK_PREFIX) {
        return Err(format!(
            "keys starting `{TICK_PREFIX}` are kept for cron schedules"
        ));
    }
    if key.starts_with(crate::domain::trigger::KEY_PREFIX) {
        return Err(format!(
            "keys starting `{}` are kept for triggers",
            crate::domain::trigger::KEY_PREFIX
        ));
    }
    Ok(())
}

const TICK_PREFIX: &str = "schedule:";

/// The external key of the record a tick fires: two nodes firing one tick
/// name one record.
pub fn tick_key(tick: UnixMs) -> String {
    format!("{TICK_PREFIX}{}", super::time::format_ms(tick))
}

#[cfg(test)]
mod tests {
    use super::*;

    const NOW: UnixMs = 1_764_662_400_000; // 2025-12-02T08:00:00Z

    #[test]
    fn a_record_falls_due_at_its_time_after_its_delay_or_now() {
        assert_eq!(due_at(None, None, NOW), Ok(NOW));
        assert_eq!(
            due_at(None, Some(Duration::from_secs(7_200)), NOW),
            Ok(NOW + 7_200_000)
        );
        assert_eq!(
            due_at(Some("2025-12-02T09:30Z"), None, NOW),
            Ok(NOW + 90 * 60_000)
        );
        // Late: due now. Blank: no time given.
        assert_eq!(due_at(Some("2025-12-01T09:30Z"), None, NOW), Ok(NOW));
        assert_eq!(due_at(Some("  "), None, NOW), Ok(NOW));
    }

    #[test]
    fn both_a_bad_time_or_too_far_ahead_is_refused() {
        let both = due_at(Some("2025-12-02T09:30Z"), Some(Duration::from_secs(1)), NOW);
        assert!(both.is_err_and(|e| e.contains("not both")));
        assert!(due_at(Some("tomorrow"), None, NOW).is_err_and(|e| e.contains("invalid time")));
        let far = due_at(None, Some(MAX_AHEAD + Duration::from_secs(86_400)), NOW);
        assert!(far.is_err_and(|e| e.contains("400 days")));
        assert!(due_at(None, Some(MAX_AHEAD), NOW).is_ok());
    }

    fn cron(text: &str) -> Cron {
        Cron::parse(text).unwrap()
    }

    const S: UnixMs = 1_000;

    #[test]
    fn cron_reads_five_or_six_fields_and_refuses_nonsense() {
        let six = cron("*/10 * * * * *");
        assert_eq!(six.next_after(NOW), Some(NOW + 10 * S));
        assert_eq!(six.last_at_or_before(NOW), Some(NOW));
        assert_eq!(six.last_at_or_before(NOW + 9 * S), Some(NOW));
        let five = cron(" 0 */6 * * * ");
        assert_eq!(five.as_str(), "0 */6 * * *");
        // 08:00 -> 12:00
        assert_eq!(five.next_after(NOW), Some(NOW + 4 * 3_600 * S));
        assert!(Cron::parse("every day").is_err_and(|e| e.contains("not a cron expression")));
        assert!(Cron::parse("0 0 31 2 *").is_err_and(|e| e.contains("never fires")));
        // A year field is refused: five or six fields.
        assert!(
            Cron::parse("0 0 0 1 1 * 2024").is_err_and(|e| e.contains("not a cron expression"))
        );
    }

    #[test]
    fn a_new_schedule_begins_now_and_then_fires_each_tick_once() {
        let c = cron("* * * * * *");
        let p = plan(&c, None, NOW + 500, Missed::FireOnce);
        assert_eq!(p.fire, Vec::<UnixMs>::new());
        assert_eq!(p.watermark, NOW + 500);
        let p = plan(&c, Some(NOW + 500), NOW + 1_200, Missed::FireOnce);
        assert_eq!(p.fire, vec![NOW + S]);
        assert_eq!(p.watermark, NOW + 1_200);
        // Nothing new: nothing fires, twice.
        let again = plan(&c, Some(p.watermark), NOW + 1_900, Missed::FireOnce);
        assert!(again.fire.is_empty());
        // A node whose clock is behind the watermark fires nothing and
        // keeps the watermark where it was.
        let behind = plan(&c, Some(NOW + 1_900), NOW + 1_000, Missed::FireOnce);
        assert!(behind.fire.is_empty());
        assert_eq!(behind.watermark, NOW + 1_900);
    }

    #[test]
    fn a_short_stall_fires_every_tick_it_owes() {
        let c = cron("* * * * * *");
        // 30 seconds without a pass: all 30 ticks are on time.
        let p = plan(&c, Some(NOW), NOW + 30 * S, Missed::Skip);
        assert_eq!(p.fire, (1..=30).map(|i| NOW + i * S).collect::<Vec<_>>());
        assert_eq!(p.skipped, None);
    }

    #[test]
    fn ticks_missed_while_every_node_was_down_fire_once_or_not_at_all() {
        let c = cron("0 */6 * * *"); // 00, 06, 12, 18 UTC
        let down = NOW - 3_600 * S; // 07:00, one hour before an 08:00
        let up = NOW + 11 * 3_600 * S; // 19:00: 12:00 and 18:00 were missed
        let once = plan(&c, Some(down), up, Missed::FireOnce);
        assert_eq!(once.fire, vec![NOW + 10 * 3_600 * S]); // 18:00, once
        assert_eq!(once.watermark, up);
        let skip = plan(&c, Some(down), up, Missed::Skip);
        assert!(skip.fire.is_empty());
        assert_eq!(skip.skipped, Some(NOW + 10 * 3_600 * S));
        // Up again 30 s after 18:00: on time, fired either way.
        let just = NOW + 10 * 3_600 * S + 30 * S;
        assert_eq!(
            plan(&c, Some(down), just, Missed::Skip).fire,
            vec![NOW + 10 * 3_600 * S]
        );
        // Missed ones and an on-time one: the latest missed once, then it.
        let s = cron("*/10 * * * * *");
        let p = plan(&s, Some(NOW), NOW + 125 * S, Missed::FireOnce);
        let on_time: Vec<_> = [70, 80, 90, 100, 110, 120].map(|i| NOW + i * S).into();
        assert_eq!(p.fire[0], NOW + 60 * S);
        assert_eq!(&p.fire[1..], on_time.as_slice());
    }

    #[test]
    fn a_gap_before_a_tick_a_second_loses_no_tick() {
        // Two minutes down, then up on a whole second: the latest missed
        // tick once, and every tick of the last minute, the newest too.
        let c = cron("* * * * * *");
        let p = plan(&c, Some(NOW), NOW + 120 * S, Missed::FireOnce);
        assert_eq!(p.fire[0], NOW + 60 * S);
        let on_time: Vec<_> = (61..=120).map(|i| NOW + i * S).collect();
        assert_eq!(&p.fire[1..], on_time.as_slice());
        assert_eq!(p.watermark, NOW + 120 * S);
    }

    #[test]
    fn a_tick_key_names_its_moment_and_is_nobody_elses() {
        assert_eq!(tick_key(NOW), "schedule:2025-12-02T08:00:00.000Z");
        assert!(check_key(&tick_key(NOW)).is_err());
        assert!(check_key("").is_err());
        assert!(check_key(&"k".repeat(201)).is_err());
        assert_eq!(check_key("order-42"), Ok(()));
        assert_eq!(check_key("schedules-are-fine"), Ok(()));
    }
}
