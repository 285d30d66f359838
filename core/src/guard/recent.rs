//! What this agent's checks admitted through the store in the last few seconds, kept where the
//! store can fail over (Sentinel, a Cluster): a failover loses the writes the old primary took after
//! its replica's promotion (and those it had not replicated), so the agent writes what it admitted in
//! that span again into the new primary (on a Cluster, for the keys of the failed-over slots only). Units that had in fact been replicated are then counted
//! twice: later checks are stricter, never looser (docs/accuracy.md, "Sentinel failover"). A
//! concurrency rule's leases taken in that span and not released are taken again (renewed where
//! the new primary has them).

use std::collections::{HashMap, VecDeque};
use std::sync::{Arc, Mutex};

use floodgate_protocol::CompactString;

use super::LedgerEntry;
use crate::rules::{Algorithm, Rule};
use crate::shared_store::FailedOver;

/// How far back a failover's re-application reaches at least, ms: a `SENTINEL FAILOVER` was seen
/// ~0.8 s after the promotion (issue 33), the agent notices the sentinels' new answer within its
/// 100 ms watch, and replication lag adds milliseconds; 3 s covers them with room.
pub const REPLAY_MS: u64 = 3_000;

/// How far back it reaches for counts that last longer (see [`horizon`]), ms. Sentinel turns an
/// old primary into a replica only when it next looks at it (its `INFO` every 10 s): a second
/// failover before then may promote the old primary itself, with nothing of what the fleet wrote
/// since the first (the fault runner's Sentinel seed 1: both nodes masters 6 s after the first
/// failover, and a daily quota's keys at 45 of 40). 15 s covers that look with room.
pub const LONG_REPLAY_MS: u64 = 15_000;

/// How long `rule`'s admissions are kept for a failover: as long as they still count (a sliding
/// window's two windows, a token bucket's refill time taken as two windows too, a lease's time, a
/// quota's whole period), at least [`REPLAY_MS`] and at most [`LONG_REPLAY_MS`].
pub fn horizon(rule: &Rule) -> u64 {
    let lasts = match rule.algorithm {
        Algorithm::SlidingWindow | Algorithm::TokenBucket | Algorithm::Concurrency => {
            rule.window_ms().saturating_mul(2)
        }
        Algorithm::Quota => u64::MAX,
    };
    lasts.clamp(REPLAY_MS, LONG_REPLAY_MS)
}

/// Slots the span is kept in: the oldest is dropped whole, and entries whose rule's horizon a slot
/// has outlived are dropped from it once (so short windows cost no more than before).
const SLOT_MS: u64 = 250;

type Slot = HashMap<(CompactString, CompactString, u64), LedgerEntry>;

/// The admissions of the last [`REPLAY_MS`] to [`LONG_REPLAY_MS`] (by rule, [`horizon`]), by
/// (rule, key, window), in slots of 250 ms.
#[derive(Default)]
pub struct Recent {
    slots: Mutex<Slots>,
}

/// The slots, oldest first, each (its start, its entries); the first `pruned` of them are past
/// [`REPLAY_MS`] and hold only what lasts longer (pruned once each: O(1) per admission).
#[derive(Default)]
struct Slots {
    list: VecDeque<(u64, Slot)>,
    pruned: usize,
}

impl Recent {
    /// Records `units` of `rule` admitted for `key` by a check read at `recv_ms` and answered at
    /// `now_ms` (the agent's clock): Redis counted them in the window holding some instant between,
    /// so where the two lie in different windows, both are given them (stricter, never looser; the
    /// fault runner's Sentinel seed 1 admitted 21 of 20 in a window whose edge such a check
    /// crossed). Concurrency rules keep their leases instead ([`leased`](Self::leased)).
    pub fn record(&self, rule: &Arc<Rule>, key: &CompactString, units: u64, recv_ms: u64, now_ms: u64) {
        let window_at = |t: u64| match rule.algorithm {
            Algorithm::Concurrency => None,
            Algorithm::Quota => Some(rule.quota_period(t).0),
            Algorithm::SlidingWindow | Algorithm::TokenBucket => Some(t / rule.window_ms()),
        };
        let Some(window) = window_at(now_ms) else { return };
        if let Some(earlier) = window_at(recv_ms.min(now_ms)).filter(|w| *w != window) {
            self.add(rule, key, units, earlier, now_ms);
        }
        self.add(rule, key, units, window, now_ms);
    }

