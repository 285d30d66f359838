//! The decision engine: resolves rules, asks the store, applies fail modes and combines verdicts.

use std::future::Future;
use std::pin::Pin;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, RwLock};
use std::time::Instant;

use floodgate_protocol::{Check, Decision, ErrorBody, ErrorCode, ItemDecision, Source, Verdict, MAX_ITEMS};

use crate::algo::Outcome;
use crate::guard::{Guard, Permit, Transition};
use crate::rules::{items_for, FailMode, Rule, RuleSet};
use crate::store::{Clock, Planned, Store, StoreError};

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
    store_errors: AtomicU64,
    last_error_log_ms: AtomicU64,
}

impl Engine {
    /// An engine over `rules` and `store`, without a guard: a Redis failure is decided by each rule's
    /// fail mode alone (allow, or deny with a Retry-After). `crate::run` adds the guard and its loop.
    pub fn new(rules: RuleSet, store: Store) -> Arc<Self> {
        Self::with_guard(rules, store, None)
    }

    /// An engine with a guard for its Redis store: breaker, limit/N fallback, membership. The guard's
    /// background loop (`crate::run` starts it) probes and writes back; without it an open breaker
    /// would never close.
    pub fn with_guard(rules: RuleSet, store: Store, guard: Option<Arc<Guard>>) -> Arc<Self> {
        Arc::new(Engine {
            rules: RwLock::new(Arc::new(rules)),
            store,
            guard,
            clock: Clock::System,
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
        match (&self.store, &self.guard) {
            (Store::Memory(m), _) => {
                let outcomes = m.check(&plan);
                Answer::Ready(Ok(combine(&plan, &outcomes, Source::Local)))
            }
            (Store::Redis(r), None) => {
                let r = r.clone();
                let this = self.clone();
                Answer::Pending(Box::pin(async move {
                    match r.check(&plan).await {
                        Ok(outcomes) => Ok(combine(&plan, &outcomes, Source::Redis)),
                        Err(e) => {
                            this.note_store_error(&e);
                            let now = this.clock.now_ms();
                            let outcomes: Vec<Outcome> = plan
                                .iter()
                                .map(|p| fail_outcome(&p.rule, now, FAIL_CLOSED_RETRY_MS))
                                .collect();
                            Ok(combine(&plan, &outcomes, Source::Fallback))
                        }
                    }
                }))
            }
            (Store::Redis(r), Some(guard)) => {
                let guard = guard.clone();
                let permit = guard.breaker.permit_traffic();
                if permit == Permit::Refuse {
                    // Redis was not called: what the fallback admits is Redis's to learn later.
                    return Answer::Ready(Ok(self.degraded(&plan, &guard, true)));
                }
                let r = r.clone();
                let this = self.clone();
                Answer::Pending(Box::pin(async move {
                    let result = r.check(&plan).await;
                    // Traffic only ever opens the breaker; the guard's background probe closes it.
                    if guard.breaker.record(permit, result.is_ok(), Instant::now())
                        == Some(Transition::Opened)
                    {
                        tracing::warn!(
                            cooldown_ms = guard.breaker.cooldown_left(Instant::now()).as_millis() as u64,
                            live_agents = guard.membership.live(),
                            "circuit breaker open: deciding locally (fail-open rules at limit / live agents)"
                        );
                    }
                    match result {
                        Ok(outcomes) => Ok(combine(&plan, &outcomes, Source::Redis)),
                        Err(e) => {
                            this.note_store_error(&e);
                            // A timed-out script may still have run (it is on the wire): admit locally
                            // but do not write it back, or it would be counted twice.
                            let certain = !matches!(e, StoreError::Timeout(_));
                            Ok(this.degraded(&plan, &guard, certain))
                        }
                    }
                }))
            }
        }
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

    /// The answer while the store is away: fail-closed rules deny with a Retry-After; fail-open rules
    /// are enforced locally at limit / N (all or nothing, like every store).
    fn degraded(&self, plan: &[Planned], guard: &Guard, record: bool) -> Decision {
        let now = self.clock.now_ms();
        let retry = FAIL_CLOSED_RETRY_MS.max(guard.breaker.cooldown_left(Instant::now()).as_millis() as u64);
        let closed = |p: &Planned| p.rule.fail_mode == FailMode::Closed;
        let blocked = plan.iter().any(|p| closed(p) && p.rule.enforced());
        let open: Vec<Planned> = plan.iter().filter(|p| !closed(p)).cloned().collect();
        let mut local = if blocked || open.is_empty() {
            // The request is denied anyway: take nothing locally.
            Vec::new()
        } else {
            guard.fallback.check(&open, guard.membership.live(), record)
        }
        .into_iter();
        let outcomes: Vec<Outcome> = plan
            .iter()
            .map(|p| {
                if closed(p) {
                    fail_outcome(&p.rule, now, retry)
                } else {
                    local.next().unwrap_or_else(|| fail_outcome(&p.rule, now, retry))
                }
            })
            .collect();
        combine(plan, &outcomes, Source::Fallback)
    }
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
/// binding item (on a denial the longest retry, else the smallest remaining).
pub fn combine(plan: &[Planned], outcomes: &[Outcome], source: Source) -> Decision {
    let items: Vec<ItemDecision> = plan
        .iter()
        .zip(outcomes)
        .map(|(p, o)| ItemDecision {
            rule_id: p.rule.id.clone(),
            verdict: Verdict {
                allowed: o.allowed,
                log_only: !p.rule.enforced(),
                source,
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
