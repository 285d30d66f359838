//! The decision engine: resolves rules, asks the store, applies fail modes and combines verdicts.

use std::future::Future;
use std::pin::Pin;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, RwLock};

use floodgate_protocol::{Decision, ErrorBody};

use crate::batch::{Batcher, HotKeys};
use crate::cache::RejectionCache;
use crate::guard::Guard;
use crate::rules::{Execution, Rule, RuleSet};
use crate::shared_store::SharedStore;
use crate::store::{Clock, MemoryStore};

mod check;
mod decide;
mod degraded;
mod flush;
mod groups;
mod modes;
mod observe;
mod plan;
mod reserve;
mod shared_path;

pub use decide::combine;
use decide::finish;
use plan::lease_seed;

/// The shortest Retry-After a fail-closed rule gives while its store is away (longer while the breaker's
/// cool-down lasts). Short enough that clients come back soon after Redis does, long enough not to
/// invite a retry storm.
pub const FAIL_CLOSED_RETRY_MS: u64 = 1_000;

/// The answer to a check: at once (embedded store, errors) or after a store round trip.
pub enum Answer {
    /// Answered without waiting.
    Ready(Result<Decision, ErrorBody>),
    /// Answered when the future completes; it never fails past the store timeout.
    Pending(Pin<Box<dyn Future<Output = Result<Decision, ErrorBody>> + Send>>),
}

/// The store an agent uses.
#[derive(Clone)]
pub enum Store {
    /// The embedded in-memory store: exact for one agent, no fleet-wide sharing.
    Memory(Arc<MemoryStore>),
    /// A store the fleet shares (`floodgate-redis` implements it over Redis): fleet-wide state
    /// through atomic calls.
    Shared(Arc<dyn SharedStore>),
}

impl Store {
    /// A short name for logs: the embedded store, or the shared store's own (Redis: `redis: ` and its
    /// URLs without credentials).
    pub fn describe(&self) -> String {
        match self {
            Store::Memory(_) => "embedded in-memory store".into(),
            Store::Shared(r) => r.describe(),
        }
    }
}

/// The engine's tunables (the agent's flags fill them; defaults in one place).
#[derive(Debug, Clone)]
pub struct EngineOptions {
    /// Most cached rejections (0 turns the cache off).
    pub cache_cap: usize,
    /// Default flush interval of batched rules, in ms.
    pub flush_ms: u64,
    /// Most batched counters tracked; past it new keys run sync.
    pub max_batched_keys: usize,
    /// Sync checks per second of one (rule, key) on this agent that promote it to batched (0: off).
    pub hot_key_rate: u64,
    /// The accuracy target of `auto`: batched when the expected over-admission stays within this
    /// fraction of the limit.
    pub accuracy: f64,
    /// Where rejection events go (none: not emitted).
    pub events: Option<Arc<crate::events::Events>>,
    /// Where every decision is recorded (none: the ledger is off, the default).
    pub ledger: Option<Arc<crate::ledger::Ledger>>,
    /// Most reservations held at once (`--max-reservations`); past it a reserve is refused.
    pub max_reservations: usize,
    /// The engine's clock (the system's; a manual one in simulations).
    pub clock: Clock,
}

impl Default for EngineOptions {
    fn default() -> Self {
        EngineOptions {
            cache_cap: crate::cache::DEFAULT_CAP,
            flush_ms: crate::batch::DEFAULT_FLUSH_MS,
            max_batched_keys: crate::batch::DEFAULT_MAX_KEYS,
            hot_key_rate: DEFAULT_HOT_KEY_RATE,
            accuracy: DEFAULT_ACCURACY,
            events: None,
            ledger: None,
            max_reservations: crate::reserve::DEFAULT_MAX_RESERVATIONS,
            clock: Clock::System,
        }
    }
}

/// Sync checks per second of one key on one agent that make it hot: ~1 % of a Redis core's checks.
pub const DEFAULT_HOT_KEY_RATE: u64 = 2_000;

/// The default accuracy target of `auto` (5 % of the limit).
pub const DEFAULT_ACCURACY: f64 = 0.05;

/// The engine: a rule set (swapped whole), a store, and for Redis the guard (breaker, fallback),
/// the batched counters and the rejection cache.
pub struct Engine {
    rules: RwLock<Arc<RuleSet>>,
    store: Store,
    guard: Option<Arc<Guard>>,
    clock: Clock,
    cache: RejectionCache,
    dry_run: crate::dryrun::DryRun,
    batcher: Arc<Batcher>,
    hot: HotKeys,
    accuracy: f64,
    events: Option<Arc<crate::events::Events>>,
    ledger: Option<Arc<crate::ledger::Ledger>>,
    /// What the store admitted lately, where it can fail over (`SharedStore::fails_over`).
    recent: Option<crate::guard::Recent>,
    taken_back: Arc<TakenBack>,
    store_errors: AtomicU64,
    /// Checks (call groups) shed: answered by their fail modes without asking the store.
    shed: AtomicU64,
    last_error_log_ms: AtomicU64,
    refused_rules: std::sync::Mutex<Option<RefusedRules>>,
    /// Lease ids the agent picks (acquires that came without one): a per-process seed, mixed with
    /// a sequence, so that no two agents' ids meet.
    lease_seed: u64,
    lease_seq: AtomicU64,
    overrides: Arc<crate::overrides::Overrides>,
    /// The reservations this agent holds (protocol version 6).
    reservations: crate::reserve::Reservations,
}

