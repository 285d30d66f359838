//! The fallback limiter: while Redis is away, fail-open rules are enforced locally at limit / N (N =
//! live agents), by the embedded store's own algorithms; what it admits is kept in a ledger and written
//! back to Redis when the shard returns, so the limit holds across the outage instead of granting a
//! fresh budget.

use std::collections::HashMap;
use std::num::NonZeroU64;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Mutex};

use floodgate_protocol::CompactString;

use super::leases::LeaseLedger;
use crate::algo::Outcome;
use crate::rules::{Algorithm, Rule};
use crate::store::{Clock, ItemMode, MemoryStore, Planned};

/// Most (rule, key) pairs the ledger holds; past it new pairs are not recorded (and counted), so a
/// flood of distinct keys during an outage cannot exhaust the agent. ~100 B each: ~100 MB at most.
pub const LEDGER_CAP: usize = 1_000_000;

/// Most (rule, key) states the fallback's local store holds (~150 B each: ~150 MB at most).
pub const STORE_CAP: usize = 1_000_000;

/// Units one agent admitted locally for one (rule, key) in one window.
#[derive(Debug, Clone)]
pub struct LedgerEntry {
    /// The rule as it was when admitted.
    pub rule: Arc<Rule>,
    /// The client key.
    pub key: CompactString,
    /// The window index (local clock) the units belong to; for a concurrency rule, the lease (to
    /// take, or for a take-back to free).
    pub window: u64,
    /// Units admitted.
    pub units: u64,
}

/// The local limiter used while the store is away.
pub struct Fallback {
    store: MemoryStore,
    clock: Clock,
    /// Per rule id: the rule at limit / N, with what it was made from.
    scaled: Mutex<HashMap<String, Scaled>>,
    ledger: Mutex<HashMap<(CompactString, CompactString), LedgerEntry>>,
    /// The concurrency rules' leases granted here, to be taken in the store once it answers.
    leases: LeaseLedger,
    /// Checks decided here.
    pub decided: AtomicU64,
    /// Units written back to Redis after recoveries.
    pub written_back: AtomicU64,
    /// Units of write-back entries Redis refused (an error of the script on that entry): dropped,
    /// never retried, so that they hold back no other entry.
    pub write_back_refused: AtomicU64,
    /// Entries taken from the ledger for a write-back call still in flight (counted as waiting
    /// until its units are counted written back or refused).
    pub writing_back: AtomicU64,
    /// (rule, key) pairs not recorded because the ledger was full.
    pub ledger_dropped: AtomicU64,
    /// Checks answered without local state because the local store was full.
    pub store_full: AtomicU64,
    full: AtomicBool,
    store_cap: usize,
}

/// A rule at limit / N: the rule it was made from, N, and the scaled copy.
struct Scaled(Arc<Rule>, u64, Arc<Rule>);

impl Default for Fallback {
    fn default() -> Self {
        Self::new(Clock::System)
    }
}

impl Fallback {
    /// An empty fallback limiter.
    pub fn new(clock: Clock) -> Self {
        Fallback {
            store: MemoryStore::new(clock.clone()),
            clock,
            scaled: Mutex::new(HashMap::new()),
            ledger: Mutex::new(HashMap::new()),
            leases: LeaseLedger::default(),
            decided: AtomicU64::new(0),
            written_back: AtomicU64::new(0),
            write_back_refused: AtomicU64::new(0),
            writing_back: AtomicU64::new(0),
            ledger_dropped: AtomicU64::new(0),
            store_full: AtomicU64::new(0),
            full: AtomicBool::new(false),
            store_cap: STORE_CAP,
        }
    }

    /// The rule with its limit (and burst) divided by `n`, at least 1; cached per rule id, and
    /// found without an allocation while the rule set (whose `Arc`s the checks carry) and N stay
    /// the same: past capacity every shed check comes here, and a copy of the rule per check cost
    /// several allocations and a comparison of every field.
    fn scaled(&self, rule: &Arc<Rule>, n: u64) -> Arc<Rule> {
        if n <= 1 {
            return rule.clone();
        }
        let mut cache = self.scaled.lock().unwrap_or_else(|p| p.into_inner());
        if let Some(Scaled(from, cached_n, scaled)) = cache.get_mut(rule.id.as_str()) {
            if *cached_n == n && Arc::ptr_eq(from, rule) {
                return scaled.clone();
            }
            // The same rule in a new set: kept, and found by pointer from now on.
            if *cached_n == n && **from == **rule {
                *from = rule.clone();
                return scaled.clone();
            }
        }
        let mut r = (**rule).clone();
        r.limit = share(rule.limit, n);
        r.burst = rule.burst.map(|b| share(b, n));
        if cache.len() > 10_000 {
            cache.clear();
        }
        let r = Arc::new(r);
        cache.insert(rule.id.clone(), Scaled(rule.clone(), n, r.clone()));
        r
    }

