//! The decision engine: resolves rules, asks the store, applies fail modes and combines verdicts.

use std::future::Future;
use std::pin::Pin;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, RwLock};
use std::time::Instant;

use floodgate_protocol::{Check, Decision, ErrorBody, ErrorCode, ItemDecision, Source, Verdict, MAX_ITEMS};

use crate::algo::Outcome;
use crate::cache::RejectionCache;
use crate::guard::{Guard, LedgerEntry, Permit, Transition};
use crate::rules::{items_for, FailMode, Rule, RuleSet};
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

/// The engine: a rule set (swapped whole), a store, and for Redis the guard (breaker, fallback).
pub struct Engine {
    rules: RwLock<Arc<RuleSet>>,
    store: Store,
    guard: Option<Arc<Guard>>,
    clock: Clock,
    cache: RejectionCache,
    taken_back: Arc<TakenBack>,
    store_errors: AtomicU64,
    last_error_log_ms: AtomicU64,
}

impl Engine {
    /// An engine over `rules` and `store`, without a guard: a Redis failure is decided by each rule's
    /// fail mode alone (allow, or deny with a Retry-After). `crate::run` adds the guard and its loop.
    pub fn new(rules: RuleSet, store: Store) -> Arc<Self> {
        Self::with_guard(rules, store, None, crate::cache::DEFAULT_CAP)
    }

    /// An engine with a guard for its Redis store: breaker, limit/N fallback, membership. The guard's
    /// background loop (`crate::run` starts it) probes and writes back; without it an open breaker
    /// would never close.
    /// `cache_cap` bounds the rejection cache (0 turns it off).
    pub fn with_guard(
        rules: RuleSet,
        store: Store,
        guard: Option<Arc<Guard>>,
        cache_cap: usize,
    ) -> Arc<Self> {
        Arc::new(Engine {
            rules: RwLock::new(Arc::new(rules)),
            store,
            guard,
            clock: Clock::System,
            cache: RejectionCache::new(cache_cap),
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
        match &self.store {
            Store::Memory(m) => {
                let outcomes = m.check(&plan);
                Answer::Ready(Ok(combine(&plan, &outcomes, &[Source::Local])))
            }
            Store::Redis(r) => self.check_redis(r, plan),
        }
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
        let mut groups: Vec<Group> = Vec::new();
        for (i, p) in plan.iter().enumerate() {
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
                let all: Vec<usize> = (0..plan.len()).collect();
                let mut out = vec![None; plan.len()];
                self.degraded(&plan, &all, guard, true, &mut out);
                return Answer::Ready(Ok(finish(&plan, out)));
            }
        }
        let (r, this) = (r.clone(), self.clone());
        Answer::Pending(Box::pin(
            async move { Ok(this.redis_groups(&r, plan, groups).await) },
        ))
    }

    async fn redis_groups(&self, r: &Arc<RedisStore>, plan: Vec<Planned>, groups: Vec<Group>) -> Decision {
        let calls = groups
            .iter()
            .filter(|g| g.permit != Some(Permit::Refuse))
            .map(|g| {
                let items: Vec<Planned> = g.items.iter().map(|&i| plan[i].clone()).collect();
                async move { r.check(&items).await }
            });
        let mut results = futures::future::join_all(calls).await.into_iter();
        let mut out: Vec<Option<(Outcome, Source)>> = vec![None; plan.len()];
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
        let denied = |out: &[Option<(Outcome, Source)>]| {
            out.iter()
                .zip(&plan)
                .any(|(o, p)| p.rule.enforced() && o.is_some_and(|(o, _)| !o.allowed))
        };
        if !degraded.is_empty() {
            let now = self.clock.now_ms();
            match &self.guard {
                // Rejected already: the fallback need not take anything.
                _ if denied(&out) => {
                    for &(i, _) in &degraded {
                        out[i] = Some((
                            fail_outcome(&plan[i].rule, now, FAIL_CLOSED_RETRY_MS),
                            Source::Fallback,
                        ));
                    }
                }
                Some(guard) => {
                    let (certain, uncertain): (Vec<_>, Vec<_>) = degraded.iter().partition(|(_, c)| *c);
                    let certain: Vec<usize> = certain.into_iter().map(|(i, _)| i).collect();
                    let uncertain: Vec<usize> = uncertain.into_iter().map(|(i, _)| i).collect();
                    self.degraded(&plan, &certain, guard, true, &mut out);
                    self.degraded(&plan, &uncertain, guard, false, &mut out);
                }
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
        if denied(&out) && !committed.is_empty() {
            self.take_back(r, &plan, &committed, &out);
        }
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
    /// rules are enforced locally at limit / N (all or nothing, like every store); `record` keeps what
    /// the fallback admits for the write-back.
    fn degraded(
        &self,
        plan: &[Planned],
        items: &[usize],
        guard: &Guard,
        record: bool,
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
        let blocked = items.iter().any(|&i| closed(&plan[i]) && plan[i].rule.enforced());
        let open: Vec<usize> = items.iter().copied().filter(|&i| !closed(&plan[i])).collect();
        let mut local = if blocked || open.is_empty() {
            // The request is denied anyway: take nothing locally.
            Vec::new()
        } else {
            let planned: Vec<Planned> = open.iter().map(|&i| plan[i].clone()).collect();
            guard.fallback.check(&planned, guard.membership.live(), record)
        }
        .into_iter();
        for &i in items {
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