/// The newest rule set the agent was handed and refused (invalid as a whole); the set in force
/// stayed. Shown in `/v1/status` and as `floodgate_rules_refused`, cleared by the next swap.
#[derive(Debug, Clone, PartialEq)]
pub struct RefusedRules {
    /// The refused set's global version.
    pub version: u64,
    /// Why it was refused.
    pub error: String,
}

impl Engine {
    /// An engine over `rules` and `store`, without a guard: a Redis failure is decided by each rule's
    /// fail mode alone (allow, or deny with a Retry-After). The agent adds the guard and its loop.
    pub fn new(rules: RuleSet, store: Store) -> Arc<Self> {
        Self::with_guard(rules, store, None, EngineOptions::default())
    }

    /// An engine with a guard for its Redis store: breaker, limit/N fallback, membership. The guard's
    /// background loop (the agent starts it) probes and writes back; without it an open breaker
    /// would never close.
    pub fn with_guard(
        rules: RuleSet,
        store: Store,
        guard: Option<Arc<Guard>>,
        options: EngineOptions,
    ) -> Arc<Self> {
        let recent = match &store {
            Store::Shared(s) if s.fails_over() => Some(crate::guard::Recent::default()),
            _ => None,
        };
        Arc::new(Engine {
            rules: RwLock::new(Arc::new(rules)),
            store,
            guard,
            clock: options.clock.clone(),
            cache: RejectionCache::new(options.cache_cap),
            dry_run: Default::default(),
            batcher: Arc::new(Batcher::with_clock(
                options.flush_ms,
                options.max_batched_keys,
                options.clock.clone(),
            )),
            hot: HotKeys::new(options.hot_key_rate),
            accuracy: options.accuracy,
            events: options.events,
            ledger: options.ledger,
            recent,
            taken_back: Arc::default(),
            store_errors: AtomicU64::new(0),
            shed: AtomicU64::new(0),
            last_error_log_ms: AtomicU64::new(0),
            refused_rules: Default::default(),
            lease_seed: lease_seed(),
            lease_seq: AtomicU64::new(0),
            overrides: Arc::default(),
            reservations: crate::reserve::Reservations::new(options.max_reservations),
        })
    }

    /// The rule set in force.
    pub fn rules(&self) -> Arc<RuleSet> {
        self.rules.read().unwrap_or_else(|p| p.into_inner()).clone()
    }

    /// Replaces the rule set; checks in flight finish with the set they started with.
    pub fn swap_rules(&self, rules: RuleSet) {
        *self.rules.write().unwrap_or_else(|p| p.into_inner()) = Arc::new(rules);
        *self.refused_rules.lock().unwrap_or_else(|p| p.into_inner()) = None;
    }

    /// Records a rule set refused as a whole (the set in force stays).
    pub fn refuse_rules(&self, refused: RefusedRules) {
        *self.refused_rules.lock().unwrap_or_else(|p| p.into_inner()) = Some(refused);
    }

    /// The newest refused rule set since the last swap, if any.
    pub fn refused_rules(&self) -> Option<RefusedRules> {
        self.refused_rules
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .clone()
    }

    /// The store.
    pub fn store(&self) -> &Store {
        &self.store
    }

    /// The guard (breaker, fallback, membership) of a Redis store.
    pub fn guard(&self) -> Option<&Arc<Guard>> {
        self.guard.as_ref()
    }

    /// The batched counters.
    pub fn batcher(&self) -> &Arc<Batcher> {
        &self.batcher
    }

    /// The hot-key detector.
    pub fn hot_keys(&self) -> &HotKeys {
        &self.hot
    }

    /// Live agents (N): learned from heartbeats, 1 without a guard.
    pub fn live_agents(&self) -> u64 {
        self.guard.as_ref().map_or(1, |g| g.membership.live().max(1))
    }

    /// Whether `rule` runs batched for `n` live agents, by its execution mode (`auto`: when the
    /// expected over-admission, n × interval × rate plus one check per agent and flush, stays within
    /// the accuracy target). Sliding window only.
    pub fn batched_by_rule(&self, rule: &Rule, n: u64) -> bool {
        if !rule.algorithm.batches() || rule.limit.get() > u64::from(u32::MAX) {
            return false;
        }
        match rule.execution {
            Execution::Sync => false,
            Execution::Batched => true,
            Execution::Auto => self.accurate_enough(rule, n),
        }
    }