    /// Decides the items locally at limit / `n`, all or nothing like every store, and keeps what it
    /// admitted for the write-back, for the items whose `record` flag is set (one flag per item).
    pub fn check(&self, items: &[Planned], n: u64, record: &[bool]) -> Vec<Outcome> {
        let decided = self.decided.fetch_add(1, Ordering::Relaxed);
        // Bounded memory: every 1,024 checks look at the local store's size; while it holds more
        // than STORE_CAP keys (a flood of distinct keys during an outage), answer plain fail-open
        // without local state, until the sweep has expired enough of them.
        if decided.is_multiple_of(1_024) {
            self.full
                .store(self.store.len() >= self.store_cap, Ordering::Relaxed);
        }
        if self.full.load(Ordering::Relaxed) {
            self.store_full.fetch_add(1, Ordering::Relaxed);
            let now = self.clock.now_ms();
            return items
                .iter()
                .map(|p| {
                    let limit = p.rule.limit.get();
                    Outcome {
                        allowed: true,
                        limit,
                        remaining: limit,
                        reset_at_ms: now + p.rule.window_ms(),
                        retry_after_ms: 0,
                    }
                })
                .collect();
        }
        let local: Vec<Planned> = items
            .iter()
            .map(|p| Planned {
                rule: self.scaled(&p.rule, n),
                key: p.key.clone(),
                cost: p.cost,
                mode: p.mode,
                lease: p.lease,
            })
            .collect();
        let outcomes = self.store.check(&local);
        let committed = items
            .iter()
            .zip(&outcomes)
            .all(|(p, o)| o.allowed || !p.rule.enforced());
        if committed {
            self.leases_granted(items, &outcomes);
        }
        if committed && record.iter().any(|r| *r) {
            let now = self.clock.now_ms();
            let mut ledger = self.ledger.lock().unwrap_or_else(|p| p.into_inner());
            for ((p, o), rec) in items.iter().zip(&outcomes).zip(record) {
                // A concurrency rule's leases are kept apart (`leases_granted`).
                if !o.allowed || !rec || p.rule.is_concurrency() {
                    continue;
                }
                // A quota's units belong to its period (named by its start), a window's to its index.
                let window = match p.rule.algorithm {
                    Algorithm::Quota => p.rule.quota_period(now).0,
                    Algorithm::SlidingWindow | Algorithm::TokenBucket | Algorithm::Concurrency => {
                        now / p.rule.window_ms()
                    }
                };
                // Rule ids are at most 128 bytes; one of up to 24 is kept inline, no allocation.
                let k = (CompactString::from(p.rule.id.as_str()), p.key.clone());
                let full = ledger.len() >= LEDGER_CAP;
                match ledger.get_mut(&k) {
                    Some(e) if e.window == window => e.units += p.cost,
                    Some(e) => {
                        *e = LedgerEntry {
                            rule: p.rule.clone(),
                            key: p.key.clone(),
                            window,
                            units: p.cost,
                        }
                    }
                    None if full => {
                        self.ledger_dropped.fetch_add(1, Ordering::Relaxed);
                    }
                    None => {
                        ledger.insert(
                            k,
                            LedgerEntry {
                                rule: p.rule.clone(),
                                key: p.key.clone(),
                                window,
                                units: p.cost,
                            },
                        );
                    }
                }
            }
        }
        outcomes
    }

    /// Keeps the leases a committed check acquired here, for the store to take once it answers.
    /// Every one, also those of acquires that timed out (and may have run in the store): taking a
    /// lease the store holds already renews it.
    fn leases_granted(&self, items: &[Planned], outcomes: &[Outcome]) {
        let now = self.clock.now_ms();
        for (p, o) in items.iter().zip(outcomes) {
            let Some(id) = p.lease.id() else { continue };
            let acquired = p.rule.is_concurrency() && o.allowed && p.mode == ItemMode::Consume;
            if acquired && !self.leases.granted(&p.rule, &p.key, id, p.cost, now) {
                self.ledger_dropped.fetch_add(1, Ordering::Relaxed);
            }
        }
    }

