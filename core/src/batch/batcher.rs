//! The agent's batched counters, per rule and key: checks decided on them (`check`, `undo`), the
//! flush intervals, and Redis's clock as flushes learn it; the flushes themselves are `flush.rs`.

use std::collections::HashMap;
use std::sync::atomic::{AtomicI64, AtomicU32, AtomicU64, AtomicUsize, Ordering};
use std::sync::{Arc, Mutex, RwLock};

use super::counter::Denial;
use super::map::CounterMap;
use crate::algo::Outcome;
use crate::rules::Rule;
use crate::store::{Clock, Planned};

/// The default flush interval (the design's ~100 ms).
pub const DEFAULT_FLUSH_MS: u64 = 100;

/// Most (rule, key) counters an agent tracks by default; past it new keys run sync (~100 B each).
pub const DEFAULT_MAX_KEYS: usize = 1_000_000;

/// The mutex shards of each rule's counters.
pub(super) const SHARDS: usize = 16;

/// One rule's counters and their flush state.
pub(super) struct RuleCounters {
    /// The rule's window the counts are in.
    pub(super) window_ms: u64,
    /// Learns of this rule so far (+1): counts learned before the last learn are stale.
    pub(super) seq: AtomicU32,
    /// The shard the next flush pass starts at.
    pub(super) cursor: AtomicUsize,
    /// The flush slot (Redis time / interval) of the last write, and of the last learn.
    pub(super) slots: Mutex<(u64, u64)>,
    /// The counters by key, `SHARDS` maps.
    pub(super) shards: Vec<Mutex<CounterMap>>,
}

/// Counters in figures, for the admin API and benchmarks.
#[derive(Debug, Default)]
pub struct BatchStats {
    /// Checks admitted from local counters.
    pub admitted: AtomicU64,
    /// Checks denied because the limit was reached.
    pub denied_limit: AtomicU64,
    /// Checks denied because this agent's share was spent.
    pub denied_share: AtomicU64,
    /// Flushes done.
    pub flushes: AtomicU64,
    /// Entries sent.
    pub entries: AtomicU64,
    /// Units sent.
    pub units: AtomicU64,
    /// Flush calls that failed.
    pub errors: AtomicU64,
    /// Units whose flush timed out (maybe applied, not resent).
    pub uncertain_units: AtomicU64,
    /// Checks that ran sync because the agent tracked its maximum of keys.
    pub full: AtomicU64,
}

/// The batched counters of one agent.
pub struct Batcher {
    rules: RwLock<HashMap<String, Arc<RuleCounters>>>,
    default_flush_ms: AtomicU64,
    overrides: RwLock<HashMap<String, u64>>,
    offset_ms: AtomicI64,
    last_now_ms: AtomicU64,
    keys: AtomicUsize,
    max_keys: usize,
    clock: Clock,
    /// Figures.
    pub stats: BatchStats,
}

impl Default for Batcher {
    fn default() -> Self {
        Self::new(DEFAULT_FLUSH_MS, DEFAULT_MAX_KEYS)
    }
}

impl Batcher {
    /// An empty batcher flushing every `flush_ms` by default, tracking at most `max_keys` counters.
    pub fn new(flush_ms: u64, max_keys: usize) -> Self {
        Self::with_clock(flush_ms, max_keys, Clock::System)
    }

    /// [`Batcher::new`] on `clock` (the model test's simulated time).
    pub fn with_clock(flush_ms: u64, max_keys: usize, clock: Clock) -> Self {
        Batcher {
            rules: RwLock::new(HashMap::new()),
            default_flush_ms: AtomicU64::new(flush_ms.max(1)),
            overrides: RwLock::new(HashMap::new()),
            offset_ms: AtomicI64::new(0),
            last_now_ms: AtomicU64::new(0),
            keys: AtomicUsize::new(0),
            max_keys,
            clock,
            stats: BatchStats::default(),
        }
    }

    /// The flush interval of a rule: a run-time override, else the rule's own, else the default.
    pub fn flush_ms(&self, rule: &Rule) -> u64 {
        if let Some(ms) = self
            .overrides
            .read()
            .unwrap_or_else(|p| p.into_inner())
            .get(&rule.id)
        {
            return *ms;
        }
        rule.flush_interval_ms
            .map(|f| f.get())
            .unwrap_or_else(|| self.default_flush_ms.load(Ordering::Relaxed))
    }

    /// The default flush interval.
    pub fn default_flush_ms(&self) -> u64 {
        self.default_flush_ms.load(Ordering::Relaxed)
    }

