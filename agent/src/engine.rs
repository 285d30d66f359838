//! The decision engine: resolves rules, asks the store, applies fail modes and combines verdicts.

use std::future::Future;
use std::pin::Pin;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, RwLock};
use std::time::Instant;

use floodgate_protocol::{Check, Decision, ErrorBody, ErrorCode, ItemDecision, Source, Verdict, MAX_ITEMS};

use crate::algo::Outcome;
use crate::batch::{Batcher, Denial, HotKeys};
use crate::cache::RejectionCache;
use crate::guard::{BreakerState, Guard, LedgerEntry, Permit, Transition};
use crate::rules::{items_for, Algorithm, Execution, FailMode, Rule, RuleSet};
use crate::store::{Adjust, Clock, Planned, RedisStore, Route, Store, StoreError};

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
    taken_back: Arc<TakenBack>,
    store_errors: AtomicU64,
    last_error_log_ms: AtomicU64,
}

impl Engine {
    /// An engine over `rules` and `store`, without a guard: a Redis failure is decided by each rule's
    /// fail mode alone (allow, or deny with a Retry-After). `crate::run` adds the guard and its loop.
    pub fn new(rules: RuleSet, store: Store) -> Arc<Self> {
        Self::with_guard(rules, store, None, EngineOptions::default())
    }

