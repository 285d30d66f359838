//! The agent's batched counters, per rule and key, and the flush bookkeeping: which rules are due,
//! what to send, and what a reply teaches.

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

/// Most entries one flush pass carries (writes and learns of all rules): bounds the pass's memory and
/// Redis time (~256 calls). What does not fit waits for the next pass: unwritten units stay pending,
/// unlearned keys stay stale (one check per key and slot until learned).
pub const MAX_FLUSH_ENTRIES: usize = 65_536;

/// Most (rule, key) counters an agent tracks by default; past it new keys run sync (~100 B each).
pub const DEFAULT_MAX_KEYS: usize = 1_000_000;

const SHARDS: usize = 16;

/// One entry of a flush: a write of units admitted for (rule, key) in window `target`, or a learn
/// (0 units) that reads the global counts back.
#[derive(Debug, Clone)]
pub struct FlushEntry {
    /// The rule.
    pub rule: Arc<Rule>,
    /// The client key.
    pub key: String,
    /// The window the units belong to (Redis clock).
    pub target: u64,
    /// Units to add.
    pub units: u64,
    /// For a learn, the rule's learn sequence number.
    pub seq: u32,
    /// Whether this entry learns (reads) rather than writes.
    pub learn: bool,
}

/// What Redis answered for one entry: its window index then, and the counts of that window and the
/// one before.
#[derive(Debug, Clone, Copy)]
pub struct Learned {
    /// Redis's window index when the entry was applied.
    pub window: u64,
    /// The global count of that window.
    pub cur: u64,
    /// The global count of the window before.
    pub prev: u64,
}

