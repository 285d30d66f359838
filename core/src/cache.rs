//! The rejection cache: once a (rule, key) is rejected, the agent answers it locally until it could
//! pass again, so a hot abusive key stops reaching Redis. Bounded: a flood of distinct keys evicts the
//! entries closest to expiry instead of growing the agent.

use std::collections::HashMap;
use std::sync::atomic::{AtomicU64, AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};

use crate::algo::Outcome;
use crate::rules::Rule;

/// Entries by default: 100 K × ~150 B ≈ 15 MB at most.
pub const DEFAULT_CAP: usize = 100_000;

const SHARDS: usize = 64;

struct Entry {
    /// The rule as it was when the key was rejected: a changed rule (raised limit) drops the entry.
    rule: Arc<Rule>,
    /// The cost that was rejected; a smaller one may pass sooner and is not answered from the cache.
    cost: u64,
    /// Local time at which the key could pass again (now + retryAfter when rejected). The cache keeps
    /// a rejection until then, not until its `resetAt`: after the retry time the key may pass, and a
    /// cache that said otherwise would reject admissible requests.
    until_ms: u64,
    /// The rejection's figures.
    outcome: Outcome,
}

/// Cached rejections, sharded by key hash to keep lock contention low.
pub struct RejectionCache {
    shards: Vec<Mutex<HashMap<(String, String), Entry>>>,
    len: AtomicUsize,
    cap: usize,
    /// Checks answered from the cache.
    pub hits: AtomicU64,
    /// Entries evicted before their time because the cache was full.
    pub evicted: AtomicU64,
}

impl Default for RejectionCache {
    fn default() -> Self {
        Self::new(DEFAULT_CAP)
    }
}

impl RejectionCache {
    /// An empty cache holding at most `cap` entries (0 turns it off).
    pub fn new(cap: usize) -> Self {
        RejectionCache {
            shards: (0..SHARDS).map(|_| Mutex::new(HashMap::new())).collect(),
            len: AtomicUsize::new(0),
            cap,
            hits: AtomicU64::new(0),
            evicted: AtomicU64::new(0),
        }
    }

    /// Entries held.
    pub fn len(&self) -> usize {
        self.len.load(Ordering::Relaxed)
    }

    /// Whether it holds nothing.
    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    fn shard(&self, rule: &str, key: &str) -> &Mutex<HashMap<(String, String), Entry>> {
        let h = crate::store::layout::fnv1a(key.as_bytes()) ^ crate::store::layout::fnv1a(rule.as_bytes());
        &self.shards[(h % SHARDS as u64) as usize]
    }

    /// The cached rejection of (rule, key) for `cost` at `now_ms`, its retry counted down; `None` if
    /// there is none, it has run out, or the rule changed since (such an entry is dropped).
    pub fn get(&self, rule: &Arc<Rule>, key: &str, cost: u64, now_ms: u64) -> Option<Outcome> {
        if self.cap == 0 || self.is_empty() {
            return None;
        }
        let mut shard = self
            .shard(&rule.id, key)
            .lock()
            .unwrap_or_else(|p| p.into_inner());
        let k = (rule.id.clone(), key.to_string());
        let e = shard.get(&k)?;
        if now_ms >= e.until_ms || (!Arc::ptr_eq(&e.rule, rule) && *e.rule != **rule) {
            shard.remove(&k);
            self.len.fetch_sub(1, Ordering::Relaxed);
            return None;
        }
        if cost < e.cost {
            return None;
        }
        self.hits.fetch_add(1, Ordering::Relaxed);
        let mut o = e.outcome;
        o.retry_after_ms = (e.until_ms - now_ms).max(1);
        Some(o)
    }