    /// Changes the flush interval at run time: of one rule, or the default (`rule` = None). The
    /// next write comes at the next slot boundary of the new interval (what is pending waits for it).
    pub fn set_flush_ms(&self, rule: Option<&str>, ms: u64) {
        let ms = ms.clamp(1, 60_000);
        match rule {
            Some(id) => {
                self.overrides
                    .write()
                    .unwrap_or_else(|p| p.into_inner())
                    .insert(id.to_string(), ms);
            }
            None => self.default_flush_ms.store(ms, Ordering::Relaxed),
        }
        let slot = self.redis_now_ms() / ms;
        for (id, rc) in self.rules.read().unwrap_or_else(|p| p.into_inner()).iter() {
            if rule.is_none_or(|r| r == id) {
                rc.slots.lock().unwrap_or_else(|p| p.into_inner()).0 = slot;
            }
        }
    }

    /// Counters tracked.
    pub fn keys(&self) -> usize {
        self.keys.load(Ordering::Relaxed)
    }

    /// Whether a new counter can be tracked.
    pub fn has_room(&self) -> bool {
        self.keys() < self.max_keys
    }

    /// Redis time estimated from the local clock and the offset learned from flush replies.
    /// Never goes backwards (a corrected offset or a stepped wall clock would otherwise move
    /// counters' windows back and forth).
    pub fn redis_now_ms(&self) -> u64 {
        let estimate = (self.clock.now_ms() as i64 + self.offset_ms.load(Ordering::Relaxed)).max(0) as u64;
        self.last_now_ms
            .fetch_max(estimate, Ordering::Relaxed)
            .max(estimate)
    }

    /// How far Redis's clock is ahead of the local one, in ms, as last learned (0 until a flush).
    pub fn offset_ms(&self) -> i64 {
        self.offset_ms.load(Ordering::Relaxed)
    }

    /// Records Redis's clock as read by one flush call sent at local `sent_ms` and answered at
    /// `answered_ms`: Redis read it about halfway.
    pub fn learn_clock(&self, redis_ms: u64, sent_ms: u64, answered_ms: u64) {
        let midpoint = sent_ms + answered_ms.saturating_sub(sent_ms) / 2;
        self.offset_ms
            .store(redis_ms as i64 - midpoint as i64, Ordering::Relaxed);
    }

    /// Drops the counters of rules no longer in the set (a rule removed or renamed by a reload).
    pub(super) fn forget_removed(&self, rules: &[Arc<Rule>]) {
        let known =
            |map: &HashMap<String, Arc<RuleCounters>>| map.keys().all(|id| rules.iter().any(|r| &r.id == id));
        if known(&self.rules.read().unwrap_or_else(|p| p.into_inner())) {
            return;
        }
        let mut map = self.rules.write().unwrap_or_else(|p| p.into_inner());
        let mut gone = 0;
        map.retain(|id, rc| {
            let keep = rules.iter().any(|r| &r.id == id);
            if !keep {
                gone += rc
                    .shards
                    .iter()
                    .map(|s| s.lock().unwrap_or_else(|p| p.into_inner()).len())
                    .sum::<usize>();
            }
            keep
        });
        drop(map);
        self.forget_keys(gone);
    }

    pub(super) fn forget_keys(&self, n: usize) {
        let _ = self.keys.fetch_update(Ordering::Relaxed, Ordering::Relaxed, |k| {
            Some(k.saturating_sub(n))
        });
    }

    /// The counters of a rule as they are, if their window is still the rule's (a flush reply for a
    /// rule whose window has since changed teaches nothing).
    pub(super) fn existing(&self, rule: &Rule) -> Option<Arc<RuleCounters>> {
        let rules = self.rules.read().unwrap_or_else(|p| p.into_inner());
        rules
            .get(&rule.id)
            .filter(|c| c.window_ms == rule.window_ms())
            .cloned()
    }

    fn counters(&self, rule: &Rule) -> Arc<RuleCounters> {
        let window_ms = rule.window_ms();
        if let Some(c) = self.rules.read().unwrap_or_else(|p| p.into_inner()).get(&rule.id) {
            if c.window_ms == window_ms {
                return c.clone();
            }
        }
        let mut rules = self.rules.write().unwrap_or_else(|p| p.into_inner());
        let c = rules
            .entry(rule.id.clone())
            .or_insert_with(|| new_counters(window_ms, self.redis_now_ms() / self.flush_ms(rule)));
        if c.window_ms != window_ms {
            // The window changed: old counts mean nothing under the new one.
            let old: usize = c
                .shards
                .iter()
                .map(|s| s.lock().unwrap_or_else(|p| p.into_inner()).len())
                .sum();
            self.forget_keys(old);
            *c = new_counters(window_ms, self.redis_now_ms() / self.flush_ms(rule));
        }
        c.clone()
    }

