//! Word search over records: how a query's words become each backend's
//! full-text query, and how the search indexer knows which events it has
//! read ([`Progress`]).
//!
//! The same tokenizer reads a record's text and the query (SQLite FTS5's
//! `unicode61`, PostgreSQL's `simple` configuration), so each backend
//! matches its own way of cutting words: every word of the query must be
//! in the record, whole, or as the start of a longer one when it ends in
//! `*` (`ali*` finds `alice`; at least three characters before the `*`).
//! Prefixes are asked for, not implied: a short prefix of many distinct
//! words (`ord*` of a million order ids) is the slowest query there is.

use std::collections::BTreeMap;

use super::UnixMs;

/// A search document's digest, kept beside it where the index cannot give
/// the document back (SQLite's contentless FTS5 table), so that a document
/// whose words did not change is not written again: the first eight bytes
/// of its SHA-256.
pub fn digest(doc: &[u8]) -> i64 {
    use sha2::Digest;
    let hash = sha2::Sha256::digest(doc);
    let mut first = [0u8; 8];
    first.copy_from_slice(&hash[..8]);
    i64::from_be_bytes(first)
}

/// Words of a query beyond this many are ignored.
pub const MAX_WORDS: usize = 8;
/// A word's characters beyond this many are ignored.
const MAX_WORD_CHARS: usize = 64;
/// A word ending in `*` matches as a prefix if it ends in this many
/// letters or digits before the `*`; shorter ones match whole.
const PREFIX_FROM: usize = 3;

/// The words of a query: cut at whitespace, those with a letter or a
/// digit, at most [`MAX_WORDS`] of at most 64 characters each.
/// Control characters (a NUL among them, which neither backend takes in
/// a query) are dropped; a word cut short becomes a prefix.
pub fn words(q: &str) -> Vec<String> {
    q.split_whitespace()
        .map(|w| w.chars().filter(|c| !c.is_control()).collect::<String>())
        .filter(|w| w.chars().any(char::is_alphanumeric))
        .take(MAX_WORDS)
        .map(|w| {
            if w.chars().count() > MAX_WORD_CHARS {
                let mut cut: String = w.chars().take(MAX_WORD_CHARS).collect();
                cut.push('*');
                cut
            } else {
                w
            }
        })
        .collect()
}

/// A word without its trailing `*`s, and whether it is a prefix.
fn prefix(w: &str) -> (&str, bool) {
    let stem = w.trim_end_matches('*');
    // The tokenizer puts the `*` on the last part of the word only
    // (`ab-c*` asks for words starting with `c`): that part must be long.
    let last = stem
        .chars()
        .rev()
        .take_while(|c| c.is_alphanumeric())
        .count();
    let long = last >= PREFIX_FROM;
    (stem, stem.len() < w.len() && long)
}

/// The query as SQLite FTS5 reads it: each word a quoted string (FTS5
/// cuts it as it cut the records), all of them required. `None`: no words.
pub fn fts5_query(q: &str) -> Option<String> {
    let terms: Vec<String> = words(q)
        .iter()
        .map(|w| {
            let (w, prefix) = prefix(w);
            let star = if prefix { "*" } else { "" };
            format!("\"{}\"{star}", w.replace('"', "\"\""))
        })
        .collect();
    (!terms.is_empty()).then(|| terms.join(" "))
}

/// The query as PostgreSQL's `to_tsquery('simple', ..)` reads it: each
/// word a quoted lexeme (cut by the same parser as the records), all of
/// them required. `None`: no words.
pub fn tsquery(q: &str) -> Option<String> {
    let terms: Vec<String> = words(q)
        .iter()
        .map(|w| {
            let (w, prefix) = prefix(w);
            let star = if prefix { ":*" } else { "" };
            let quoted = w.replace('\\', "\\\\").replace('\'', "''");
            format!("'{quoted}'{star}")
        })
        .collect();
    (!terms.is_empty()).then(|| terms.join(" & "))
}

/// On PostgreSQL, how many of the newest documents a search reads in id
/// order before it asks the word index for the rest (`History::search_records`).
pub const NEWEST_FIRST: i64 = 10_000;

/// Events the indexer keeps looking for at most this long after it first
/// missed them (a transaction that long is long gone: rolled back).
pub const GIVE_UP_MS: i64 = 10 * 60_000;
/// Missed events it keeps looking for at once, at most.
pub const MAX_GAPS: usize = 100_000;

/// An event as the search indexer reads it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct SeenEvent {
    pub id: i64,
    /// The record it is about (none: an operator's action on no record).
    pub record: Option<i64>,
    /// When it was written.
    pub at: UnixMs,
}

/// How long the indexer leaves a new event before reading it: a record's
/// burst of events (created, claimed, finished within seconds) is then
/// read together and its document written once, not once per event.
pub const LAG_MS: i64 = 5_000;