    /// Frees a concurrency item's lease (or units by count) among the leases held here while the
    /// store was away, at limit / `n`: a release reaches them whether or not the store answered.
    /// A lease not yet taken in the store is forgotten there too.
    pub fn release(&self, item: &Planned, n: u64) -> Outcome {
        let local = Planned {
            rule: self.scaled(&item.rule, n),
            ..item.clone()
        };
        match item.lease.id() {
            Some(id) => self.leases.released(&item.rule.id, &item.key, id),
            None => self.leases.released_by_count(&item.rule.id, &item.key, item.cost),
        }
        self.store.check(std::slice::from_ref(&local))[0]
    }

    /// Takes up to `max` ledger entries that still count in Redis (those of the current window and
    /// of the one before: a sliding window still weighs it) and that are `ready` (their shard
    /// answers again); the others stay. Older entries are dropped: Redis would have expired them
    /// anyway. Bounded, so a huge ledger never stalls the agent's thread for long; and what is not
    /// ready is never taken and put back: while one shard of several was away, taking the whole
    /// ledger and restoring it each pass cost ~20x a fail-mode check's own work (BENCHMARKS.md,
    /// "Past capacity, again").
    pub fn drain(&self, max: usize, ready: impl Fn(&LedgerEntry) -> bool) -> Vec<LedgerEntry> {
        let now = self.clock.now_ms();
        let mut ledger = self.ledger.lock().unwrap_or_else(|p| p.into_inner());
        ledger.retain(|_, e| match e.rule.algorithm {
            // A quota's units count until their period ends.
            Algorithm::Quota => e.rule.quota_period(now).0 == e.window,
            Algorithm::SlidingWindow | Algorithm::TokenBucket | Algorithm::Concurrency => {
                e.window + 1 >= now / e.rule.window_ms()
            }
        });
        let keys: Vec<(CompactString, CompactString)> = ledger
            .iter()
            .filter(|(_, e)| ready(e))
            .map(|(k, _)| k.clone())
            .take(max)
            .collect();
        let mut taken: Vec<LedgerEntry> = keys.into_iter().filter_map(|k| ledger.remove(&k)).collect();
        drop(ledger);
        let room = max.saturating_sub(taken.len());
        taken.extend(self.leases.drain(room, now, ready));
        taken
    }

    /// Puts entries back after a failed write-back (merging with what was admitted since), so a
    /// write-back tried while Redis is still failing loses nothing.
    pub fn restore(&self, entries: Vec<LedgerEntry>) {
        let now = self.clock.now_ms();
        let mut ledger = self.ledger.lock().unwrap_or_else(|p| p.into_inner());
        for e in entries {
            if e.rule.is_concurrency() {
                self.leases.restore(e, now);
                continue;
            }
            match ledger.get_mut(&(CompactString::from(e.rule.id.as_str()), e.key.clone())) {
                Some(cur) if cur.window == e.window => cur.units += e.units,
                // Units of the window before the one now recorded for this key are dropped: one
                // entry per key keeps the ledger bounded (noted in docs/redis.md).
                Some(_) => {}
                None => {
                    ledger.insert((CompactString::from(e.rule.id.as_str()), e.key.clone()), e);
                }
            }
        }
    }

    /// Entries waiting to be written back.
    pub fn pending(&self) -> usize {
        self.ledger.lock().unwrap_or_else(|p| p.into_inner()).len() + self.leases.len()
    }

    /// Entries not yet written back: waiting, and in a write-back call still in flight (what
    /// `/v1/status` reports, so that a call in flight never looks like nothing left to write).
    pub fn not_written_back(&self) -> usize {
        self.pending() + self.writing_back.load(std::sync::atomic::Ordering::Relaxed) as usize
    }

    /// Drops expired local state (the agent calls it on a timer).
    pub fn sweep(&self) {
        self.store.sweep();
    }
}

fn share(limit: NonZeroU64, n: u64) -> NonZeroU64 {
    NonZeroU64::new(limit.get() / n.max(1)).unwrap_or(NonZeroU64::MIN)
}

#[cfg(test)]
#[path = "fallback_tests.rs"]
mod tests;
