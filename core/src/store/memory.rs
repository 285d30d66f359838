//! The embedded in-memory store: the Lua scripts' maths in Rust, over a sharded map with expiry.

use std::collections::HashMap;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex, MutexGuard};
use std::time::{SystemTime, UNIX_EPOCH};

use super::{ItemMode, Planned};
use crate::algo::{self, BucketState, LeaseSet, Outcome, WindowState};
use crate::rules::Algorithm;

/// 64 shards keep lock contention negligible with a handful of worker threads; a multi-item check
/// locks its shards in index order, so two checks can never deadlock.
const SHARDS: usize = 64;

/// Where the store reads time.
#[derive(Debug, Clone, Default)]
pub enum Clock {
    /// The system clock, Unix ms.
    #[default]
    System,
    /// A clock tests set by hand.
    Manual(Arc<AtomicU64>),
}

impl Clock {
    /// Now, Unix ms.
    pub fn now_ms(&self) -> u64 {
        self.now_us() / 1_000
    }

    /// Now, Unix µs (a manual clock's ms, × 1,000).
    pub fn now_us(&self) -> u64 {
        match self {
            Clock::System => SystemTime::now()
                .duration_since(UNIX_EPOCH)
                .map(|d| d.as_micros() as u64)
                .unwrap_or(0),
            Clock::Manual(t) => t.load(Ordering::Relaxed) * 1_000,
        }
    }

    /// Now as an `Instant` (what the breaker's streaks and cool-downs and a check's budget are
    /// measured in): the system's, or for a manual clock one fixed instant plus its ms, so that a
    /// simulation moves them with its clock (the model test, `core/tests/model.rs`).
    pub fn instant(&self) -> std::time::Instant {
        match self {
            Clock::System => std::time::Instant::now(),
            Clock::Manual(t) => {
                static BASE: std::sync::OnceLock<std::time::Instant> = std::sync::OnceLock::new();
                *BASE.get_or_init(std::time::Instant::now)
                    + std::time::Duration::from_millis(t.load(Ordering::Relaxed))
            }
        }
    }
}

#[derive(Debug, Clone)]
enum State {
    Window(WindowState),
    Bucket(BucketState),
    /// A concurrency rule's leases (boxed: the other states stay small).
    Leases(Box<LeaseSet>),
    /// A quota's count in the period starting at `start` (Unix ms).
    Quota {
        start: u64,
        count: u64,
    },
}

#[derive(Debug, Clone)]
struct Entry {
    state: State,
    expires_at_ms: u64,
}

type Shard = HashMap<String, Entry>;

/// The embedded store. Exact and atomic for the agent that owns it; shares nothing with other agents.
pub struct MemoryStore {
    shards: Vec<Mutex<Shard>>,
    clock: Clock,
}

impl Default for MemoryStore {
    fn default() -> Self {
        Self::new(Clock::System)
    }
}

impl MemoryStore {
    /// An empty store reading time from `clock`.
    pub fn new(clock: Clock) -> Self {
        MemoryStore {
            shards: (0..SHARDS).map(|_| Mutex::new(HashMap::new())).collect(),
            clock,
        }
    }