    /// An engine with a guard for its Redis store: breaker, limit/N fallback, membership. The guard's
    /// background loop (`crate::run` starts it) probes and writes back; without it an open breaker
    /// would never close.
    pub fn with_guard(
        rules: RuleSet,
        store: Store,
        guard: Option<Arc<Guard>>,
        options: EngineOptions,
    ) -> Arc<Self> {
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
            taken_back: Arc::default(),
            store_errors: AtomicU64::new(0),
            last_error_log_ms: AtomicU64::new(0),
        })
    }

    /// The rule set in force.
    pub fn rules(&self) -> Arc<RuleSet> {
        self.rules.read().unwrap_or_else(|p| p.into_inner()).clone()
    }

    /// Replaces the rule set; checks in flight finish with the set they started with.
    pub fn swap_rules(&self, rules: RuleSet) {
        *self.rules.write().unwrap_or_else(|p| p.into_inner()) = Arc::new(rules);
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

    /// Whether this item runs batched now: by its rule, or because its key is hot (only where
    /// batching the rule would meet the accuracy target: a login rule of 5 per 10 minutes stays sync
    /// however hot); never while its shard's breaker is open (the fallback decides then) or when the
    /// batcher is full.
    fn runs_batched(&self, r: &RedisStore, p: &Planned, n: u64, now: u64) -> bool {
        if p.rule.algorithm != Algorithm::SlidingWindow {
            return false;
        }
        if let Some(g) = &self.guard {
            if g.breaker(r.route(&p.key).shard).snapshot().state != BreakerState::Closed {
                return false;
            }
        }
        let by_rule = self.batched_by_rule(&p.rule, n);
        let promotable = !by_rule && self.hot.threshold() > 0 && self.accurate_enough(&p.rule, n);
        let hot = promotable && self.hot.is_hot(&p.rule.id, &p.key, now);
        if !(by_rule || hot) {
            if promotable && self.hot.note(&p.rule.id, &p.key, now) {
                tracing::info!(rule = %p.rule.id, key = %p.key, threshold = self.hot.threshold(), "hot key promoted to batched execution");
            }
            return false;
        }
        if hot {
            self.hot.keep(&p.rule.id, &p.key, now);
        }
        if !self.batcher.has_room() {
            self.batcher.stats.full.fetch_add(1, Ordering::Relaxed);
            return false;
        }
        true
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

    /// Decides a check.
    pub fn check(self: &Arc<Self>, check: Check) -> Answer {
        let plan = match self.plan(check) {
            Ok(plan) => plan,
            Err(e) => return Answer::Ready(Err(e)),
        };
        if plan.is_empty() {
            return Answer::Ready(Ok(Decision {
                combined: no_rule(),
                items: Vec::new(),
            }));
        }
        // Items of rules in log mode: what they would have rejected is the dry run's to count. With
        // events on, every item: a rejection becomes an event (the key is only in the plan).
        let events = self.events.is_some();
        let logged: Vec<(usize, Arc<Rule>, String)> = plan
            .iter()
            .enumerate()
            .filter(|(_, p)| events || !p.rule.enforced())
            .map(|(i, p)| (i, p.rule.clone(), p.key.clone()))
            .collect();
        let answer = match &self.store {
            Store::Memory(m) => {
                let outcomes = m.check(&plan);
                Answer::Ready(Ok(combine(&plan, &outcomes, &[Source::Local])))
            }
            Store::Redis(r) => self.check_redis(r, plan),
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

    /// Counts the log-mode items a decision would have rejected, and emits an event for each enforced
    /// item the limiter rejected and for each would-be rejection the dry run calls news (`mode`
    /// `log`). Repeats answered from the rejection cache make no event: the key's first rejection
    /// already said it is blocked until its reset, and a hot abusive key must not flood the stream
    /// (and Redis) the cache keeps it away from; they are counted in
    /// `floodgate_checks_total{source="cache"}`.
    fn observe(&self, logged: &[(usize, Arc<Rule>, String)], d: &Decision) {
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
                    key: key.clone(),
                    rule: rule.id.clone(),
                    ts_ms: now,
                    version: rule.version,
                    dry_run: !rule.enforced(),
                });
            }
        }
    }

    /// Log mode's would-be rejections since they were last reported.
    pub fn dry_run(&self) -> &crate::dryrun::DryRun {
        &self.dry_run
    }

    /// The Redis path: a cached rejection answers at once; else the items go to their shards, one
    /// script call per call group (all of one client's items share a group), all groups at once;
    /// groups whose breaker is open are decided by the fallback. A check is all or nothing across
    /// groups too: what one group committed is taken back if another rejected the check.
    fn check_redis(self: &Arc<Self>, r: &Arc<RedisStore>, plan: Vec<Planned>) -> Answer {
        let now = self.clock.now_ms();
        if let Some(d) = self.cached(&plan, now) {
            return Answer::Ready(Ok(d));
        }
        let mut out: Vec<Option<(Outcome, Source)>> = vec![None; plan.len()];
        let n = self.live_agents();
        let batched: Vec<usize> = (0..plan.len())
            .filter(|&i| self.runs_batched(r, &plan[i], n, now))
            .collect();
        let mut taken: Vec<(usize, u64)> = Vec::new();
        if !batched.is_empty() {
            let items: Vec<&Planned> = batched.iter().map(|&i| &plan[i]).collect();
            let mut denied = false;
            for (&i, (o, d, window)) in batched.iter().zip(self.batcher.check(&items, n)) {
                let p = &plan[i];
                match d {
                    None => taken.push((i, window)),
                    Some(Denial::Limit) if p.rule.enforced() => {
                        denied = true;
                        self.cache.put(&p.rule, &p.key, p.cost, o, now);
                    }
                    Some(_) => denied |= p.rule.enforced(),
                }
                out[i] = Some((o, Source::Local));
            }
            // Rejected (the batcher took nothing), or nothing left for Redis: answered locally.
            if denied || batched.len() == plan.len() {
                if denied {
                    taken.clear();
                }
                return Answer::Ready(Ok(finish(&plan, out)));
            }
        }
        let mut groups: Vec<Group> = Vec::new();
        for (i, p) in plan.iter().enumerate() {
            if out[i].is_some() {
                continue;
            }
            let route = r.route(&p.key);
            match groups.iter_mut().find(|g| g.route.call == route.call) {
                Some(g) => g.items.push(i),
                None => groups.push(Group {
                    route,
                    items: vec![i],
                    permit: None,
                }),
            }
        }
        if let Some(guard) = &self.guard {
            for g in &mut groups {
                g.permit = Some(guard.breaker(g.route.shard).permit_traffic());
            }
            if groups.iter().all(|g| g.permit == Some(Permit::Refuse)) {
                // Redis was not called: what the fallback admits is Redis's to learn later.
                let rest: Vec<usize> = groups.iter().flat_map(|g| g.items.iter().copied()).collect();
                let rest: Vec<(usize, bool)> = rest.into_iter().map(|i| (i, true)).collect();
                self.degraded(&plan, &rest, guard, &mut out);
                self.undo_if_denied(&plan, &out, &taken);
                return Answer::Ready(Ok(finish(&plan, out)));
            }
        }
        let (r, this) = (r.clone(), self.clone());
        if groups.len() == 1 && taken.is_empty() {
            // One atomic script call and nothing counted elsewhere: nothing to undo if the caller
            // goes away, so no task of its own.
            return Answer::Pending(Box::pin(async move {
                Ok(this.redis_groups(&r, plan, groups, out, taken).await)
            }));
        }
        // Spawned, not just awaited: if the caller's connection goes away mid-check, the check still
        // finishes, so that what it counted is undone or taken back when it is rejected.
        let task = tokio::spawn(async move { this.redis_groups(&r, plan, groups, out, taken).await });
        Answer::Pending(Box::pin(async move {
            task.await.map_err(|e| ErrorBody {
                code: ErrorCode::Internal,
                message: format!("check task failed: {e}"),
            })
        }))
    }

    /// A check rejected after batched items were counted locally: they are taken back (exactly: they
    /// have not left the agent unless a flush ran in between, and then the next flush carries less).
    fn undo_if_denied(&self, plan: &[Planned], out: &[Option<(Outcome, Source)>], taken: &[(usize, u64)]) {
        if taken.is_empty() || !denied(plan, out) {
            return;
        }
        for &(i, window) in taken {
            self.batcher.undo(&plan[i], window);
        }
    }

    async fn redis_groups(
        &self,
        r: &Arc<RedisStore>,
        plan: Vec<Planned>,
        groups: Vec<Group>,
        mut out: Vec<Option<(Outcome, Source)>>,
        taken: Vec<(usize, u64)>,
    ) -> Decision {
        let calls = groups
            .iter()
            .filter(|g| g.permit != Some(Permit::Refuse))
            .map(|g| {
                let items: Vec<Planned> = g.items.iter().map(|&i| plan[i].clone()).collect();
                async move { r.check(items).await }
            });
        let mut results = futures::future::join_all(calls).await.into_iter();
        // Items left to the fallback, and whether its admissions are Redis's to learn (a timed-out
        // script may still have run: admit locally but do not write it back, or it counts twice).
        let mut degraded: Vec<(usize, bool)> = Vec::new();
        let mut committed: Vec<usize> = Vec::new();
        for g in &groups {
            if g.permit == Some(Permit::Refuse) {
                degraded.extend(g.items.iter().map(|&i| (i, true)));
                continue;
            }
            let Some(result) = results.next() else { break };
            if let (Some(guard), Some(permit)) = (&self.guard, g.permit) {
                let breaker = guard.breaker(g.route.shard);
                // Traffic only ever opens a breaker; the guard's background probe closes it.
                if breaker.record(permit, result.is_ok(), Instant::now()) == Some(Transition::Opened) {
                    tracing::warn!(
                        shard = g.route.shard,
                        cooldown_ms = breaker.cooldown_left(Instant::now()).as_millis() as u64,
                        live_agents = guard.membership.live(),
                        "circuit breaker open: deciding locally (fail-open rules at limit / live agents)"
                    );
                }
            }
            match result {
                Ok(outcomes) => {
                    let passed = g
                        .items
                        .iter()
                        .zip(&outcomes)
                        .all(|(&i, o)| o.allowed || !plan[i].rule.enforced());
                    for (&i, o) in g.items.iter().zip(outcomes) {
                        if passed && o.allowed {
                            committed.push(i);
                        }
                        out[i] = Some((o, Source::Redis));
                    }
                }
                Err(e) => {
                    self.note_store_error(&e);
                    let certain = !matches!(e, StoreError::Timeout(_));
                    degraded.extend(g.items.iter().map(|&i| (i, certain)));
                }
            }
        }
        if !degraded.is_empty() {
            let now = self.clock.now_ms();
            match &self.guard {
                // Rejected already: the fallback need not take anything.
                _ if denied(&plan, &out) => {
                    for &(i, _) in &degraded {
                        out[i] = Some((
                            fail_outcome(&plan[i].rule, now, FAIL_CLOSED_RETRY_MS),
                            Source::Fallback,
                        ));
                    }
                }
                // One fallback call for all of them (all or nothing), recording only the items whose
                // Redis call surely failed.
                Some(guard) => self.degraded(&plan, &degraded, guard, &mut out),
                None => {
                    for &(i, _) in &degraded {
                        out[i] = Some((
                            fail_outcome(&plan[i].rule, now, FAIL_CLOSED_RETRY_MS),
                            Source::Fallback,
                        ));
                    }
                }
            }
        }
        if denied(&plan, &out) && !committed.is_empty() {
            self.take_back(r, &plan, &committed, &out);
        }
        self.undo_if_denied(&plan, &out, &taken);
        let now = self.clock.now_ms();
        for (p, o) in plan.iter().zip(&out) {
            if let Some((o, Source::Redis)) = o {
                if !o.allowed && p.rule.enforced() {
                    self.cache.put(&p.rule, &p.key, p.cost, *o, now);
                }
            }
        }
        finish(&plan, out)
    }

    /// A check rejected by one group after another committed: the committed units are taken back,
    /// off the request path. Until the take-back lands, other checks of those keys see them (the
    /// residual over-count that BENCHMARKS.md measures); a take-back that fails is counted.
    fn take_back(
        &self,
        r: &Arc<RedisStore>,
        plan: &[Planned],
        committed: &[usize],
        out: &[Option<(Outcome, Source)>],
    ) {
        let entries: Vec<LedgerEntry> = committed
            .iter()
            .filter_map(|&i| {
                let (o, _) = out[i]?;
                let p = &plan[i];
                // An admitted sliding-window item's reset is the end of the window after its own.
                let window = (o.reset_at_ms / p.rule.window_ms()).saturating_sub(2);
                Some(LedgerEntry {
                    rule: p.rule.clone(),
                    key: p.key.clone(),
                    window,
                    units: p.cost,
                })
            })
            .collect();
        let units: u64 = entries.iter().map(|e| e.units).sum();
        self.taken_back.requested.fetch_add(units, Ordering::Relaxed);
        let (r, stats) = (r.clone(), self.taken_back.clone());
        tokio::spawn(async move {
            let done = r.adjust(entries, Adjust::TakeBack).await;
            stats.done.fetch_add(done.units, Ordering::Relaxed);
            let lost: u64 = done.unknown + done.retry.iter().map(|e| e.units).sum::<u64>();
            stats.failed.fetch_add(lost, Ordering::Relaxed);
        });
    }

    /// A check with an enforced item whose rejection is cached is rejected at once, consuming nothing.
    fn cached(&self, plan: &[Planned], now: u64) -> Option<Decision> {
        let looked: Vec<Option<Outcome>> = plan
            .iter()
            .map(|p| {
                p.rule
                    .enforced()
                    .then(|| self.cache.get(&p.rule, &p.key, p.cost, now))
                    .flatten()
            })
            .collect();
        if looked.iter().all(Option::is_none) {
            return None;
        }
        let out = plan
            .iter()
            .zip(looked)
            .map(|(p, o)| Some((o.unwrap_or_else(|| unseen(&p.rule, now)), Source::Cache)))
            .collect();
        Some(finish(plan, out))
    }

    fn plan(&self, check: Check) -> Result<Vec<Planned>, ErrorBody> {
        let rules = self.rules();
        let plan: Vec<Planned> = match check {
            Check::Items(items) => items
                .into_iter()
                .map(|item| match rules.get(&item.rule_id) {
                    Some(rule) => Ok(Planned {
                        rule: rule.clone(),
                        key: item.key,
                        cost: u64::from(item.cost),
                    }),
                    None => Err(ErrorBody {
                        code: ErrorCode::UnknownRule,
                        message: format!("unknown rule {:?}", item.rule_id),
                    }),
                })
                .collect::<Result<_, _>>()?,
            Check::Attributes(a) => items_for(&rules, &a)
                .into_iter()
                .map(|(rule, key)| Planned {
                    rule,
                    key,
                    cost: u64::from(a.cost),
                })
                .collect(),
        };
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

    fn note_store_error(&self, e: &StoreError) {
        self.store_errors.fetch_add(1, Ordering::Relaxed);
        let now = self.clock.now_ms();
        // At most one log line per second: a store outage at 100K checks/s must not flood the logs.
        let last = self.last_error_log_ms.load(Ordering::Relaxed);
        if now >= last + 1_000
            && self
                .last_error_log_ms
                .compare_exchange(last, now, Ordering::Relaxed, Ordering::Relaxed)
                .is_ok()
        {
            tracing::warn!(error = %e, total = self.store_errors(), "store unavailable; rules' fail modes decide");
        }
    }

    /// The answer for items whose shard is away: fail-closed rules deny with a Retry-After; fail-open
    /// rules are enforced locally at limit / N (all or nothing, like every store). Each item comes
    /// with its record flag: whether what the fallback admits for it is Redis's to learn (written
    /// back), false when its Redis call timed out and may have run.
    fn degraded(
        &self,
        plan: &[Planned],
        items: &[(usize, bool)],
        guard: &Guard,
        out: &mut [Option<(Outcome, Source)>],
    ) {
        if items.is_empty() {
            return;
        }
        let now = self.clock.now_ms();
        let store = match &self.store {
            Store::Redis(r) => Some(r),
            Store::Memory(_) => None,
        };
        let retry = |p: &Planned| {
            let shard = store.map_or(0, |r| r.route(&p.key).shard);
            let cooldown = guard.breaker(shard).cooldown_left(Instant::now()).as_millis() as u64;
            FAIL_CLOSED_RETRY_MS.max(cooldown)
        };
        let closed = |p: &Planned| p.rule.fail_mode == FailMode::Closed;
        let blocked = items
            .iter()
            .any(|&(i, _)| closed(&plan[i]) && plan[i].rule.enforced());
        let open: Vec<(usize, bool)> = items
            .iter()
            .copied()
            .filter(|&(i, _)| !closed(&plan[i]))
            .collect();
        let mut local = if blocked || open.is_empty() {
            // The request is denied anyway: take nothing locally.
            Vec::new()
        } else {
            let planned: Vec<Planned> = open.iter().map(|&(i, _)| plan[i].clone()).collect();
            let record: Vec<bool> = open.iter().map(|&(_, r)| r).collect();
            guard.fallback.check(&planned, guard.membership.live(), &record)
        }
        .into_iter();
        for &(i, _) in items {
            let p = &plan[i];
            let o = if closed(p) {
                fail_outcome(&p.rule, now, retry(p))
            } else {
                local
                    .next()
                    .unwrap_or_else(|| fail_outcome(&p.rule, now, retry(p)))
            };
            out[i] = Some((o, Source::Fallback));
        }
    }
}

