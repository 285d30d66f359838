//! The shared store's path (Redis): the rejection cache, batched items, one script call per call
//! group with its breaker, and the take-back that keeps a check all or nothing across groups;
//! groups that cannot reach their shard are answered in `degraded.rs`.

use std::sync::atomic::Ordering;
use std::sync::Arc;
use std::time::Instant;

use floodgate_protocol::{Decision, ErrorBody, ErrorCode, Source};

use super::degraded::fail_outcome;
use super::{finish, Answer, Engine, FAIL_CLOSED_RETRY_MS};
use crate::algo::Outcome;
use crate::batch::Denial;
use crate::guard::{BreakerState, LedgerEntry, Permit, Transition};
use crate::rules::Algorithm;
use crate::shared_store::{Adjust, Route, SharedStore};
use crate::store::{ItemMode, Planned, StoreError};

impl Engine {
    /// Whether this item runs batched now: by its rule, or because its key is hot (only where
    /// batching the rule would meet the accuracy target: a login rule of 5 per 10 minutes stays sync
    /// however hot); never while its shard's breaker is open (the fallback decides then) or when the
    /// batcher is full.
    fn runs_batched(&self, r: &dyn SharedStore, p: &Planned, n: u64, now: u64) -> bool {
        if !p.rule.algorithm.batches() {
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

    /// The Redis path: a cached rejection answers at once; else the items go to their shards, one
    /// script call per call group (all of one client's items share a group), all groups at once;
    /// groups whose breaker is open are decided by the fallback. A check is all or nothing across
    /// groups too: what one group committed is taken back if another rejected the check.
    pub(super) fn check_shared(
        self: &Arc<Self>,
        r: &Arc<dyn SharedStore>,
        plan: Vec<Planned>,
        received: Instant,
    ) -> Answer {
        if plan.iter().any(|p| !p.mode.takes_if_passed()) {
            return self.check_with_modes(r, plan, received);
        }
        let now = self.clock.now_ms();
        if let Some(looked) = self.cached(&plan, now) {
            if plan.len() == 1 {
                let out = looked
                    .into_iter()
                    .map(|o| o.map(|o| (o, Source::Cache)))
                    .collect();
                return Answer::Ready(Ok(finish(&plan, out)));
            }
            return self.cached_with_others(r, plan, looked, received);
        }
        let mut out: Vec<Option<(Outcome, Source)>> = vec![None; plan.len()];
        let n = self.live_agents();
        let batched: Vec<usize> = (0..plan.len())
            .filter(|&i| self.runs_batched(r.as_ref(), &plan[i], n, now))
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
                    // The batcher took nothing: its items that would have passed say so.
                    for &(i, _) in &taken {
                        took_nothing(&mut out[i], plan[i].cost);
                    }
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
                    committed: false,
                }),
            }
        }
        if let Some(guard) = &self.guard {
            for g in &mut groups {
                let mut permit = guard.breaker(g.route.shard).permit_traffic();
                // Past capacity toward this shard: shed at once, as a refused breaker is answered
                // (not sent, so what the fallback admits is Redis's to learn later). Cheaper than
                // finding out through a future, which is what lets a saturated agent keep up.
                if permit == Permit::Call && r.sheds(&g.route, received) {
                    permit = Permit::Refuse;
                    self.note_store_error(&StoreError::Shed);
                }
                g.permit = Some(permit);
            }
            if groups.iter().all(|g| g.permit == Some(Permit::Refuse)) {
                // Redis was not called: what the fallback admits is Redis's to learn later.
                let rest: Vec<usize> = groups.iter().flat_map(|g| g.items.iter().copied()).collect();
                let rest: Vec<(usize, bool)> = rest.into_iter().map(|i| (i, true)).collect();
                self.degraded(&plan, &rest, guard, &mut out);
                self.undo_if_denied(&plan, &mut out, &taken);
                return Answer::Ready(Ok(finish(&plan, out)));
            }
        }
        let (r, this) = (r.clone(), self.clone());
        if groups.len() == 1 && taken.is_empty() {
            // One atomic script call and nothing counted elsewhere: nothing to undo if the caller
            // goes away, so no task of its own.
            return Answer::Pending(Box::pin(async move {
                Ok(this.redis_groups(&r, plan, groups, out, taken, received).await)
            }));
        }
        // Spawned, not just awaited: if the caller's connection goes away mid-check, the check still
        // finishes, so that what it counted is undone or taken back when it is rejected.
        let task =
            tokio::spawn(async move { this.redis_groups(&r, plan, groups, out, taken, received).await });
        Answer::Pending(Box::pin(async move {
            task.await.map_err(|e| ErrorBody {
                code: ErrorCode::Internal,
                message: format!("check task failed: {e}"),
            })
        }))
    }

    /// A check with peek, charge or release items: its consume items take the usual path (cache,
    /// batching, groups, all or nothing across them), beside them the others go to their shards
    /// directly (one call per call group, never answered from the cache or counted locally: a peek
    /// must see the shared state, and a charge must land there); a group whose breaker is open, or
    /// whose call fails, answers them by their rules' fail modes (a charge is then not counted).
    fn check_with_modes(
        self: &Arc<Self>,
        r: &Arc<dyn SharedStore>,
        plan: Vec<Planned>,
        received: Instant,
    ) -> Answer {
        let (consume, direct): (Vec<usize>, Vec<usize>) =
            (0..plan.len()).partition(|&i| plan[i].mode.takes_if_passed());
        let consumed = (!consume.is_empty())
            .then(|| self.check_shared(r, consume.iter().map(|&i| plan[i].clone()).collect(), received));
        let mut groups: Vec<(Route, Vec<usize>)> = Vec::new();
        for &i in &direct {
            let route = r.route(&plan[i].key);
            match groups.iter_mut().find(|(g, _)| g.call == route.call) {
                Some((_, items)) => items.push(i),
                None => groups.push((route, vec![i])),
            }
        }
        let (r, this) = (r.clone(), self.clone());
        // Spawned, not just awaited: a charge must land even if the caller's connection goes away.
        let task = tokio::spawn(async move {
            let mut out: Vec<Option<(Outcome, Source)>> = vec![None; plan.len()];
            let calls = groups.iter().map(|(route, items)| {
                // As every store call: its shard's breaker permits it (and hears how it went), and
                // past capacity it is shed to the rules' fail modes.
                let permit = this
                    .guard
                    .as_ref()
                    .map(|g| g.breaker(route.shard).permit_traffic());
                let shed = permit == Some(Permit::Call) && r.sheds(route, received);
                let items: Vec<Planned> = items.iter().map(|&i| plan[i].clone()).collect();
                let (r, this, shard) = (r.clone(), this.clone(), route.shard);
                async move {
                    if permit == Some(Permit::Refuse) {
                        return Err(StoreError::Connection("the shard's breaker is open".into()));
                    }
                    if shed {
                        return Err(StoreError::Shed);
                    }
                    let result = r.check(items, received).await;
                    if let (Some(guard), Some(permit)) = (&this.guard, permit) {
                        let answered = !matches!(&result, Err(e) if !matches!(e, StoreError::Script(_)));
                        if !matches!(&result, Err(StoreError::Shed)) {
                            guard.breaker(shard).record(permit, answered, Instant::now());
                        }
                    }
                    result
                }
            });
            let direct_results = futures::future::join_all(calls);
            let consumed = async {
                match consumed {
                    Some(Answer::Ready(d)) => Some(d),
                    Some(Answer::Pending(f)) => Some(f.await),
                    None => None,
                }
            };
            let (direct_results, consumed) = futures::join!(direct_results, consumed);
            let now = this.clock.now_ms();
            for ((_, items), result) in groups.iter().zip(direct_results) {
                // A release also frees what the agent holds for its rule from a time the store
                // was away (answering it when the store cannot). A release by lease frees it
                // wherever it is held; one by count only where the store could not answer, or it
                // would free its count twice.
                let released = |i: usize| {
                    let p = &plan[i];
                    let g = this.guard.as_ref().filter(|_| p.mode.gives_back())?;
                    Some(g.fallback.release(p, this.live_agents()))
                };
                match result {
                    Ok(outcomes) => {
                        for (&i, o) in items.iter().zip(outcomes) {
                            if plan[i].lease.id().is_some() {
                                released(i);
                            }
                            out[i] = Some((o, Source::Redis));
                        }
                    }
                    Err(e) => {
                        this.note_store_error(&e);
                        for &i in items {
                            let o = released(i)
                                .unwrap_or_else(|| fail_outcome(&plan[i].rule, now, FAIL_CLOSED_RETRY_MS));
                            out[i] = Some((o, Source::Fallback));
                        }
                    }
                }
            }
            if let Some(d) = consumed {
                let d = d?;
                for (&i, item) in consume.iter().zip(d.items) {
                    out[i] = Some(outcome_of(&item.verdict));
                }
            }
            Ok(finish(&plan, out))
        });
        Answer::Pending(Box::pin(async move {
            task.await.map_err(|e| ErrorBody {
                code: ErrorCode::Internal,
                message: format!("check task failed: {e}"),
            })?
        }))
    }

    /// A check rejected after batched items were counted locally: they are taken back (exactly: they
    /// have not left the agent unless a flush ran in between, and then the next flush carries less).
    fn undo_if_denied(
        &self,
        plan: &[Planned],
        out: &mut [Option<(Outcome, Source)>],
        taken: &[(usize, u64)],
    ) {
        if taken.is_empty() || !denied(plan, out) {
            return;
        }
        for &(i, window) in taken {
            self.batcher.undo(&plan[i], window);
            took_nothing(&mut out[i], plan[i].cost);
        }
    }

    async fn redis_groups(
        &self,
        r: &Arc<dyn SharedStore>,
        plan: Vec<Planned>,
        mut groups: Vec<Group>,
        mut out: Vec<Option<(Outcome, Source)>>,
        taken: Vec<(usize, u64)>,
        received: Instant,
    ) -> Decision {
        let calls = groups
            .iter()
            .filter(|g| g.permit != Some(Permit::Refuse))
            .map(|g| {
                let items: Vec<Planned> = g.items.iter().map(|&i| plan[i].clone()).collect();
                r.clone().check(items, received)
            });
        // One call (the common case: one client key per check) is awaited as it is, without
        // join_all's bookkeeping or a vector.
        let (mut one, mut many) = (None, Vec::new());
        if groups.len() == 1 {
            let mut calls = calls;
            if let Some(call) = calls.next() {
                one = Some(call.await);
            }
        } else {
            many = futures::future::join_all(calls).await;
        }
        let mut results = one.into_iter().chain(many);
        // Items left to the fallback, and whether its admissions are Redis's to learn (a timed-out
        // script may still have run: admit locally but do not write it back, or it counts twice).
        let mut degraded: Vec<(usize, bool)> = Vec::new();
        for g in &mut groups {
            if g.permit == Some(Permit::Refuse) {
                degraded.extend(g.items.iter().map(|&i| (i, true)));
                continue;
            }
            let Some(result) = results.next() else { break };
            if let (Some(guard), Some(permit)) = (&self.guard, g.permit) {
                let breaker = guard.breaker(g.route.shard);
                // Traffic only ever opens a breaker; the guard's background probe closes it. A
                // script error is Redis answering (one check's data failed the script, e.g. a key
                // of another type): the shard is there for every other check, so it counts as an
                // answer, never toward opening.
                let answered = !matches!(&result, Err(e) if !matches!(e, StoreError::Script(_)));
                // A shed check never reached Redis: it says nothing of Redis's health either way
                // (counting it as an answer would reset the failures of a Redis too slow to answer).
                let shed = matches!(&result, Err(StoreError::Shed));
                if !shed && breaker.record(permit, answered, Instant::now()) == Some(Transition::Opened) {
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
                    // All or nothing: a group that passed committed its allowed items.
                    g.committed = g
                        .items
                        .iter()
                        .zip(&outcomes)
                        .all(|(&i, o)| o.allowed || !plan[i].rule.enforced());
                    for (&i, o) in g.items.iter().zip(outcomes) {
                        out[i] = Some((o, Source::Redis));
                    }
                }
                Err(e) => {
                    self.note_store_error(&e);
                    // What the fallback admits is written back only when the call surely did not
                    // run (a timed-out one may have) and could run again (a script error would
                    // fail the write-back the same way).
                    let certain = !matches!(e, StoreError::Timeout(_) | StoreError::Script(_));
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
        if denied(&plan, &out) {
            let committed: Vec<usize> = groups
                .iter()
                .filter(|g| g.committed)
                .flat_map(|g| g.items.iter().copied())
                .filter(|&i| out[i].is_some_and(|(o, _)| o.allowed))
                .collect();
            if !committed.is_empty() {
                self.take_back(r, &plan, &committed, &out);
            }
            // Taken back: those items took nothing, and say so (a failed group's own items already
            // do, from the script; batched ones when they are undone below).
            for i in committed {
                took_nothing(&mut out[i], plan[i].cost);
            }
        }
        self.undo_if_denied(&plan, &mut out, &taken);
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
        r: &Arc<dyn SharedStore>,
        plan: &[Planned],
        committed: &[usize],
        out: &[Option<(Outcome, Source)>],
    ) {
        let entries: Vec<LedgerEntry> = committed
            .iter()
            .filter_map(|&i| {
                let (o, _) = out[i]?;
                let p = &plan[i];
                // An admitted sliding-window item's reset is the end of the window after its own; a
                // concurrency item's take-back frees its lease, named where the window goes.
                let window = match (p.rule.algorithm, p.lease.id()) {
                    (Algorithm::Concurrency, Some(id)) => id,
                    // A quota's take-back goes into its period, named by its start.
                    (Algorithm::Quota, _) => p.rule.quota_period(o.reset_at_ms.saturating_sub(1)).0,
                    (Algorithm::SlidingWindow | Algorithm::TokenBucket | Algorithm::Concurrency, _) => {
                        (o.reset_at_ms / p.rule.window_ms()).saturating_sub(2)
                    }
                };
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

    /// The cached rejections of a check's enforced items, if any has one: the check is then rejected,
    /// consuming nothing.
    fn cached(&self, plan: &[Planned], now: u64) -> Option<Vec<Option<Outcome>>> {
        let looked: Vec<Option<Outcome>> = plan
            .iter()
            .map(|p| {
                (p.rule.enforced() && p.mode.takes_if_passed())
                    .then(|| self.cache.get(&p.rule, &p.key, p.cost, now))
                    .flatten()
            })
            .collect();
        looked.iter().any(Option::is_some).then_some(looked)
    }

    /// A check rejected by a cached rejection whose other items must still say what they hold: those
    /// are peeked at (one read of their shards, nothing counted, under their breakers), the cached
    /// items keep the cache's verdict and cost the store nothing.
    fn cached_with_others(
        self: &Arc<Self>,
        r: &Arc<dyn SharedStore>,
        plan: Vec<Planned>,
        looked: Vec<Option<Outcome>>,
        received: Instant,
    ) -> Answer {
        let others: Vec<usize> = (0..plan.len()).filter(|&i| looked[i].is_none()).collect();
        let peeks: Vec<Planned> = others
            .iter()
            .map(|&i| Planned {
                mode: ItemMode::Peek,
                ..plan[i].clone()
            })
            .collect();
        let answer = self.check_with_modes(r, peeks, received);
        Answer::Pending(Box::pin(async move {
            let read = match answer {
                Answer::Ready(d) => d,
                Answer::Pending(f) => f.await,
            }?;
            let mut out: Vec<Option<(Outcome, Source)>> = looked
                .into_iter()
                .map(|o| o.map(|o| (o, Source::Cache)))
                .collect();
            for (&i, item) in others.iter().zip(read.items) {
                // Not consumed: the check was rejected; this is what the item holds.
                out[i] = Some(outcome_of(&item.verdict));
            }
            Ok(finish(&plan, out))
        }))
    }
}

/// Items of one check that go to Redis in one script call, their breaker's permit, and whether
/// the call counted them (it answered and passed: its allowed items are what a take-back undoes).
struct Group {
    route: Route,
    items: Vec<usize>,
    permit: Option<Permit>,
    committed: bool,
}

/// Whether an enforced item of the check is rejected.
fn denied(plan: &[Planned], out: &[Option<(Outcome, Source)>]) -> bool {
    out.iter()
        .zip(plan)
        .any(|(o, p)| p.rule.enforced() && o.is_some_and(|(o, _)| !o.allowed))
}

/// An item of a rejected check that would have passed: it took nothing, so its remaining is what it
/// was before its cost (capped at the limit).
fn took_nothing(out: &mut Option<(Outcome, Source)>, cost: u64) {
    if let Some((o, _)) = out {
        if o.allowed {
            o.remaining = (o.remaining + cost).min(o.limit);
        }
    }
}

/// A verdict of a sub-check, back as an item's outcome and source.
fn outcome_of(v: &floodgate_protocol::Verdict) -> (Outcome, Source) {
    let o = Outcome {
        allowed: v.allowed,
        limit: v.limit,
        remaining: v.remaining,
        reset_at_ms: v.reset_at_ms,
        retry_after_ms: v.retry_after_ms,
    };
    (o, v.source)
}
