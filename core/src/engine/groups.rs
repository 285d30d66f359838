//! One check's call groups on the shared store: a script call each, all at once, each result told
//! to its shard's breaker, the fallback for groups that failed, and the take-back that keeps the
//! check all or nothing across groups.

use std::sync::atomic::Ordering;
use std::sync::Arc;
use std::time::Instant;

use floodgate_protocol::{Decision, Source};

use super::degraded::fail_outcome;
use super::shared_path::{denied, took_nothing};
use super::{finish, Engine, FAIL_CLOSED_RETRY_MS};
use crate::algo::Outcome;
use crate::guard::{LedgerEntry, Permit, Transition};
use crate::rules::Algorithm;
use crate::shared_store::{Adjust, Route, SharedStore};
use crate::store::{Planned, StoreError};

/// A call group's answer: its items' outcomes in order, or why the call failed.
type Called = Result<Vec<Outcome>, StoreError>;

/// Items of one check that go to Redis in one script call, their breaker's permit, and whether
/// the call counted them (it answered and passed: its allowed items are what a take-back undoes).
pub(super) struct Group {
    pub(super) route: Route,
    pub(super) items: Vec<usize>,
    pub(super) permit: Option<Permit>,
    pub(super) committed: bool,
}

impl Engine {
    /// The check's call groups answered: sent (`send_groups`), each result told to its breaker,
    /// the groups that failed or were refused answered by the fallback; a rejected check's
    /// committed units taken back and its batched ones undone; Redis's rejections cached.
    pub(super) async fn redis_groups(
        &self,
        r: &Arc<dyn SharedStore>,
        plan: Vec<Planned>,
        mut groups: Vec<Group>,
        mut out: Vec<Option<(Outcome, Source)>>,
        taken: Vec<(usize, u64)>,
        received: Instant,
    ) -> Decision {
        let mut results = send_groups(r, &plan, &groups, received).await;
        // Items left to the fallback, and whether its admissions are Redis's to learn (a timed-out
        // script may still have run: admit locally but do not write it back, or it counts twice).
        let mut degraded: Vec<(usize, bool)> = Vec::new();
        for g in &mut groups {
            if g.permit == Some(Permit::Refuse) {
                degraded.extend(g.items.iter().map(|&i| (i, true)));
                continue;
            }
            let Some(result) = results.next() else { break };
            self.tell_breaker(g, &result);
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
            self.settle_degraded(&plan, &degraded, &mut out);
        }
        if denied(&plan, &out) {
            self.take_back_committed(r, &plan, &groups, &mut out);
        }
        self.undo_if_denied(&plan, &mut out, &taken);
        let now = self.clock.now_ms();
        for (p, o) in plan.iter().zip(&out) {
            if let Some((o, Source::Redis)) = o {
                if !o.allowed && p.rule.enforced() && p.mode.caches_denial() {
                    self.cache.put(&p.rule, &p.key, p.cost, *o, now);
                }
            }
        }
        finish(&plan, out)
    }

    /// A group's result told to its shard's breaker, if it asked the breaker for a permit.
    fn tell_breaker(&self, g: &Group, result: &Called) {
        if let (Some(guard), Some(permit)) = (&self.guard, g.permit) {
            let breaker = guard.breaker(g.route.shard);
            // Traffic only ever opens a breaker; the guard's background probe closes it. A
            // script error is Redis answering (one check's data failed the script, e.g. a key
            // of another type): the shard is there for every other check, so it counts as an
            // answer, never toward opening.
            let answered = !matches!(result, Err(e) if !matches!(e, StoreError::Script(_)));
            // A shed check never reached Redis: it says nothing of Redis's health either way
            // (counting it as an answer would reset the failures of a Redis too slow to answer).
            let shed = matches!(result, Err(StoreError::Shed));
            if !shed && breaker.record(permit, answered, self.clock.instant()) == Some(Transition::Opened) {
                tracing::warn!(
                    shard = g.route.shard,
                    cooldown_ms = breaker.cooldown_left(self.clock.instant()).as_millis() as u64,
                    live_agents = guard.membership.live(),
                    "circuit breaker open: deciding locally (fail-open rules at limit / live agents)"
                );
            }
        }
    }

    /// Items whose group failed or was refused, each with whether what the fallback admits for it
    /// is Redis's to learn: answered by their fail modes, or by the fallback.
    fn settle_degraded(
        &self,
        plan: &[Planned],
        degraded: &[(usize, bool)],
        out: &mut [Option<(Outcome, Source)>],
    ) {
        let now = self.clock.now_ms();
        match &self.guard {
            // Rejected already: the fallback need not take anything.
            _ if denied(plan, out) => {
                for &(i, _) in degraded {
                    out[i] = Some((
                        fail_outcome(&plan[i].rule, now, FAIL_CLOSED_RETRY_MS),
                        Source::Fallback,
                    ));
                }
            }
            // One fallback call for all of them (all or nothing), recording only the items whose
            // Redis call surely failed.
            Some(guard) => self.degraded(plan, degraded, guard, out),
            None => {
                for &(i, _) in degraded {
                    out[i] = Some((
                        fail_outcome(&plan[i].rule, now, FAIL_CLOSED_RETRY_MS),
                        Source::Fallback,
                    ));
                }
            }
        }
    }

    /// A rejected check: what the groups that passed committed is taken back.
    fn take_back_committed(
        &self,
        r: &Arc<dyn SharedStore>,
        plan: &[Planned],
        groups: &[Group],
        out: &mut [Option<(Outcome, Source)>],
    ) {
        let committed: Vec<usize> = groups
            .iter()
            .filter(|g| g.committed)
            .flat_map(|g| g.items.iter().copied())
            .filter(|&i| out[i].is_some_and(|(o, _)| o.allowed))
            .collect();
        if !committed.is_empty() {
            self.take_back(r, plan, &committed, out);
        }
        // Taken back: those items took nothing, and say so (a failed group's own items already
        // do, from the script; batched ones when `undo_if_denied` undoes them).
        for i in committed {
            took_nothing(&mut out[i], plan[i].cost);
        }
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
                Some(counted_in(&plan[i], &o))
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
}

/// Where an admitted item's cost was counted, as a take-back names it: an admitted sliding-window
/// item's reset is the end of the window after its own; a quota's period is named by its start; a
/// concurrency item's take-back frees its lease, named where the window goes.
pub(super) fn counted_in(p: &Planned, o: &Outcome) -> LedgerEntry {
    let window = match (p.rule.algorithm, p.lease.id()) {
        (Algorithm::Concurrency, Some(id)) => id,
        (Algorithm::Quota, _) => p.rule.quota_period(o.reset_at_ms.saturating_sub(1)).0,
        (Algorithm::SlidingWindow | Algorithm::TokenBucket | Algorithm::Concurrency, _) => {
            (o.reset_at_ms / p.rule.window_ms()).saturating_sub(2)
        }
    };
    LedgerEntry {
        rule: p.rule.clone(),
        key: p.key.clone(),
        window,
        units: p.cost,
    }
}

/// The groups' script calls (not a group its breaker refused), all at once; their results in the
/// groups' order.
async fn send_groups(
    r: &Arc<dyn SharedStore>,
    plan: &[Planned],
    groups: &[Group],
    received: Instant,
) -> std::iter::Chain<std::option::IntoIter<Called>, std::vec::IntoIter<Called>> {
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
    one.into_iter().chain(many)
}