    /// Checks the items at once: consumed costs are committed only if every enforced consume item
    /// passes; a charge is always committed, a peek never.
    pub fn check(&self, items: &[Planned]) -> Vec<Outcome> {
        let now = self.clock.now_ms();
        if let [item] = items {
            // One item (most checks): one lock, one hash lookup, nothing collected.
            let key = state_key(&item.rule, &item.key);
            let mut shard = lock(&self.shards[shard_index(&key)]);
            // A key seen before (nearly every check) is found and updated in place; a new one is
            // hashed again to be inserted (cheaper overall than the entry API, which the compiler
            // stops inlining here).
            if let Some(e) = shard.get_mut(&key) {
                let prior = Some(&*e).filter(|e| e.expires_at_ms > now).map(|e| &e.state);
                let (outcome, entry) = decide(item, prior, now);
                if commits(item, &outcome, true) {
                    *e = entry;
                }
                return vec![outcome];
            }
            let (outcome, entry) = decide(item, None, now);
            if commits(item, &outcome, true) {
                shard.insert(key, entry);
            }
            return vec![outcome];
        }
        let mut keys: Vec<String> = items.iter().map(|p| state_key(&p.rule, &p.key)).collect();
        let shard_of: Vec<usize> = keys.iter().map(|k| shard_index(k)).collect();
        let mut order = shard_of.clone();
        order.sort_unstable();
        order.dedup();
        let mut guards: Vec<(usize, MutexGuard<'_, Shard>)> =
            order.iter().map(|&i| (i, lock(&self.shards[i]))).collect();

        let mut outcomes = Vec::with_capacity(items.len());
        let mut writes = Vec::with_capacity(items.len());
        let mut all_ok = true;
        for (n, item) in items.iter().enumerate() {
            // `guards` is in `order`'s order, so the shard's position in `order` is its guard.
            let g = order.binary_search(&shard_of[n]).unwrap_or(0);
            let prior = guards[g]
                .1
                .get(&keys[n])
                .filter(|e| e.expires_at_ms > now)
                .map(|e| &e.state);
            let (outcome, entry) = decide(item, prior, now);
            if item.mode.takes_if_passed() && !outcome.allowed && item.rule.enforced() {
                all_ok = false;
            }
            if commits(item, &outcome, true) {
                writes.push((g, n, entry));
            }
            outcomes.push(outcome);
        }
        if !all_ok {
            // Rejected: the consume items that would have passed took nothing, and say so.
            for (item, o) in items.iter().zip(&mut outcomes) {
                if item.mode.takes_if_passed() && o.allowed {
                    o.remaining = (o.remaining + item.cost).min(o.limit);
                }
            }
        }
        for (g, n, entry) in writes {
            if commits(&items[n], &outcomes[n], all_ok) {
                // Each item has a key `String` of its own, used once: taken, not cloned.
                guards[g].1.insert(std::mem::take(&mut keys[n]), entry);
            }
        }
        outcomes
    }

    /// Gives back units a reservation took and did not use (`lua/check.lua`'s take-back): a
    /// sliding window's from the window they were counted in while it still counts (the current
    /// or the previous one), a token bucket's as tokens (up to its capacity), a quota's from its
    /// period while it lasts; never below 0. A concurrency rule's units are released instead.
    pub fn take_back(&self, entries: &[crate::guard::LedgerEntry]) -> u64 {
        let now = self.clock.now_ms();
        let mut applied = 0;
        for e in entries {
            let key = state_key(&e.rule, &e.key);
            let mut shard = lock(&self.shards[shard_index(&key)]);
            let Some(entry) = shard.get_mut(&key).filter(|x| x.expires_at_ms > now) else {
                continue;
            };
            let taken = |count: &mut u64| {
                let n = e.units.min(*count);
                *count -= n;
                n
            };
            applied += match (&mut entry.state, e.rule.algorithm) {
                (State::Window(w), Algorithm::SlidingWindow) if w.window == e.window => taken(&mut w.cur),
                (State::Window(w), Algorithm::SlidingWindow) if w.window == e.window + 1 => {
                    taken(&mut w.prev)
                }
                (State::Bucket(b), Algorithm::TokenBucket) => {
                    let room = (e.rule.burst() as f64 - b.tokens).max(0.0);
                    let n = (e.units as f64).min(room);
                    b.tokens += n;
                    n as u64
                }
                (State::Quota { start, count }, Algorithm::Quota) if *start == e.window => taken(count),
                _ => 0,
            };
        }
        applied
    }

    /// Drops expired entries; the agent calls it on a timer so idle keys do not accumulate.
    pub fn sweep(&self) -> usize {
        let now = self.clock.now_ms();
        let mut dropped = 0;
        for shard in &self.shards {
            let mut s = lock(shard);
            let before = s.len();
            s.retain(|_, e| e.expires_at_ms > now);
            dropped += before - s.len();
        }
        dropped
    }

    /// How many (key, rule) entries are held.
    pub fn len(&self) -> usize {
        self.shards.iter().map(|s| lock(s).len()).sum()
    }

    /// Whether no entry is held.
    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }
}