    /// Caches a rejection of (rule, key) for `cost` at `now_ms` (local clock) until it could pass. A
    /// concurrency rule's is not: a release may free its units at any moment.
    pub fn put(&self, rule: &Arc<Rule>, key: &str, cost: u64, outcome: Outcome, now_ms: u64) {
        if self.cap == 0 || outcome.allowed || outcome.retry_after_ms == 0 || rule.is_concurrency() {
            return;
        }
        let per_shard = self.cap.div_ceil(SHARDS).max(1);
        let mut shard = self
            .shard(&rule.id, key)
            .lock()
            .unwrap_or_else(|p| p.into_inner());
        if shard.len() >= per_shard {
            // Full: drop what has run out, and if that frees less than an eighth, arbitrary live
            // entries down to seven eighths. One pass per eighth of inserts: amortized O(1).
            let before = shard.len();
            shard.retain(|_, e| e.until_ms > now_ms);
            let keep = per_shard - per_shard.div_ceil(8);
            if shard.len() > keep {
                let evict: Vec<_> = shard.keys().take(shard.len() - keep).cloned().collect();
                self.evicted.fetch_add(evict.len() as u64, Ordering::Relaxed);
                for k in evict {
                    shard.remove(&k);
                }
            }
            self.len.fetch_sub(before - shard.len(), Ordering::Relaxed);
        }
        let entry = Entry {
            rule: rule.clone(),
            cost,
            until_ms: now_ms + outcome.retry_after_ms,
            outcome,
        };
        if shard.insert((rule.id.clone(), key.to_string()), entry).is_none() {
            self.len.fetch_add(1, Ordering::Relaxed);
        }
    }

    /// Drops the cached rejection of (rule, key), if any: units came back (a commit gave back what a
    /// reservation did not use), so the key may pass before the rejection said.
    pub fn forget(&self, rule: &str, key: &str) {
        if self.cap == 0 || self.is_empty() {
            return;
        }
        let mut shard = self.shard(rule, key).lock().unwrap_or_else(|p| p.into_inner());
        if shard.remove(&(rule.to_string(), key.to_string())).is_some() {
            self.len.fetch_sub(1, Ordering::Relaxed);
        }
    }

    /// Drops expired entries (the agent calls it every few seconds).
    pub fn sweep(&self, now_ms: u64) {
        for shard in &self.shards {
            let mut shard = shard.lock().unwrap_or_else(|p| p.into_inner());
            let before = shard.len();
            shard.retain(|_, e| e.until_ms > now_ms);
            self.len.fetch_sub(before - shard.len(), Ordering::Relaxed);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::rules::RuleSet;

    fn rule(limit: u64) -> Arc<Rule> {
        let set = RuleSet::parse(&format!(
            r#"{{"rules":[{{"id":"r","dimension":"user","limit":{limit},"windowSeconds":10}}]}}"#
        ))
        .unwrap();
        set.get("r").unwrap().clone()
    }

    fn denial(retry: u64) -> Outcome {
        Outcome {
            allowed: false,
            limit: 5,
            remaining: 0,
            reset_at_ms: 50_000,
            retry_after_ms: retry,
        }
    }

    #[test]
    fn answers_until_the_key_could_pass_with_retry_counting_down() {
        let c = RejectionCache::default();
        let r = rule(5);
        c.put(&r, "u", 1, denial(3_000), 10_000);
        assert_eq!(c.get(&r, "u", 1, 11_000).unwrap().retry_after_ms, 2_000);
        assert_eq!(c.get(&r, "u", 1, 12_999).unwrap().retry_after_ms, 1);
        assert!(c.get(&r, "u", 1, 13_000).is_none());
        assert!(c.is_empty());
        assert!(c.get(&r, "other", 1, 11_000).is_none());
    }

    #[test]
    fn a_changed_rule_or_a_smaller_cost_is_not_answered() {
        let c = RejectionCache::default();
        let r = rule(5);
        c.put(&r, "u", 3, denial(3_000), 0);
        assert!(c.get(&r, "u", 2, 1).is_none(), "a smaller cost may pass sooner");
        assert!(c.get(&r, "u", 3, 1).is_some());
        assert!(
            c.get(&rule(50), "u", 3, 1).is_none(),
            "a raised limit unblocks at once"
        );
        assert!(c.is_empty());
    }

    #[test]
    fn a_flood_of_keys_stays_within_the_cap() {
        let c = RejectionCache::new(640);
        let r = rule(5);
        for i in 0..100_000 {
            c.put(&r, &format!("k{i}"), 1, denial(1_000_000), i);
        }
        assert!(c.len() <= 640, "{}", c.len());
        let evicted = c.evicted.load(Ordering::Relaxed);
        assert!(evicted >= 100_000 - 640, "evicted {evicted}, len {}", c.len());
    }
}