/// How many of `fresh` (new events in id order) the indexer reads now:
/// those up to the first written less than [`LAG_MS`] before `now`. A node
/// whose clock runs ahead stamps events in the future: the indexer waits
/// for such an event (`waiting`: its id, and since when by this node's
/// clock) at most [`LAG_MS`] of its own time, then reads on.
pub fn ripe(fresh: &[SeenEvent], now: UnixMs, waiting: &mut Option<(i64, UnixMs)>) -> usize {
    for (n, e) in fresh.iter().enumerate() {
        if e.at <= now - LAG_MS {
            continue;
        }
        match *waiting {
            Some((id, since)) if id == e.id && now - since >= LAG_MS => continue,
            Some((id, _)) if id == e.id => return n,
            _ => {
                *waiting = Some((e.id, now));
                return n;
            }
        }
    }
    fresh.len()
}

/// Which events the search indexer has read.
///
/// Event ids are taken when a transaction writes its events and seen by
/// others when it commits: on PostgreSQL, whose transactions commit side
/// by side, an event may appear after one with a higher id. So the
/// indexer reads on from the highest id it has read (`seen`) and also
/// looks again for each id below it that it has not read (`gaps`) until
/// it appears, or until it is [`GIVE_UP_MS`] old (it was rolled back, or
/// its record purged). A gap counts from when the indexer first met it;
/// one below an event written longer than that ago is given up at once
/// (an id is taken before a higher one, so a transaction holding it has
/// been open that long): the holes an indexer meets reading old events
/// (records purged since) cost nothing. What is stored between runs is [`settled`]: every
/// event up to it has been read or given up on, so a node that takes the
/// indexer over reads on from there and misses nothing (reading an
/// event twice only indexes its record again).
///
/// [`settled`]: Progress::settled
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct Progress {
    seen: i64,
    gaps: BTreeMap<i64, UnixMs>,
}

impl Progress {
    /// Reading on from a stored [`settled`](Self::settled).
    pub fn from_settled(settled: i64) -> Self {
        Progress {
            seen: settled,
            gaps: BTreeMap::new(),
        }
    }

    /// The highest event id read.
    pub fn seen(&self) -> i64 {
        self.seen
    }

    /// Ids below [`seen`](Self::seen) not read yet, lowest first.
    pub fn gaps(&self) -> Vec<i64> {
        self.gaps.keys().copied().collect()
    }

    /// Every event up to this id has been read or given up on.
    pub fn settled(&self) -> i64 {
        self.gaps.keys().next().map_or(self.seen, |g| g - 1)
    }