/// Whether an item's entry is written: a charge always, a peek never, a consume when it passed and
/// so did every enforced consume item of its check (`all_ok`).
fn commits(item: &Planned, outcome: &Outcome, all_ok: bool) -> bool {
    match item.mode {
        ItemMode::Consume | ItemMode::Reserve => outcome.allowed && all_ok,
        ItemMode::Peek => false,
        ItemMode::Charge | ItemMode::Release | ItemMode::Commit => true,
    }
}

/// One item's outcome from its prior state, and the entry that commits it (by the item's mode).
#[inline(always)]
fn decide(item: &Planned, prior: Option<&State>, now: u64) -> (Outcome, Entry) {
    if !item.mode.takes_if_passed() {
        return decide_mode(item, prior, now);
    }
    let rule = &item.rule;
    match rule.algorithm {
        Algorithm::Concurrency => decide_leases(item, prior, now),
        Algorithm::Quota => decide_quota(item, prior, now),
        Algorithm::SlidingWindow => {
            let prior = window_state(prior);
            let (o, next, exp) =
                algo::sliding_window(prior, rule.limit.get(), rule.window_ms(), item.cost, now);
            let entry = Entry {
                state: State::Window(next),
                expires_at_ms: exp,
            };
            (o, entry)
        }
        Algorithm::TokenBucket => {
            let prior = bucket_state(prior);
            let (o, next, exp) = algo::token_bucket(
                prior,
                rule.limit.get(),
                rule.window_ms(),
                rule.burst(),
                item.cost,
                now,
            );
            let entry = Entry {
                state: State::Bucket(next),
                expires_at_ms: exp,
            };
            (o, entry)
        }
    }
}

/// [`decide`] for a peek or a charge: kept apart so that a consume, nearly every item, runs the
/// code it ran before modes existed.
#[inline(never)]
fn decide_mode(item: &Planned, prior: Option<&State>, now: u64) -> (Outcome, Entry) {
    let rule = &item.rule;
    match rule.algorithm {
        Algorithm::Concurrency => decide_leases(item, prior, now),
        Algorithm::Quota => decide_quota(item, prior, now),
        Algorithm::SlidingWindow => {
            let prior = window_state(prior);
            let (limit, window) = (rule.limit.get(), rule.window_ms());
            let (o, next, exp) = match item.mode {
                // A commit reaches the store as the charge of what its use adds.
                ItemMode::Charge | ItemMode::Commit => {
                    algo::sliding_window_charge(prior, limit, window, item.cost, now)
                }
                // Reached for peeks (a consume or a reserve takes the path before modes; a
                // release of a rate rule is planned as a peek of 0).
                ItemMode::Peek | ItemMode::Consume | ItemMode::Release | ItemMode::Reserve => {
                    let o = algo::sliding_window_peek(prior, limit, window, item.cost, now);
                    (o, prior.unwrap_or_default(), now)
                }
            };
            let entry = Entry {
                state: State::Window(next),
                expires_at_ms: exp,
            };
            (o, entry)
        }
        Algorithm::TokenBucket => {
            let prior = bucket_state(prior);
            let (limit, window, burst) = (rule.limit.get(), rule.window_ms(), rule.burst());
            let (o, next, exp) = match item.mode {
                ItemMode::Charge | ItemMode::Commit => {
                    algo::token_bucket_charge(prior, limit, window, burst, item.cost, now)
                }
                ItemMode::Peek | ItemMode::Consume | ItemMode::Release | ItemMode::Reserve => {
                    let o = algo::token_bucket_peek(prior, limit, window, burst, item.cost, now);
                    (o, prior.unwrap_or_default(), now)
                }
            };
            let entry = Entry {
                state: State::Bucket(next),
                expires_at_ms: exp,
            };
            (o, entry)
        }
    }
}

