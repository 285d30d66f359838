//! Hot keys: a (rule, key) checked sync more often than a threshold on this agent is promoted to
//! batched execution while it stays hot, so one key cannot make its Redis shard a hot spot.

use std::collections::HashMap;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Mutex;

/// Keys counted per second at most (a flood of distinct keys cannot grow the detector).
const TRACKED_CAP: usize = 100_000;

/// How long a promotion lasts after the key was last seen hot, in seconds.
const HOLD_SECONDS: u64 = 2;

struct Second {
    at: u64,
    counts: HashMap<(String, String), u64>,
}

/// Counts sync checks per (rule, key) per second and keeps the promoted set.
pub struct HotKeys {
    threshold: AtomicU64,
    current: Mutex<Second>,
    promoted: Mutex<HashMap<(String, String), (u64, u64)>>,
    /// Promotions made.
    pub promotions: AtomicU64,
}

impl HotKeys {
    /// A detector promoting keys checked more than `threshold` times per second (0 turns it off).
    pub fn new(threshold: u64) -> Self {
        HotKeys {
            threshold: AtomicU64::new(threshold),
            current: Mutex::new(Second {
                at: 0,
                counts: HashMap::new(),
            }),
            promoted: Mutex::new(HashMap::new()),
            promotions: AtomicU64::new(0),
        }
    }

    /// The threshold in checks per second (0: off).
    pub fn threshold(&self) -> u64 {
        self.threshold.load(Ordering::Relaxed)
    }

    /// Whether (rule, key) is promoted at `now_ms`.
    pub fn is_hot(&self, rule: &str, key: &str, now_ms: u64) -> bool {
        if self.threshold() == 0 {
            return false;
        }
        let promoted = self.promoted.lock().unwrap_or_else(|p| p.into_inner());
        if promoted.is_empty() {
            return false;
        }
        promoted
            .get(&(rule.to_string(), key.to_string()))
            .is_some_and(|(until, _)| now_ms / 1000 < *until)
    }

    /// Counts one sync check of (rule, key) at `now_ms`; returns true when this check makes it hot.
    pub fn note(&self, rule: &str, key: &str, now_ms: u64) -> bool {
        let threshold = self.threshold();
        if threshold == 0 {
            return false;
        }
        let second = now_ms / 1000;
        let mut cur = self.current.lock().unwrap_or_else(|p| p.into_inner());
        if cur.at != second {
            cur.at = second;
            cur.counts.clear();
            // Promotions that ran out go.
            self.promoted
                .lock()
                .unwrap_or_else(|p| p.into_inner())
                .retain(|_, (until, _)| second < *until);
        }
        let len = cur.counts.len();
        let k = (rule.to_string(), key.to_string());
        let n = match cur.counts.get_mut(&k) {
            Some(n) => n,
            None if len < TRACKED_CAP => cur.counts.entry(k.clone()).or_insert(0),
            None => return false,
        };
        *n += 1;
        if *n == threshold + 1 {
            let mut promoted = self.promoted.lock().unwrap_or_else(|p| p.into_inner());
            if promoted.insert(k, (second + HOLD_SECONDS, *n)).is_none() {
                self.promotions.fetch_add(1, Ordering::Relaxed);
            }
            return true;
        }
        false
    }

    /// Keeps a promoted key promoted: batched checks of a hot key count here too.
    pub fn keep(&self, rule: &str, key: &str, now_ms: u64) {
        let threshold = self.threshold();
        let second = now_ms / 1000;
        let mut cur = self.current.lock().unwrap_or_else(|p| p.into_inner());
        if cur.at != second {
            drop(cur);
            self.note(rule, key, now_ms);
            return;
        }
        let k = (rule.to_string(), key.to_string());
        let n = cur.counts.entry(k.clone()).or_insert(0);
        *n += 1;
        if *n > threshold {
            if let Some(p) = self
                .promoted
                .lock()
                .unwrap_or_else(|p| p.into_inner())
                .get_mut(&k)
            {
                *p = (second + HOLD_SECONDS, *n);
            }
        }
    }

    /// The promoted keys: (rule, key, checks in the second that promoted or last kept it).
    pub fn promoted(&self) -> Vec<(String, String, u64)> {
        let promoted = self.promoted.lock().unwrap_or_else(|p| p.into_inner());
        let mut out: Vec<_> = promoted
            .iter()
            .map(|((r, k), (_, n))| (r.clone(), k.clone(), *n))
            .collect();
        out.sort();
        out
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_key_over_the_threshold_is_promoted_while_it_stays_hot() {
        let h = HotKeys::new(100);
        for i in 0..100 {
            assert!(!h.note("r", "k", 5_000 + i));
        }
        assert!(!h.is_hot("r", "k", 5_100));
        assert!(h.note("r", "k", 5_100), "the 101st check in one second promotes");
        assert!(h.is_hot("r", "k", 5_200));
        assert!(!h.is_hot("r", "other", 5_200));
        // Kept hot through the next second, then it cools down.
        for i in 0..150 {
            h.keep("r", "k", 6_000 + i);
        }
        assert!(h.is_hot("r", "k", 7_500));
        h.note("x", "y", 9_000);
        assert!(!h.is_hot("r", "k", 9_000));
        assert_eq!(h.promotions.load(Ordering::Relaxed), 1);
    }

    #[test]
    fn zero_turns_it_off() {
        let h = HotKeys::new(0);
        for i in 0..10_000 {
            assert!(!h.note("r", "k", i));
        }
        assert!(!h.is_hot("r", "k", 10));
    }
}
