//! Fair share between queues: how one claim divides its batch between the
//! queues that have due work, and the order it hands the records out in.
//!
//! A record belongs to the queue (pipeline, group): the group is optional,
//! given at enqueue (a tenant, say), and records without one share their
//! pipeline's queue. Claiming in plain due order would serve a backlog of
//! 10,000 in one queue before a record enqueued after it in another; a
//! claim instead takes an even share of its batch from every queue with
//! due work, oldest first within each queue, so each queue gets
//! its part of whatever the workers and the providers' limits allow. A
//! queue may also be capped (a pipeline's `group_concurrency`: records of
//! one group leased at once), which `Queue::room` carries.
//!
//! PostgreSQL takes the shares in its claim statement, which cannot hand a
//! short queue's leftover to the others: `batch / n` from each of the n
//! open queues, one more from the first `batch mod n` in a random turn
//! (which also decides who is cut when there are more queues than the
//! batch). SQLite reads each queue's due records and calls [`take`], which
//! does hand leftovers on. Both hand records out through [`interleave`].

use std::collections::HashMap;

/// A queue with due work, as one claim sees it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Queue<T> {
    /// Its due records, oldest first (at most the claim's batch).
    pub due: Vec<T>,
    /// How many more it may have leased (its cap less those leased), or
    /// `None` when uncapped.
    pub room: Option<u32>,
}

/// Takes up to `limit` records from `queues` round robin, one from each
/// open queue in turn (oldest first, never past a queue's room), starting
/// at queue `start` (modulo their number), so a caller turning `start`
/// cuts each queue in turn when there are more queues than the batch. A
/// queue gets everything it has or at least `limit / open queues`; what a
/// short queue leaves goes to the others. Returns the records taken, queue
/// by queue.
pub fn take<T: Clone>(queues: &[Queue<T>], limit: u32, start: usize) -> Vec<T> {
    let open: Vec<&Queue<T>> = queues
        .iter()
        .filter(|q| !q.due.is_empty() && q.room != Some(0))
        .collect();
    let n = open.len();
    let mut taken = vec![0usize; n];
    let mut left = limit as usize;
    let can = |i: usize, taken: &[usize]| {
        let room = open[i].room.map_or(usize::MAX, |r| r as usize);
        taken[i] < open[i].due.len().min(room)
    };
    while left > 0 && (0..n).any(|i| can(i, &taken)) {
        for k in 0..n {
            let i = (start + k) % n;
            if left > 0 && can(i, &taken) {
                taken[i] += 1;
                left -= 1;
            }
        }
    }
    open.iter()
        .zip(&taken)
        .flat_map(|(q, &k)| q.due[..k].iter().cloned())
        .collect()
}

/// Orders claimed records for hand-out: round robin over their queues (the
/// first of each queue, then the second of each …), keeping each queue's
/// own order and the queues in the order they first appear. `queue` names
/// a record's queue.
pub fn interleave<T, K: Eq + std::hash::Hash>(records: Vec<T>, queue: impl Fn(&T) -> K) -> Vec<T> {
    let mut rank_in_queue: HashMap<K, usize> = HashMap::new();
    let mut first_seen: HashMap<K, usize> = HashMap::new();
    let mut keyed: Vec<(usize, usize, T)> = Vec::with_capacity(records.len());
    for rec in records {
        let k = queue(&rec);
        let seen = first_seen.len();
        let order = *first_seen.entry(queue(&rec)).or_insert(seen);
        let rank = rank_in_queue.entry(k).or_insert(0);
        keyed.push((*rank, order, rec));
        *rank += 1;
    }
    keyed.sort_by_key(|(rank, order, _)| (*rank, *order));
    keyed.into_iter().map(|(_, _, rec)| rec).collect()
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    fn q(ids: std::ops::Range<u32>, room: Option<u32>) -> Queue<u32> {
        Queue {
            due: ids.collect(),
            room,
        }
    }

    #[test]
    fn a_backlog_does_not_starve_a_small_queue() {
        let queues = [q(0..10_000, None), q(20_000..20_100, None)];
        let got = take(&queues, 64, 0);
        assert_eq!(got.len(), 64);
        assert_eq!(got.iter().filter(|&&id| id >= 20_000).count(), 32);
        // Oldest first within each queue.
        assert_eq!(&got[..32], &(0..32).collect::<Vec<_>>()[..]);
    }

    #[test]
    fn a_short_queue_leaves_the_rest_to_the_others() {
        let got = take(&[q(0..100, None), q(200..202, None)], 10, 0);
        assert_eq!(got, vec![0, 1, 2, 3, 4, 5, 6, 7, 200, 201]);
    }

    #[test]
    fn a_cap_limits_its_queue_and_a_full_queue_gives_nothing() {
        let got = take(&[q(0..100, Some(3)), q(200..300, Some(0))], 64, 0);
        assert_eq!(got, vec![0, 1, 2]);
    }

    #[test]
    fn more_queues_than_the_batch_are_cut_in_turn() {
        let queues: Vec<Queue<u32>> = (0..4).map(|i| q(i * 10..i * 10 + 5, None)).collect();
        assert_eq!(take(&queues, 2, 0), vec![0, 10]);
        assert_eq!(take(&queues, 2, 2), vec![20, 30]);
        assert_eq!(take(&queues, 2, 3), vec![0, 30]);
    }

    #[test]
    fn interleave_round_robins_over_queues() {
        let recs = vec![
            ("x", 1),
            ("x", 2),
            ("x", 3),
            ("y", 10),
            ("y", 11),
            ("z", 20),
        ];
        let got: Vec<i32> = interleave(recs, |r| r.0).into_iter().map(|r| r.1).collect();
        assert_eq!(got, vec![1, 10, 20, 2, 11, 3]);
    }

    proptest! {
        /// Whatever the queues: never more than the batch nor a queue's
        /// room, each queue's records in its own order, the batch filled
        /// while any queue can give more, and every open queue given all
        /// it can give or at least `limit / open queues`.
        #[test]
        fn takes_fair_shares(
            sizes in prop::collection::vec((0u32..50, prop::option::of(0u32..10)), 0..8),
            limit in 0u32..100,
            start in 0usize..10,
        ) {
            let queues: Vec<Queue<(usize, u32)>> = sizes
                .iter()
                .enumerate()
                .map(|(i, (n, room))| Queue { due: (0..*n).map(|k| (i, k)).collect(), room: *room })
                .collect();
            let got = take(&queues, limit, start);
            prop_assert!(got.len() <= limit as usize);
            let open = queues.iter().filter(|q| !q.due.is_empty() && q.room != Some(0)).count();
            let mut can_give = 0usize;
            for (i, queue) in queues.iter().enumerate() {
                let mine: Vec<u32> = got.iter().filter(|r| r.0 == i).map(|r| r.1).collect();
                prop_assert_eq!(&mine, &(0..mine.len() as u32).collect::<Vec<_>>());
                let most = queue.room.unwrap_or(u32::MAX).min(queue.due.len() as u32);
                prop_assert!(mine.len() as u32 <= most);
                let fair = (limit / open.max(1) as u32).min(most);
                prop_assert!(mine.len() as u32 >= fair, "queue {} got {} of {}", i, mine.len(), fair);
                can_give += most as usize;
            }
            prop_assert_eq!(got.len(), can_give.min(limit as usize));
        }
    }
}