    /// Records lease `id` of `units` taken for `key` at `now_ms` (an acquire the store granted).
    pub fn leased(&self, rule: &Arc<Rule>, key: &CompactString, id: u64, units: u64, now_ms: u64) {
        self.add(rule, key, units, id, now_ms);
    }

    /// Forgets lease `id` (released: not to be taken again).
    pub fn released(&self, rule: &str, key: &CompactString, id: u64) {
        let k = (CompactString::from(rule), key.clone(), id);
        for (_, slot) in self
            .slots
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .list
            .iter_mut()
        {
            slot.remove(&k);
        }
    }

    /// Adds units to (rule, key, window) in the current slot; a lease (window: its id) is kept once,
    /// a renewal not counted again.
    fn add(&self, rule: &Arc<Rule>, key: &CompactString, units: u64, window: u64, now_ms: u64) {
        let mut guard = self.slots.lock().unwrap_or_else(|p| p.into_inner());
        let Slots { list, pruned } = &mut *guard;
        let start = now_ms - now_ms % SLOT_MS;
        if list.back().is_none_or(|(s, _)| *s < start) {
            list.push_back((start, HashMap::new()));
        }
        while list
            .front()
            .is_some_and(|(s, _)| s + LONG_REPLAY_MS + SLOT_MS <= now_ms)
        {
            list.pop_front();
            *pruned = pruned.saturating_sub(1);
        }
        // Each slot, once past the shortest horizon, keeps only what lasts longer.
        while let Some((s, slot)) = list.get_mut(*pruned) {
            if *s + REPLAY_MS + SLOT_MS > now_ms {
                break;
            }
            slot.retain(|_, e| horizon(&e.rule) > REPLAY_MS);
            *pruned += 1;
        }
        let lease = rule.is_concurrency();
        let Some((_, slot)) = list.back_mut() else {
            return;
        };
        slot.entry((CompactString::from(rule.id.as_str()), key.clone(), window))
            .and_modify(|e| {
                if !lease {
                    e.units += units
                }
            })
            .or_insert_with(|| LedgerEntry {
                rule: rule.clone(),
                key: key.clone(),
                window,
                units,
            });
    }

    /// Everything admitted within its rule's [`horizon`] before `now_ms`, one entry per (rule, key,
    /// window), and forgets it (what the new primary is given once).
    pub fn take(&self, now_ms: u64) -> Vec<LedgerEntry> {
        self.take_moved(now_ms, &FailedOver::All)
    }