    /// Takes note of what a read returned at `now`: `events`, those read
    /// above `seen` and those of the gaps that have appeared, in any
    /// order. Ids skipped over become gaps (at most [`MAX_GAPS`]: the
    /// lowest give way to newer ones, the likelier commits in flight);
    /// gaps [`GIVE_UP_MS`] old are given up.
    pub fn observe(&mut self, events: &[SeenEvent], now: UnixMs) {
        self.gaps
            .retain(|_, since| now.saturating_sub(*since) < GIVE_UP_MS);
        let mut events = events.to_vec();
        events.sort_unstable_by_key(|e| e.id);
        events.dedup_by_key(|e| e.id);
        for e in events {
            if e.id <= self.seen {
                self.gaps.remove(&e.id);
                continue;
            }
            // An old event's hole is as old as it; a recent one's counts
            // from now (its `at` may be a late commit's, or a slow clock's).
            let since = if now.saturating_sub(e.at) >= GIVE_UP_MS {
                e.at
            } else {
                now
            };
            let from = (self.seen + 1).max(e.id - MAX_GAPS as i64);
            for missed in from..e.id {
                self.gaps.insert(missed, since);
            }
            // Room for the newest: the lowest (oldest) holes go first.
            while self.gaps.len() > MAX_GAPS {
                self.gaps.pop_first();
            }
            self.seen = e.id;
        }
        self.gaps
            .retain(|_, since| now.saturating_sub(*since) < GIVE_UP_MS);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The digest is the first eight bytes of SHA-256, the same for the
    /// same text and different for another (so a document's digest stays
    /// comparable across versions of this binary).
    #[test]
    fn a_documents_digest_is_its_sha256_head() {
        assert_eq!(
            digest(b""),
            i64::from_be_bytes(*b"\xe3\xb0\xc4\x42\x98\xfc\x1c\x14")
        );
        assert_eq!(digest(b"lisbon ana"), digest(b"lisbon ana"));
        assert_ne!(digest(b"lisbon ana"), digest(b"lisbon ana "));
    }

    #[test]
    fn words_are_quoted_for_each_backend() {
        assert_eq!(fts5_query("  "), None);
        assert_eq!(fts5_query("-- ::"), None);
        assert_eq!(
            fts5_query("alice@example.com Oslo ali* ab*"),
            Some("\"alice@example.com\" \"Oslo\" \"ali\"* \"ab\"".into())
        );
        assert_eq!(fts5_query("say\"x"), Some("\"say\"\"x\"".into()));
        assert_eq!(
            tsquery("o'brien* a\\b x"),
            Some("'o''brien':* & 'a\\\\b' & 'x'".into())
        );
        assert_eq!(tsquery("..."), None);
        let many = "w ".repeat(20);
        assert_eq!(words(&many).len(), MAX_WORDS);
        // Cut short: the first 64 characters, as a prefix.
        let long = words(&"é".repeat(100)).remove(0);
        assert_eq!(long, format!("{}*", "é".repeat(64)));
        assert_eq!(fts5_query(&long), Some(format!("\"{}\"*", "é".repeat(64))));
        // A NUL (from a URL's %00) is dropped, not sent.
        assert_eq!(fts5_query("a\0b \0"), Some("\"ab\"".into()));
        assert_eq!(tsquery("\u{1}"), None);
        // The prefix is the last part's: `ab-c*` would ask for `c*`.
        assert_eq!(
            fts5_query("ab-c* 12.345*"),
            Some("\"ab-c\" \"12.345\"*".into())
        );
    }

    fn at(ids: &[i64], at: UnixMs) -> Vec<SeenEvent> {
        ids.iter()
            .map(|&id| SeenEvent {
                id,
                record: Some(id),
                at,
            })
            .collect()
    }

    #[test]
    fn progress_reads_late_events_and_gives_up_on_lost_ones() {
        let mut p = Progress::from_settled(10);
        // 11 and 12 are still being committed when 13 and 14 appear.
        p.observe(&at(&[14, 13], 1_000), 1_000);
        assert_eq!((p.seen(), p.settled(), p.gaps()), (14, 10, vec![11, 12]));
        // 12 appears; 11 never does (rolled back).
        p.observe(&at(&[12, 15], 2_000), 2_000);
        assert_eq!((p.seen(), p.settled(), p.gaps()), (15, 10, vec![11]));
        p.observe(&[], 1_000 + GIVE_UP_MS - 1);
        assert_eq!(p.settled(), 10);
        p.observe(&[], 1_000 + GIVE_UP_MS);
        assert_eq!((p.settled(), p.gaps()), (15, vec![]));
        // A read that returns ids already read changes nothing.
        p.observe(&at(&[15, 14], 1), 9_000_000);
        assert_eq!((p.seen(), p.settled()), (15, 15));
    }

    #[test]
    fn new_events_wait_a_little_and_future_ones_not_for_ever() {
        let now = 1_000_000;
        let events = |ats: &[i64]| -> Vec<SeenEvent> {
            ats.iter()
                .enumerate()
                .map(|(i, &at)| SeenEvent {
                    id: i as i64 + 1,
                    record: None,
                    at,
                })
                .collect()
        };
        let mut waiting = None;
        let old = now - LAG_MS;
        assert_eq!(
            ripe(&events(&[old, old, now - 1, old]), now, &mut waiting),
            2
        );
        assert_eq!(waiting, Some((3, now)));
        assert_eq!(ripe(&events(&[old, old]), now, &mut waiting), 2);
        // Stamped an hour ahead: waited for LAG_MS of this node's time.
        let ahead = events(&[now + 3_600_000, old]);
        let mut waiting = None;
        assert_eq!(ripe(&ahead, now, &mut waiting), 0);
        assert_eq!(ripe(&ahead, now + LAG_MS - 1, &mut waiting), 0);
        assert_eq!(ripe(&ahead, now + LAG_MS, &mut waiting), 2);
    }

    #[test]
    fn holes_among_old_events_are_given_up_at_once() {
        let now = 100 * GIVE_UP_MS;
        let mut p = Progress::from_settled(0);
        // Reading events written long ago (their neighbours purged).
        p.observe(&at(&[5, 9], now - GIVE_UP_MS), now);
        assert_eq!((p.settled(), p.gaps()), (9, vec![]));
        // Written a moment ago: the hole may be a commit in flight. An
        // event stamped ahead of this node's clock counts from now.
        p.observe(&at(&[12], now - 5), now);
        p.observe(&at(&[20], now + 60_000), now);
        assert_eq!(p.gaps(), vec![10, 11, 13, 14, 15, 16, 17, 18, 19]);
        p.observe(&[], now + GIVE_UP_MS - 1);
        assert_eq!(p.settled(), 9);
        p.observe(&[], now + GIVE_UP_MS);
        assert_eq!(p.settled(), 20);
    }

    #[test]
    fn progress_tracks_at_most_max_gaps() {
        let mut p = Progress::from_settled(0);
        let far = MAX_GAPS as i64 * 3;
        p.observe(&at(&[far], 0), 0);
        assert_eq!(p.gaps().len(), MAX_GAPS);
        // The highest are kept: the likeliest to be commits in flight.
        assert_eq!(p.settled(), far - MAX_GAPS as i64 - 1);
        // Newer holes push the lowest out, not the other way round.
        p.observe(&at(&[far + 5], 0), 0);
        assert_eq!(p.gaps().len(), MAX_GAPS);
        assert_eq!(p.seen(), far + 5);
        assert!(p.gaps().contains(&(far + 4)));
        assert_eq!(p.settled(), far - MAX_GAPS as i64 + 3);
    }
}
