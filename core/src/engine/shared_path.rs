//! The shared store's path (Redis): the rejection cache, batched items, and the check's call
//! groups with their breakers and shedding; the calls themselves and the take-back that keeps a
//! check all or nothing across groups are in `groups.rs`, items other than consume in `modes.rs`,
//! and groups that cannot reach their shard are answered in `degraded.rs`.

use std::sync::atomic::Ordering;
use std::sync::Arc;
use std::time::Instant;

use floodgate_protocol::{ErrorBody, ErrorCode, Source};

use super::groups::Group;
use super::{finish, Answer, Engine};
use crate::algo::Outcome;
use crate::batch::Denial;
use crate::guard::{BreakerState, Permit};
use crate::shared_store::SharedStore;
use crate::store::{Planned, StoreError};

impl Engine {
    /// Whether this item runs batched now: by its rule, or because its key is hot (only where
    /// batching the rule would meet the accuracy target: a login rule of 5 per 10 minutes stays sync
    /// however hot); never while its shard's breaker is open (the fallback decides then) or when the
    /// batcher is full.
    fn runs_batched(&self, r: &dyn SharedStore, p: &Planned, n: u64, now: u64) -> bool {
        // A reservation is counted where its commit can give it back: in the store.
        if !p.rule.algorithm.batches() || p.mode.reserves() {
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
        let (taken, answered) = self.count_batched(r.as_ref(), &plan, &mut out, now);
        if answered {
            return Answer::Ready(Ok(finish(&plan, out)));
        }
        let mut groups = call_groups(r.as_ref(), &plan, &out);
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

    /// The check's items that run batched, counted by the batcher (their outcomes into `out`):
    /// what it took (item, window), and whether that answered the check: rejected (the batcher
    /// then took nothing), or nothing left for Redis.
    fn count_batched(
        &self,
        r: &dyn SharedStore,
        plan: &[Planned],
        out: &mut [Option<(Outcome, Source)>],
        now: u64,
    ) -> (Vec<(usize, u64)>, bool) {
        let n = self.live_agents();
        let batched: Vec<usize> = (0..plan.len())
            .filter(|&i| self.runs_batched(r, &plan[i], n, now))
            .collect();
        let mut taken: Vec<(usize, u64)> = Vec::new();
        if batched.is_empty() {
            return (taken, false);
        }
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
        if denied {
            // The batcher took nothing: its items that would have passed say so.
            for &(i, _) in &taken {
                took_nothing(&mut out[i], plan[i].cost);
            }
            taken.clear();
        }
        // Rejected (the batcher took nothing), or nothing left for Redis: answered locally.
        let answered = denied || batched.len() == plan.len();
        (taken, answered)
    }

    /// A check rejected after batched items were counted locally: they are taken back (exactly: they
    /// have not left the agent unless a flush ran in between, and then the next flush carries less).
    pub(super) fn undo_if_denied(
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

    /// The cached rejections of a check's enforced items, if any has one: the check is then rejected,
    /// consuming nothing.
    fn cached(&self, plan: &[Planned], now: u64) -> Option<Vec<Option<Outcome>>> {
        let looked: Vec<Option<Outcome>> = plan
            .iter()
            .map(|p| {
                (p.rule.enforced() && p.mode.caches_denial())
                    .then(|| self.cache.get(&p.rule, &p.key, p.cost, now))
                    .flatten()
            })
            .collect();
        looked.iter().any(Option::is_some).then_some(looked)
    }
}

/// The items not answered yet, by call group (one script call each), in the check's order.
fn call_groups(r: &dyn SharedStore, plan: &[Planned], out: &[Option<(Outcome, Source)>]) -> Vec<Group> {
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
    groups
}

/// Whether an enforced item of the check is rejected.
pub(super) fn denied(plan: &[Planned], out: &[Option<(Outcome, Source)>]) -> bool {
    out.iter()
        .zip(plan)
        .any(|(o, p)| p.rule.enforced() && o.is_some_and(|(o, _)| !o.allowed))
}

/// An item of a rejected check that would have passed: it took nothing, so its remaining is what it
/// was before its cost (capped at the limit).
pub(super) fn took_nothing(out: &mut Option<(Outcome, Source)>, cost: u64) {
    if let Some((o, _)) = out {
        if o.allowed {
            o.remaining = (o.remaining + cost).min(o.limit);
        }
    }
}
