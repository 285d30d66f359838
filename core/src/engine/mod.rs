//! The decision engine: resolves rules, asks the store, applies fail modes and combines verdicts.

use std::future::Future;
use std::pin::Pin;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, RwLock};

use floodgate_protocol::{
    Check, CompactString, Decision, ErrorBody, ErrorCode, ItemDecision, Source, Verdict, MAX_ITEMS,
};

use crate::algo::Outcome;
use crate::batch::{Batcher, HotKeys};
use crate::cache::RejectionCache;
use crate::guard::Guard;
use crate::rules::{items_for, Algorithm, Execution, Rule, RuleSet};
use crate::shared_store::SharedStore;
use crate::store::{Clock, ItemMode, Lease, MemoryStore, Planned};

mod shared_path;

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
            clock: Clock::System,
            cache: RejectionCache::new(options.cache_cap),
            dry_run: Default::default(),
            batcher: Arc::new(Batcher::new(options.flush_ms, options.max_batched_keys)),
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
        if rule.algorithm != Algorithm::SlidingWindow || rule.limit.get() > u64::from(u32::MAX) {
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
        if rule.algorithm != Algorithm::SlidingWindow || rule.limit.get() > u64::from(u32::MAX) {
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

    /// Decides a check.
    pub fn check(self: &Arc<Self>, check: Check) -> Answer {
        self.check_received(check, std::time::Instant::now())
    }

    /// [`check`](Self::check) of a frame read at `received`: the store's budget runs from then, so
    /// time spent in the agent before the store is asked counts against it.
    pub fn check_received(self: &Arc<Self>, check: Check, received: std::time::Instant) -> Answer {
        self.check_under(check, &[], received)
    }

    /// [`check_received`](Self::check_received) with some items checked under a rule of the
    /// caller's (by item index; Envoy's per-request `RateLimitOverride`): the same id, its own
    /// figures.
    pub fn check_under(
        self: &Arc<Self>,
        check: Check,
        under: &[(usize, Arc<Rule>)],
        received: std::time::Instant,
    ) -> Answer {
        // The request phase of a request whose cost comes after its response: its rate rules peek,
        // its concurrency rules acquire under its lease, and the peeks decide first.
        let looks_first =
            matches!(&check, Check::Attributes(a) if a.mode == ItemMode::Peek && a.lease.is_some());
        let mut plan = match self.plan(check) {
            Ok(plan) => plan,
            Err(e) => return Answer::Ready(Err(e)),
        };
        for (i, rule) in under {
            if let Some(p) = plan.get_mut(*i) {
                p.rule = rule.clone();
            }
        }
        if self.overrides.penalties() > 0 {
            if let Some(blocked) = self.penalize(&mut plan) {
                return Answer::Ready(Ok(blocked));
            }
        }
        if looks_first && plan.iter().any(|p| p.mode == ItemMode::Consume) {
            return self.looks_first(plan, received);
        }
        self.answer_plan(plan, received)
    }

    /// Applies the penalties of the check's keys: a scaled limit, or (a block) the check refused at
    /// once, the blocked items waiting for the penalty's end and the others reporting their rule.
    fn penalize(&self, plan: &mut [Planned]) -> Option<Decision> {
        let now = self.clock.now_ms();
        let mut blocked: Vec<Option<(Outcome, Source)>> = vec![None; plan.len()];
        let mut any = false;
        // A check that gives units back is never blocked: its release must land (its rate rules'
        // items are looks of 0 then).
        let releases = plan.iter().any(|p| p.mode == ItemMode::Release);
        for (i, p) in plan.iter_mut().enumerate() {
            match self.overrides.penalized(&p.rule, &p.key, now) {
                Some(crate::overrides::Penalized::Rule(r)) => p.rule = r,
                Some(crate::overrides::Penalized::Blocked(until))
                    if !releases
                        && p.rule.enforced()
                        && matches!(p.mode, ItemMode::Consume | ItemMode::Peek) =>
                {
                    any = true;
                    let limit = p.rule.display_limit();
                    let o = Outcome {
                        allowed: false,
                        limit,
                        remaining: 0,
                        reset_at_ms: until,
                        retry_after_ms: until.saturating_sub(now).max(1),
                    };
                    blocked[i] = Some((o, Source::Local));
                }
                _ => {}
            }
        }
        any.then(|| finish(plan, blocked))
    }

    /// A check of peeks and concurrency acquires (a form-3 peek with a lease): every item peeked
    /// first; refused, the check is that answer and nothing is held; else it runs as planned. (A
    /// quota spent between the two is a peek's usual race: the request's cost is charged after.)
    fn looks_first(self: &Arc<Self>, plan: Vec<Planned>, received: std::time::Instant) -> Answer {
        let looks: Vec<Planned> = plan
            .iter()
            .map(|p| Planned {
                mode: ItemMode::Peek,
                lease: Lease::None,
                ..p.clone()
            })
            .collect();
        let first = self.answer_plan(looks, received);
        let this = self.clone();
        Answer::Pending(Box::pin(async move {
            let looked = match first {
                Answer::Ready(r) => r,
                Answer::Pending(f) => f.await,
            }?;
            if !looked.combined.allowed {
                return Ok(looked);
            }
            match this.answer_plan(plan, received) {
                Answer::Ready(r) => r,
                Answer::Pending(f) => f.await,
            }
        }))
    }

    /// Decides a planned check.
    fn answer_plan(self: &Arc<Self>, plan: Vec<Planned>, received: std::time::Instant) -> Answer {
        if plan.is_empty() {
            return Answer::Ready(Ok(Decision {
                combined: no_rule(),
                items: Vec::new(),
            }));
        }
        // Items of rules in log mode: what they would have rejected is the dry run's to count. With
        // events on, every item: a rejection becomes an event (the key is only in the plan).
        let events = self.events.is_some();
        let logged: Vec<(usize, Arc<Rule>, CompactString)> = plan
            .iter()
            .enumerate()
            // A charge is never a rejection, a peek takes nothing: neither is evented nor a
            // would-be rejection of the dry run.
            .filter(|(_, p)| (events || !p.rule.enforced()) && p.mode == ItemMode::Consume)
            .map(|(i, p)| (i, p.rule.clone(), p.key.clone()))
            .collect();
        // With the ledger on, or the store's admissions kept for a failover, the plan is kept to
        // record the decision's items against.
        let ledger = (self.ledger.is_some() || self.recent.is_some()).then(|| plan.clone());
        let answer = match &self.store {
            Store::Memory(m) => {
                let outcomes = m.check(&plan);
                Answer::Ready(Ok(combine(&plan, &outcomes, &[Source::Local])))
            }
            Store::Shared(r) => self.check_shared(r, plan, received),
        };
        let answer = match ledger {
            Some(plan) => self.recorded(plan, answer, received),
            None => answer,
        };
        if logged.is_empty() {
            return answer;
        }
        match answer {
            Answer::Ready(Ok(d)) => {
                self.observe(&logged, &d);
                Answer::Ready(Ok(d))
            }
            Answer::Pending(fut) => {
                let this = self.clone();
                Answer::Pending(Box::pin(async move {
                    let r = fut.await;
                    if let Ok(d) = &r {
                        this.observe(&logged, d);
                    }
                    r
                }))
            }
            other => other,
        }
    }

    /// The answer, recorded once decided: in the ledger, the plan's items and their verdicts, with
    /// when the check was read and decided and the store clock's offset as learned; in `recent`,
    /// the units the store admitted.
    fn recorded(
        self: &Arc<Self>,
        plan: Vec<Planned>,
        answer: Answer,
        received: std::time::Instant,
    ) -> Answer {
        let record = move |this: &Engine, d: &Decision| {
            let done = this.clock.now_ms();
            if let Some(recent) = &this.recent {
                for (p, it) in plan.iter().zip(&d.items) {
                    let counted = matches!(p.mode, ItemMode::Consume | ItemMode::Charge);
                    if counted && it.verdict.allowed && it.verdict.source == Source::Redis {
                        recent.record(&p.rule, &p.key, p.cost, done);
                    }
                }
            }
            if let Some(ledger) = &this.ledger {
                let recv = done.saturating_sub(received.elapsed().as_millis() as u64);
                ledger.record(&plan, d, recv, done, this.batcher.offset_ms());
            }
        };
        match answer {
            Answer::Ready(Ok(d)) => {
                record(self, &d);
                Answer::Ready(Ok(d))
            }
            Answer::Pending(fut) => {
                let this = self.clone();
                Answer::Pending(Box::pin(async move {
                    let r = fut.await;
                    if let Ok(d) = &r {
                        record(&this, d);
                    }
                    r
                }))
            }
            other => other,
        }
    }

    /// Counts the log-mode items a decision would have rejected, and emits an event for each enforced
    /// item the limiter rejected and for each would-be rejection the dry run calls news (`mode`
    /// `log`). Repeats answered from the rejection cache make no event: the key's first rejection
    /// already said it is blocked until its reset, and a hot abusive key must not flood the stream
    /// (and Redis) the cache keeps it away from; they are counted in
    /// `floodgate_checks_total{source="cache"}`.
    fn observe(&self, logged: &[(usize, Arc<Rule>, CompactString)], d: &Decision) {
        if d.combined.allowed && logged.iter().all(|(_, r, _)| r.enforced()) {
            return;
        }
        let now = self.clock.now_ms();
        for (i, rule, key) in logged {
            let Some(it) = d.items.get(*i) else { continue };
            if it.verdict.allowed {
                continue;
            }
            if it.verdict.source == Source::Cache {
                continue;
            }
            // A log-mode rule's would-be rejection is an event when the dry run says it is news
            // (the key's first since its last report), as an enforced key's repeats are kept off
            // the stream by the rejection cache.
            let news = rule.enforced() || self.dry_run.record(&rule.id, rule.version, key, now);
            if let (Some(events), true) = (&self.events, news) {
                events.emit(crate::events::Event {
                    key: key.to_string(),
                    rule: rule.id.clone(),
                    ts_ms: now,
                    version: rule.version,
                    dry_run: !rule.enforced(),
                });
            }
        }
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

    /// What an item does to its rule: a concurrency rule's consume acquires under the client's lease
    /// (or one the agent picks), its charge is a peek; another rule's release is a peek of 0.
    fn item_mode(
        &self,
        rule: &Rule,
        mode: ItemMode,
        lease: Option<u64>,
        cost: u32,
    ) -> (ItemMode, Lease, u64) {
        let cost = u64::from(cost);
        if !rule.is_concurrency() {
            return match mode {
                ItemMode::Release => (ItemMode::Peek, Lease::None, 0),
                _ => (mode, Lease::None, cost),
            };
        }
        match (mode, lease) {
            // A peek with a lease (the request phase of a cost known after the response) holds a
            // unit of each concurrency rule it matches while the request runs.
            (ItemMode::Peek, Some(id)) => (ItemMode::Consume, Lease::Client(id), cost.max(1)),
            (ItemMode::Consume, Some(id)) => (mode, Lease::Client(id), cost),
            (ItemMode::Consume, None) => (mode, Lease::Agent(self.agent_lease()), cost),
            (ItemMode::Release, Some(id)) => (mode, Lease::Client(id), cost),
            (ItemMode::Release, None) => (mode, Lease::None, cost),
            (ItemMode::Peek | ItemMode::Charge, _) => (ItemMode::Peek, Lease::None, cost),
        }
    }

    /// A lease id of the agent's own.
    fn agent_lease(&self) -> u64 {
        let n = self.lease_seq.fetch_add(1, Ordering::Relaxed);
        splitmix64(
            self.lease_seed
                .wrapping_add(n.wrapping_mul(0x9e37_79b9_7f4a_7c15)),
        )
    }

    fn plan(&self, check: Check) -> Result<Vec<Planned>, ErrorBody> {
        let rules = self.rules();
        let plan: Vec<Planned> = match check {
            Check::Items(items) => items
                .into_iter()
                .map(|item| match rules.get(&item.rule_id) {
                    Some(rule) => {
                        // An item's peek only looks, lease or not.
                        let lease = item.lease.filter(|_| item.mode != ItemMode::Peek);
                        let (mode, lease, cost) = self.item_mode(rule, item.mode, lease, item.cost);
                        Ok(Planned {
                            rule: rule.clone(),
                            key: item.key,
                            cost,
                            mode,
                            lease,
                        })
                    }
                    None => Err(ErrorBody {
                        code: ErrorCode::UnknownRule,
                        message: format!("unknown rule {:?}", item.rule_id),
                    }),
                })
                .collect::<Result<_, _>>()?,
            Check::Attributes(a) => items_for(&rules, &a)
                .into_iter()
                .map(|(rule, key)| {
                    let (mode, lease, cost) = self.item_mode(&rule, a.mode, a.lease, a.cost);
                    Planned {
                        rule,
                        key: key.into(),
                        cost,
                        mode,
                        lease,
                    }
                })
                .collect(),
        };
        let mut plan = plan;
        if !self.overrides.is_empty() {
            // A client key with an override is checked under the rule its override makes.
            let now = self.clock.now_ms();
            for p in &mut plan {
                if let Some(rule) = self.overrides.rule_for(&p.rule, &p.key, now) {
                    p.rule = rule;
                }
            }
        }
        if plan.len() > MAX_ITEMS {
            return Err(ErrorBody {
                code: ErrorCode::InvalidItem,
                message: format!(
                    "{} rules matched; at most {MAX_ITEMS} can be checked at once",
                    plan.len()
                ),
            });
        }
        for (i, p) in plan.iter().enumerate() {
            if plan[..i].iter().any(|q| q.rule.id == p.rule.id && q.key == p.key) {
                return Err(ErrorBody {
                    code: ErrorCode::InvalidItem,
                    message: format!("item ({:?}, {:?}) appears twice in one check", p.key, p.rule.id),
                });
            }
        }
        Ok(plan)
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

/// A per-process seed for the agent's lease ids: the clock's nanoseconds and the process id.
fn lease_seed() -> u64 {
    let nanos = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map(|d| d.as_nanos() as u64)
        .unwrap_or(0);
    splitmix64(nanos ^ (u64::from(std::process::id()) << 32))
}

/// SplitMix64's output function: spreads a sequence over all 64 bits.
fn splitmix64(mut z: u64) -> u64 {
    z = (z ^ (z >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
    z = (z ^ (z >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
    z ^ (z >> 31)
}

/// An item a check did not look at because another item rejected it: its rule's plain figures.
fn unseen(rule: &Rule, now: u64) -> Outcome {
    let limit = rule.display_limit();
    Outcome {
        allowed: true,
        limit,
        remaining: limit,
        reset_at_ms: now,
        retry_after_ms: 0,
    }
}

/// The decision from every item's outcome and source.
fn finish(plan: &[Planned], out: Vec<Option<(Outcome, Source)>>) -> Decision {
    let now = Clock::System.now_ms();
    decide(
        plan,
        out.into_iter()
            .zip(plan)
            .map(|(o, p)| o.unwrap_or_else(|| (unseen(&p.rule, now), Source::Fallback))),
    )
}

fn no_rule() -> Verdict {
    Verdict {
        allowed: true,
        log_only: false,
        holds_lease: false,
        source: Source::Local,
        limit: 0,
        remaining: 0,
        reset_at_ms: 0,
        retry_after_ms: 0,
    }
}

/// Per-item verdicts and the combined one: allowed only if every enforced item is; the figures of the
/// binding item (on a denial the longest retry, else the smallest remaining). `sources` has one
/// source per item, or one for all.
pub fn combine(plan: &[Planned], outcomes: &[Outcome], sources: &[Source]) -> Decision {
    let source = |i: usize| {
        sources
            .get(i)
            .or(sources.first())
            .copied()
            .unwrap_or(Source::Local)
    };
    decide(plan, outcomes.iter().enumerate().map(|(i, o)| (*o, source(i))))
}

/// `combine` over each item's (outcome, source) in plan order, with no vectors in between.
fn decide(plan: &[Planned], outcomes: impl Iterator<Item = (Outcome, Source)>) -> Decision {
    let items: Vec<ItemDecision> = plan
        .iter()
        .zip(outcomes)
        .map(|(p, (o, source))| ItemDecision {
            rule_id: p.rule.id.as_str().into(),
            verdict: Verdict {
                allowed: o.allowed,
                log_only: !p.rule.enforced(),
                // The client's lease its concurrency item acquired (cleared below if the check
                // was denied: then nothing is held).
                holds_lease: o.allowed
                    && p.mode == ItemMode::Consume
                    && matches!(p.lease, Lease::Client(_))
                    && source != Source::Cache,
                source,
                limit: o.limit,
                remaining: o.remaining,
                reset_at_ms: o.reset_at_ms,
                retry_after_ms: o.retry_after_ms,
            },
            window_ms: p.rule.policy_window_ms(o.reset_at_ms),
        })
        .collect();
    // What decides the check: its consume items; a check without any, its peeks (a charge or a
    // release is never a rejection).
    let consumes = plan.iter().any(|p| p.mode == ItemMode::Consume);
    let gates = |mode: ItemMode| match mode {
        ItemMode::Consume => true,
        ItemMode::Peek => !consumes,
        ItemMode::Charge | ItemMode::Release => false,
    };
    let denied = items
        .iter()
        .zip(plan)
        .filter(|(i, p)| !i.verdict.log_only && !i.verdict.allowed && gates(p.mode))
        .map(|(i, _)| i.verdict)
        .max_by_key(|v| v.retry_after_ms);
    let mut items = items;
    if denied.is_some() {
        for i in &mut items {
            i.verdict.holds_lease = false;
        }
    }
    let enforced = || items.iter().filter(|i| !i.verdict.log_only);
    let binding = denied.or_else(|| {
        // Allowed: the tightest enforced item's figures (a denied peek beside consume items
        // included, as what it would cost), the check itself allowed.
        enforced()
            .min_by_key(|i| (i.verdict.remaining, i.verdict.limit))
            .map(|i| Verdict {
                allowed: true,
                retry_after_ms: 0,
                ..i.verdict
            })
    });
    let combined = match binding {
        Some(v) => v,
        // Only log-mode items: allowed, with the figures of the tightest of them, marked log-only.
        None => {
            let mut v = items
                .iter()
                .min_by_key(|i| (i.verdict.remaining, i.verdict.limit))
                .map(|i| i.verdict)
                .unwrap_or_else(no_rule);
            v.allowed = true;
            v.retry_after_ms = 0;
            v
        }
    };
    Decision { combined, items }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::overrides::{OverrideChange, Penalty, PENALTY_RULE};
    use floodgate_protocol::{Attributes, Item};

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