/// A concurrency rule's item: an acquire (consume, under the item's lease), a peek or a release;
/// the entry is the key's leases after it (written by `commits`).
#[inline(never)]
fn decide_leases(item: &Planned, prior: Option<&State>, now: u64) -> (Outcome, Entry) {
    let empty = LeaseSet::default();
    let set = match prior {
        Some(State::Leases(s)) => s,
        _ => &empty,
    };
    let (limit, lease_ms) = (item.rule.limit.get(), item.rule.window_ms());
    let (o, next) = match item.mode {
        ItemMode::Consume | ItemMode::Reserve => {
            let id = item.lease.id().unwrap_or_default();
            algo::concurrency_acquire(set, limit, lease_ms, id, item.cost, now)
        }
        ItemMode::Release => {
            let mut next = set.clone();
            let o = algo::concurrency_release(&mut next, limit, item.lease.id(), item.cost, now);
            (o, next)
        }
        ItemMode::Peek => (
            algo::concurrency_peek(set, limit, item.cost, now),
            LeaseSet::default(),
        ),
        // A charge commits: its entry is the leases unchanged.
        ItemMode::Charge | ItemMode::Commit => {
            (algo::concurrency_peek(set, limit, item.cost, now), set.clone())
        }
    };
    let entry = Entry {
        expires_at_ms: next.last_expiry(now),
        state: State::Leases(Box::new(next)),
    };
    (o, entry)
}

/// A quota's item (consume, peek or charge) in the period holding `now`: the entry is the count
/// after it, expiring with the period.
#[inline(never)]
fn decide_quota(item: &Planned, prior: Option<&State>, now: u64) -> (Outcome, Entry) {
    let (start, end) = item.rule.quota_period(now);
    let count = match prior {
        Some(State::Quota { start: s, count }) if *s == start => *count,
        _ => 0,
    };
    let limit = item.rule.limit.get();
    let (o, after) = match item.mode {
        ItemMode::Charge | ItemMode::Commit => algo::quota_charge(count, limit, item.cost, now, end),
        ItemMode::Consume | ItemMode::Reserve => algo::quota(count, limit, item.cost, now, end),
        ItemMode::Peek | ItemMode::Release => (algo::quota_peek(count, limit, item.cost, now, end), count),
    };
    let entry = Entry {
        state: State::Quota { start, count: after },
        expires_at_ms: end,
    };
    (o, entry)
}

/// A sliding window's state, if the key holds one.
fn window_state(prior: Option<&State>) -> Option<WindowState> {
    match prior {
        Some(State::Window(s)) => Some(*s),
        _ => None,
    }
}

/// A token bucket's state, if the key holds one.
fn bucket_state(prior: Option<&State>) -> Option<BucketState> {
    match prior {
        Some(State::Bucket(s)) => Some(*s),
        _ => None,
    }
}

fn lock(m: &Mutex<Shard>) -> MutexGuard<'_, Shard> {
    // A panic while holding a shard lock cannot leave an entry half-written (entries are Copy and
    // inserted whole), so a poisoned lock is safe to keep using.
    m.lock().unwrap_or_else(|p| p.into_inner())
}

/// Where (rule, key)'s state lives: a quota's apart from a window's of the same rule id (an Envoy
/// descriptor's own month limit makes a quota of a sliding-window rule), as Redis keeps them.
fn state_key(rule: &crate::rules::Rule, key: &str) -> String {
    let mut s = String::with_capacity(rule.id.len() + key.len() + 3);
    s.push_str(&rule.id);
    s.push('\0');
    s.push_str(key);
    match rule.algorithm {
        Algorithm::Quota => s.push_str("\0q"),
        Algorithm::SlidingWindow | Algorithm::TokenBucket | Algorithm::Concurrency => {}
    }
    s
}