/// Items of one check that go to Redis in one script call, and their breaker's permit.
struct Group {
    route: Route,
    items: Vec<usize>,
    permit: Option<Permit>,
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

/// Whether an enforced item of the check is rejected.
fn denied(plan: &[Planned], out: &[Option<(Outcome, Source)>]) -> bool {
    out.iter()
        .zip(plan)
        .any(|(o, p)| p.rule.enforced() && o.is_some_and(|(o, _)| !o.allowed))
}

/// An item a check did not look at because another item rejected it: its rule's plain figures.
fn unseen(rule: &Rule, now: u64) -> Outcome {
    let limit = display_limit(rule);
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
    let (outcomes, sources): (Vec<Outcome>, Vec<Source>) = plan
        .iter()
        .zip(out)
        .map(|(p, o)| o.unwrap_or_else(|| (unseen(&p.rule, now), Source::Fallback)))
        .unzip();
    combine(plan, &outcomes, &sources)
}

fn fail_outcome(rule: &Rule, now: u64, retry_ms: u64) -> Outcome {
    let limit = display_limit(rule);
    match rule.fail_mode {
        FailMode::Open => Outcome {
            allowed: true,
            limit,
            remaining: limit,
            reset_at_ms: now + rule.window_ms(),
            retry_after_ms: 0,
        },
        FailMode::Closed => Outcome {
            allowed: false,
            limit,
            remaining: 0,
            reset_at_ms: now + retry_ms,
            retry_after_ms: retry_ms,
        },
    }
}

fn display_limit(rule: &Rule) -> u64 {
    match rule.algorithm {
        crate::rules::Algorithm::SlidingWindow => rule.limit.get(),
        crate::rules::Algorithm::TokenBucket => rule.burst(),
    }
}

fn no_rule() -> Verdict {
    Verdict {
        allowed: true,
        log_only: false,
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
    let items: Vec<ItemDecision> = plan
        .iter()
        .zip(outcomes)
        .enumerate()
        .map(|(i, (p, o))| ItemDecision {
            rule_id: p.rule.id.clone(),
            verdict: Verdict {
                allowed: o.allowed,
                log_only: !p.rule.enforced(),
                source: sources
                    .get(i)
                    .or(sources.first())
                    .copied()
                    .unwrap_or(Source::Local),
                limit: o.limit,
                remaining: o.remaining,
                reset_at_ms: o.reset_at_ms,
                retry_after_ms: o.retry_after_ms,
            },
        })
        .collect();
    let enforced = || items.iter().filter(|i| !i.verdict.log_only);
    let denied = enforced()
        .filter(|i| !i.verdict.allowed)
        .max_by_key(|i| i.verdict.retry_after_ms);
    let binding = denied
        .or_else(|| enforced().min_by_key(|i| (i.verdict.remaining, i.verdict.limit)))
        .map(|i| i.verdict);
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