struct RuleCounters {
    window_ms: u64,
    /// Learns of this rule so far (+1): counts learned before the last learn are stale.
    seq: AtomicU32,
    /// The shard the next flush pass starts at.
    cursor: AtomicUsize,
    /// The flush slot (Redis time / interval) of the last write, and of the last learn.
    slots: Mutex<(u64, u64)>,
    shards: Vec<Mutex<CounterMap>>,
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
        Batcher {
            rules: RwLock::new(HashMap::new()),
            default_flush_ms: AtomicU64::new(flush_ms.max(1)),
            overrides: RwLock::new(HashMap::new()),
            offset_ms: AtomicI64::new(0),
            last_now_ms: AtomicU64::new(0),
            keys: AtomicUsize::new(0),
            max_keys,
            clock: Clock::System,
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
    fn forget_removed(&self, rules: &[Arc<Rule>]) {
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

    fn forget_keys(&self, n: usize) {
        let _ = self.keys.fetch_update(Ordering::Relaxed, Ordering::Relaxed, |k| {
            Some(k.saturating_sub(n))
        });
    }

    /// The counters of a rule as they are, if their window is still the rule's (a flush reply for a
    /// rule whose window has since changed teaches nothing).
    fn existing(&self, rule: &Rule) -> Option<Arc<RuleCounters>> {
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

    /// The entries of every rule whose flush is due now (Redis clock): at the start of each flush
    /// slot (time / interval) a write of what was admitted since the last one; half a slot later,
    /// when every agent has written, a learn of the keys that need one (`Counter::needs_learn`: near
    /// their share, or not learned for `LEARN_EVERY` passes).
    /// With `force` (shutdown), a write of everything pending. Idle counters whose windows have
    /// passed are dropped at each learn.
    pub fn take_due(&self, rules: &[Arc<Rule>], n: u64, force: bool) -> Vec<FlushEntry> {
        let redis_now = self.redis_now_ms();
        let cap = if force { usize::MAX } else { MAX_FLUSH_ENTRIES };
        let mut out = Vec::new();
        self.forget_removed(rules);
        for rule in rules {
            let Some(rc) = self.existing(rule) else {
                continue;
            };
            let interval = self.flush_ms(rule);
            let slot = redis_now / interval;
            let (write, learn) = {
                let mut slots = rc.slots.lock().unwrap_or_else(|p| p.into_inner());
                let write = force || slots.0 != slot;
                let learn = !force && !write && slots.1 != slot && redis_now % interval >= interval / 2;
                if write {
                    slots.0 = slot;
                }
                if learn {
                    slots.1 = slot;
                }
                (write, learn)
            };
            if !(write || learn) {
                continue;
            }
            let seq = if learn {
                rc.seq.fetch_add(1, Ordering::Relaxed) + 1
            } else {
                0
            };
            let idx = redis_now / rc.window_ms;
            // A pass that hits the cap stops at a shard; the next one starts there, so no shard's
            // keys wait behind the others' for more than a few passes.
            let first = rc.cursor.load(Ordering::Relaxed);
            for k in 0..SHARDS {
                let s = (first + k) % SHARDS;
                if out.len() >= cap {
                    rc.cursor.store(s, Ordering::Relaxed);
                    break;
                }
                let mut shard = rc.shards[s].lock().unwrap_or_else(|p| p.into_inner());
                if learn {
                    let dropped = shard.retain(|c| c.active || c.busy() || c.window + 2 > idx);
                    self.forget_keys(dropped);
                }
                for (key, c) in shard.iter_mut() {
                    if out.len() >= cap {
                        break;
                    }
                    if write && c.pending() > 0 {
                        for (target, units) in c.take() {
                            if units > 0 {
                                out.push(FlushEntry {
                                    rule: rule.clone(),
                                    key: key.to_string(),
                                    target,
                                    units,
                                    seq,
                                    learn: false,
                                });
                            }
                        }
                    }
                    if learn && c.needs_learn(rule.limit.get(), rc.window_ms, redis_now, n, seq) {
                        c.active = false;
                        out.push(FlushEntry {
                            rule: rule.clone(),
                            key: key.to_string(),
                            target: c.window,
                            units: 0,
                            seq,
                            learn: true,
                        });
                    }
                }
            }
        }
        if !out.is_empty() {
            self.stats.flushes.fetch_add(1, Ordering::Relaxed);
        }
        self.stats.entries.fetch_add(out.len() as u64, Ordering::Relaxed);
        self.stats
            .units
            .fetch_add(out.iter().map(|e| e.units).sum(), Ordering::Relaxed);
        out
    }

    /// Applies a flush reply: written units stay written and learns set the learned counts (`Ok`), written units
    /// pending again (`Err(true)`: the call surely failed), or given up as uncertain (`Err(false)`:
    /// it timed out and may have been applied).
    pub fn apply(&self, entries: &[FlushEntry], reply: Result<&[Learned], bool>) {
        match reply {
            Err(false) => self
                .stats
                .uncertain_units
                .fetch_add(entries.iter().map(|e| e.units).sum(), Ordering::Relaxed),
            Err(true) => self.stats.errors.fetch_add(1, Ordering::Relaxed),
            Ok(_) => 0,
        };
        for (i, e) in entries.iter().enumerate() {
            let Some(rc) = self.existing(&e.rule) else {
                continue;
            };
            let mut shard = rc.shards[shard_of(&e.key)]
                .lock()
                .unwrap_or_else(|p| p.into_inner());
            let Some(c) = shard.get_mut(e.key.as_str()) else {
                continue;
            };
            match reply {
                Ok(learned) if e.learn => {
                    if let Some(l) = learned.get(i) {
                        c.learn(l.window, l.cur, l.prev, e.seq);
                    }
                }
                Ok(learned) => {
                    // A write answers with its window's count after it.
                    if let Some(l) = learned.get(i) {
                        crate::metrics::over_admitted(
                            &e.rule,
                            crate::metrics::OverSource::Flush,
                            l.cur,
                            e.units,
                        );
                    }
                }
                // A learn that failed teaches nothing: the counts stay as stale as they are.
                Err(_) if e.learn => {}
                // Written, or maybe written (a timeout): it stays counted as written.
                Err(false) => {}
                Err(true) => c.resend(e.target, e.units),
            }
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

fn shard_of(key: &str) -> usize {
    (crate::store::layout::fnv1a(key.as_bytes()) % SHARDS as u64) as usize
}