fn shard_index(key: &str) -> usize {
    // FNV-1a: cheap and good enough to spread keys over 64 locks.
    (super::layout::fnv1a(key.as_bytes()) % SHARDS as u64) as usize
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::rules::RuleSet;

    fn planned(rules: &RuleSet, rule: &str, key: &str, cost: u64) -> Planned {
        Planned {
            rule: rules.get(rule).unwrap().clone(),
            key: key.into(),
            cost,
            mode: Default::default(),
            lease: Default::default(),
        }
    }

    fn rules() -> RuleSet {
        RuleSet::parse(
            r#"{"rules":[
              {"id":"a","dimension":"user","limit":3,"windowSeconds":10},
              {"id":"b","dimension":"ip","limit":1,"windowSeconds":10},
              {"id":"dry","dimension":"ip","limit":1,"windowSeconds":10,"mode":"log"}]}"#,
        )
        .unwrap()
    }

    #[test]
    fn a_rejected_multi_item_check_consumes_nothing() {
        let clock = Arc::new(AtomicU64::new(1_000_000));
        let store = MemoryStore::new(Clock::Manual(clock));
        let r = rules();
        assert!(store.check(&[planned(&r, "b", "ip:1", 1)])[0].allowed);
        // "a" would pass, "b" does not: nothing is taken from "a".
        let out = store.check(&[planned(&r, "a", "user:1", 1), planned(&r, "b", "ip:1", 1)]);
        assert!(out[0].allowed && !out[1].allowed);
        let alone = store.check(&[planned(&r, "a", "user:1", 1)]);
        assert_eq!(
            alone[0].remaining, 2,
            "the rejected check took nothing from rule a"
        );
    }

    #[test]
    fn log_mode_items_never_block_the_others() {
        let store = MemoryStore::new(Clock::Manual(Arc::new(AtomicU64::new(5_000_000))));
        let r = rules();
        assert!(store.check(&[planned(&r, "dry", "ip:9", 1)])[0].allowed);
        let out = store.check(&[planned(&r, "a", "user:2", 1), planned(&r, "dry", "ip:9", 1)]);
        assert!(out[0].allowed && !out[1].allowed);
        assert_eq!(store.check(&[planned(&r, "a", "user:2", 1)])[0].remaining, 1);
    }

    #[test]
    fn a_quota_resets_at_its_calendar_boundary_in_its_zone() {
        let r = RuleSet::parse(
            r#"{"rules":[{"id":"m","dimension":"user","limit":3,"algorithm":"quota","period":"month","timezone":"Europe/Paris"},
                {"id":"d","dimension":"user","limit":2,"algorithm":"quota","period":"day","timezone":"Europe/Paris"}]}"#,
        )
        .unwrap();
        // 2027-01-31 22:59:00 UTC: 23:59 in Paris, January's last minute there.
        let clock = Arc::new(AtomicU64::new(1_801_436_340_000));
        let store = MemoryStore::new(Clock::Manual(clock.clone()));
        let one = |rule: &str| store.check(&[planned(&r, rule, "user:q", 1)])[0];
        for left in [2, 1, 0] {
            assert_eq!(one("m").remaining, left);
        }
        let denied = one("m");
        assert!(!denied.allowed);
        assert_eq!(
            denied.reset_at_ms, 1_801_436_400_000,
            "Paris's February 1st, 00:00"
        );
        assert_eq!(denied.retry_after_ms, 60_000);
        clock.store(1_801_436_400_000, Ordering::Relaxed);
        assert!(one("m").allowed, "a new month in Paris (still January in UTC)");
        // The spring-forward day (2027-03-28) is 23 hours long there: its count lasts until the
        // next local midnight, 23 hours after the last.
        let day_start = 1_806_188_400_000; // 2027-03-27 23:00 UTC = 2027-03-28 00:00 in Paris
        clock.store(day_start + 1_000, Ordering::Relaxed);
        one("d");
        one("d");
        let d = one("d");
        assert!(!d.allowed);
        assert_eq!(d.reset_at_ms, day_start + 23 * 3_600_000);
        clock.store(day_start + 23 * 3_600_000 - 1, Ordering::Relaxed);
        assert!(!one("d").allowed, "still the same day a millisecond before");
        clock.store(day_start + 23 * 3_600_000, Ordering::Relaxed);
        assert!(one("d").allowed, "the next day");
    }

    #[test]
    fn expired_entries_are_swept() {
        let clock = Arc::new(AtomicU64::new(1_000_000));
        let store = MemoryStore::new(Clock::Manual(clock.clone()));
        let r = rules();
        store.check(&[planned(&r, "a", "user:1", 1), planned(&r, "b", "ip:1", 1)]);
        assert_eq!(store.len(), 2);
        assert_eq!(store.sweep(), 0);
        clock.fetch_add(20_000, Ordering::Relaxed);
        assert_eq!(store.sweep(), 2);
        assert!(store.is_empty());
    }
}