    /// [`take`](Self::take) of the keys a failover moved only (a Cluster's failed-over slots); the
    /// others' admissions are kept.
    pub fn take_moved(&self, now_ms: u64, moved: &FailedOver) -> Vec<LedgerEntry> {
        let mut slots = self.slots.lock().unwrap_or_else(|p| p.into_inner());
        let mut all: Slot = HashMap::new();
        for (start, slot) in slots.list.iter_mut() {
            let taken: Vec<_> = slot
                .keys()
                .filter(|(_, key, _)| moved.moved(key))
                .cloned()
                .collect();
            for k in taken {
                let Some(e) = slot.remove(&k) else { continue };
                if *start + horizon(&e.rule) + SLOT_MS <= now_ms {
                    continue;
                }
                let lease = e.rule.is_concurrency();
                all.entry(k)
                    .and_modify(|a| {
                        if !lease {
                            a.units += e.units
                        }
                    })
                    .or_insert(e);
            }
        }
        all.into_values().collect()
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::rules::RuleSet;

    #[test]
    fn a_failover_takes_the_last_seconds_once_by_key_and_window() {
        let rules = RuleSet::parse(
            r#"{"rules":[{"id":"r","dimension":"user","limit":100,"windowSeconds":2},
                {"id":"c","dimension":"user","limit":2,"algorithm":"concurrency"}]}"#,
        )
        .unwrap();
        let (r, c) = (rules.get("r").unwrap().clone(), rules.get("c").unwrap().clone());
        let recent = Recent::default();
        let key = CompactString::from("user:1");
        recent.record(&r, &key, 5, 10_000, 10_000); // too old by the time of the failover
        for t in [19_000, 19_500, 19_900, 20_100] {
            recent.record(&r, &key, 1, t, t); // windows 9 (three) and 10 (one)
        }
        recent.record(&r, &key, 1, 19_990, 20_010); // read in window 9, answered in 10: both
        recent.record(&c, &key, 1, 20_100, 20_100); // a lease is kept by its id, not counted
        recent.leased(&c, &key, 7, 1, 19_000);
        recent.leased(&c, &key, 7, 1, 20_000); // renewed: once
        recent.leased(&c, &key, 8, 2, 20_000);
        recent.released("c", &key, 8); // released: not taken again
        let mut got: Vec<(&str, u64, u64)> = recent
            .take(20_200)
            .iter()
            .map(|e| (e.rule.id.as_str(), e.window, e.units))
            .map(|(r, w, u)| (if r == "c" { "c" } else { "r" }, w, u))
            .collect();
        got.sort();
        assert_eq!(got, [("c", 7, 1), ("r", 9, 4), ("r", 10, 2)]);
        assert!(recent.take(20_300).is_empty(), "given once");
    }

    #[test]
    fn a_cluster_failover_takes_the_keys_it_moved_and_keeps_the_rest() {
        let rules =
            RuleSet::parse(r#"{"rules":[{"id":"r","dimension":"user","limit":100,"windowSeconds":2}]}"#)
                .unwrap();
        let r = rules.get("r").unwrap().clone();
        let recent = Recent::default();
        let (a, b) = (CompactString::from("user:a"), CompactString::from("user:b"));
        for t in [19_000, 19_600, 20_100] {
            recent.record(&r, &a, 1, t, t);
            recent.record(&r, &b, 2, t, t);
        }
        let only_a = FailedOver::Keys(Arc::new(|k: &str| k == "user:a"));
        let keys = |entries: Vec<LedgerEntry>| {
            let mut got: Vec<(String, u64, u64)> = entries
                .iter()
                .map(|e| (e.key.to_string(), e.window, e.units))
                .collect();
            got.sort();
            got
        };
        assert_eq!(
            keys(recent.take_moved(20_200, &only_a)),
            [("user:a".into(), 9, 2), ("user:a".into(), 10, 1)]
        );
        assert!(recent.take_moved(20_200, &only_a).is_empty(), "given once");
        assert_eq!(
            keys(recent.take(20_200)),
            [("user:b".into(), 9, 4), ("user:b".into(), 10, 2)],
            "another failover's keys are still there"
        );
    }

    #[test]
    fn what_counts_longer_is_kept_longer_up_to_fifteen_seconds() {
        let rules = RuleSet::parse(
            r#"{"rules":[{"id":"short","dimension":"user","limit":100,"windowSeconds":1},
                {"id":"minute","dimension":"user","limit":100,"windowSeconds":60},
                {"id":"q","dimension":"user","limit":40,"algorithm":"quota","period":"day"}]}"#,
        )
        .unwrap();
        let rule = |id| rules.get(id).unwrap().clone();
        assert_eq!(
            [
                horizon(&rule("short")),
                horizon(&rule("minute")),
                horizon(&rule("q"))
            ],
            [REPLAY_MS, LONG_REPLAY_MS, LONG_REPLAY_MS]
        );
        let recent = Recent::default();
        let key = CompactString::from("user:1");
        // 10 s before the failover (a stale replica promoted): a 1 s window's units no longer
        // count; a minute window's and a quota's do. 20 s before: nothing is kept.
        let t = 100_000;
        for (units, ago) in [(3, 20_000), (1, 10_000)] {
            for id in ["short", "minute", "q"] {
                recent.record(&rule(id), &key, units, t - ago, t - ago);
            }
        }
        // Later admissions prune the short-lived from old slots.
        recent.record(&rule("short"), &key, 2, t - 100, t - 100);
        let mut got: Vec<(String, u64)> = recent
            .take(t)
            .iter()
            .map(|e| (e.rule.id.clone(), e.units))
            .collect();
        got.sort();
        assert_eq!(got, [("minute".into(), 1), ("q".into(), 1), ("short".into(), 2)]);
    }
}