    /// Decides batched items locally, all or nothing: each admitted item is counted at once, and if
    /// a later one is denied the earlier ones are taken back. `n` is the live-agent count. Each
    /// answer carries the window it was counted in, for [`Batcher::undo`].
    pub fn check(&self, items: &[&Planned], n: u64) -> Vec<(Outcome, Option<Denial>, u64)> {
        let now = self.redis_now_ms();
        let mut out = Vec::with_capacity(items.len());
        let mut taken: Vec<(usize, u64)> = Vec::new();
        let mut denied = false;
        for (i, p) in items.iter().enumerate() {
            let rc = self.counters(&p.rule);
            let seq = rc.seq.load(Ordering::Relaxed);
            let mut shard = rc.shards[shard_of(&p.key)]
                .lock()
                .unwrap_or_else(|e| e.into_inner());
            let (c, new) = shard.get_or_insert(&p.key);
            if new {
                self.keys.fetch_add(1, Ordering::Relaxed);
            }
            let (o, d) = if denied && p.rule.enforced() {
                // Already rejected: report without counting.
                let mut probe = c.clone();
                probe.admit(p.rule.limit.get(), rc.window_ms, p.cost, now, n, seq)
            } else {
                c.admit(p.rule.limit.get(), rc.window_ms, p.cost, now, n, seq)
            };
            let (mut o, d) = (o, d);
            if d == Some(Denial::Share) {
                // This agent's share is spent until the next flush teaches it the global count.
                o.remaining = 0;
                o.retry_after_ms = self.flush_ms(&p.rule).max(1);
            }
            let window = c.window;
            if d.is_none() && !(denied && p.rule.enforced()) {
                taken.push((i, window));
            }
            if d.is_some() && p.rule.enforced() {
                denied = true;
            }
            match d {
                None => self.stats.admitted.fetch_add(1, Ordering::Relaxed),
                Some(Denial::Limit) => self.stats.denied_limit.fetch_add(1, Ordering::Relaxed),
                Some(Denial::Share) => self.stats.denied_share.fetch_add(1, Ordering::Relaxed),
            };
            out.push((o, d, window));
        }
        if denied {
            for (i, window) in taken {
                self.undo(items[i], window);
            }
        }
        out
    }

    /// Takes back an admitted item (its check was rejected by another item).
    pub fn undo(&self, p: &Planned, window: u64) {
        let Some(rc) = self.existing(&p.rule) else {
            return;
        };
        let mut shard = rc.shards[shard_of(&p.key)]
            .lock()
            .unwrap_or_else(|e| e.into_inner());
        if let Some(c) = shard.get_mut(p.key.as_str()) {
            c.undo(window, p.cost);
        }
    }

    /// Per rule: keys tracked, units not yet written to Redis, and units not yet in a learned count
    /// (those plus the written ones).
    pub fn snapshot(&self) -> Vec<(String, usize, u64, u64)> {
        let rules = self.rules.read().unwrap_or_else(|p| p.into_inner());
        let mut out: Vec<(String, usize, u64, u64)> = rules
            .iter()
            .map(|(id, rc)| {
                let (mut keys, mut pending, mut unlearned) = (0, 0, 0);
                for s in &rc.shards {
                    let s = s.lock().unwrap_or_else(|p| p.into_inner());
                    keys += s.len();
                    for c in s.values() {
                        pending += c.pending();
                        let (cur, prev) = c.unlearned();
                        unlearned += cur + prev;
                    }
                }
                (id.clone(), keys, pending, unlearned)
            })
            .collect();
        out.sort();
        out
    }
}

/// A rule's counters, created in flush slot `slot`: the first write comes at the next slot boundary,
/// like every agent's.
fn new_counters(window_ms: u64, slot: u64) -> Arc<RuleCounters> {
    Arc::new(RuleCounters {
        window_ms,
        seq: AtomicU32::new(1),
        cursor: AtomicUsize::new(0),
        slots: Mutex::new((slot, u64::MAX)),
        shards: (0..SHARDS).map(|_| Mutex::new(CounterMap::default())).collect(),
    })
}

/// The shard of a key's counter.
pub(super) fn shard_of(key: &str) -> usize {
    (crate::store::layout::fnv1a(key.as_bytes()) % SHARDS as u64) as usize
}