    /// Whether batching `rule` keeps the expected over-admission (n × interval × rate, plus one check
    /// per agent and slot) within the accuracy target: `auto` rules and hot-key promotion ask this.
    fn accurate_enough(&self, rule: &Rule, n: u64) -> bool {
        if !rule.algorithm.batches() || rule.limit.get() > u64::from(u32::MAX) {
            return false;
        }
        let limit = rule.limit.get() as f64;
        let interval = self.batcher.flush_ms(rule) as f64;
        let expected = n as f64 * interval / rule.window_ms() as f64 * limit + n as f64;
        expected <= self.accuracy * limit
    }

    /// The per-client overrides the agent follows.
    pub fn overrides(&self) -> &Arc<crate::overrides::Overrides> {
        &self.overrides
    }

    /// The rejection cache.
    pub fn cache(&self) -> &RejectionCache {
        &self.cache
    }

    /// Units taken back after checks rejected across call groups.
    pub fn taken_back(&self) -> &TakenBack {
        &self.taken_back
    }

    /// Store failures since start (each decided by the rules' fail modes).
    pub fn store_errors(&self) -> u64 {
        self.store_errors.load(Ordering::Relaxed)
    }

    /// Checks' call groups shed since start (answered by their fail modes without the store).
    pub fn shed(&self) -> u64 {
        self.shed.load(Ordering::Relaxed)
    }

    /// What the store admitted lately, kept where it can fail over.
    pub fn recent(&self) -> Option<&crate::guard::Recent> {
        self.recent.as_ref()
    }

    /// The decision ledger, when on.
    pub fn ledger(&self) -> Option<&Arc<crate::ledger::Ledger>> {
        self.ledger.as_ref()
    }

    /// Log mode's would-be rejections since they were last reported.
    pub fn dry_run(&self) -> &crate::dryrun::DryRun {
        &self.dry_run
    }
}

/// Units taken back from Redis after checks rejected across groups.
#[derive(Default)]
pub struct TakenBack {
    /// Units a take-back was sent for.
    pub requested: AtomicU64,
    /// Units taken back.
    pub done: AtomicU64,
    /// Units whose take-back failed or timed out (they stay counted until their window ends).
    pub failed: AtomicU64,
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::overrides::{OverrideChange, Penalty, PENALTY_RULE};
    use crate::store::ItemMode;
    use floodgate_protocol::{Attributes, Check, Item};

    fn decided(engine: &Arc<Engine>, check: Check) -> Decision {
        match engine.check(check) {
            Answer::Ready(Ok(d)) => d,
            _ => panic!("the embedded store answers at once"),
        }
    }

    /// A key blocked while its request held a lease still gives the lease back: a release is never
    /// blocked (its rate rules' items are looks then).
    #[test]
    fn a_blocked_key_still_releases_its_lease() {
        let rules = RuleSet::parse(
            r#"{"rules":[{"id":"rate","dimension":"api_key","limit":100,"windowSeconds":60},
                {"id":"slots","dimension":"api_key","limit":2,"algorithm":"concurrency"}]}"#,
        )
        .unwrap();
        let engine = Engine::new(rules, Store::Memory(Arc::new(MemoryStore::default())));
        let request = |mode: ItemMode| Attributes {
            api_key: Some("k".into()),
            cost: 1,
            mode,
            lease: Some(7),
            ..Default::default()
        };
        let d = decided(&engine, Check::Attributes(request(ItemMode::Consume)));
        assert!(d.combined.allowed && d.items[1].verdict.holds_lease, "{d:?}");
        let until = Clock::System.now_ms() + 60_000;
        engine.overrides().apply(
            vec![OverrideChange {
                rule_id: PENALTY_RULE.into(),
                client_key: "apikey:k".into(),
                set: None,
                penalty: Some(Penalty {
                    factor: None,
                    block: true,
                    until,
                    reason: "test".into(),
                    version: 1,
                    updated_at: 0,
                }),
                version: 1,
            }],
            1,
        );
        let d = decided(&engine, Check::Attributes(request(ItemMode::Consume)));
        assert!(!d.combined.allowed, "blocked: {d:?}");
        decided(&engine, Check::Attributes(request(ItemMode::Release)));
        // Lifted, to look (a blocked key's peek is refused too).
        engine.overrides().apply(
            vec![OverrideChange {
                rule_id: PENALTY_RULE.into(),
                client_key: "apikey:k".into(),
                set: None,
                penalty: None,
                version: 2,
            }],
            2,
        );
        let p = decided(&engine, Check::Items(vec![Item::peek("apikey:k", "slots", 0)]));
        assert_eq!(p.items[0].verdict.remaining, 2, "the lease came back: {p:?}");
    }
}
