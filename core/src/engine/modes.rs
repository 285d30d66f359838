//! Shared-store checks that are not all consume items: peeks, charges and releases go straight to
//! their shards beside the consume items' path, and a cached rejection's other items are peeked at.

use std::future::Future;
use std::sync::Arc;
use std::time::Instant;

use floodgate_protocol::{ErrorBody, ErrorCode, Source};

use super::degraded::fail_outcome;
use super::{finish, Answer, Engine, FAIL_CLOSED_RETRY_MS};
use crate::algo::Outcome;
use crate::guard::Permit;
use crate::shared_store::{Route, SharedStore};
use crate::store::{ItemMode, Planned, StoreError};

impl Engine {
    /// A check with peek, charge or release items: its consume items take the usual path (cache,
    /// batching, groups, all or nothing across them), beside them the others go to their shards
    /// directly (one call per call group, never answered from the cache or counted locally: a peek
    /// must see the shared state, and a charge must land there); a group whose breaker is open, or
    /// whose call fails, answers them by their rules' fail modes (a charge is then not counted).
    pub(super) fn check_with_modes(
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
            let calls = groups
                .iter()
                .map(|(route, items)| this.direct_call(&r, route, items, &plan, received));
            let direct_results = futures::future::join_all(calls);
            let consumed = async {
                match consumed {
                    Some(Answer::Ready(d)) => Some(d),
                    Some(Answer::Pending(f)) => Some(f.await),
                    None => None,
                }
            };
            let (direct_results, consumed) = futures::join!(direct_results, consumed);
            this.direct_outcomes(&plan, &groups, direct_results, &mut out);
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

    /// One call group's direct items, sent as every store call is: its shard's breaker permits it
    /// (and hears how it went), and past capacity it is shed to the rules' fail modes.
    fn direct_call(
        self: &Arc<Self>,
        r: &Arc<dyn SharedStore>,
        route: &Route,
        items: &[usize],
        plan: &[Planned],
        received: Instant,
    ) -> impl Future<Output = Result<Vec<Outcome>, StoreError>> + Send + 'static {
        let permit = self
            .guard
            .as_ref()
            .map(|g| g.breaker(route.shard).permit_traffic());
        let shed = permit == Some(Permit::Call) && r.sheds(route, received);
        let items: Vec<Planned> = items.iter().map(|&i| plan[i].clone()).collect();
        let (r, this, shard) = (r.clone(), self.clone(), route.shard);
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
                    guard
                        .breaker(shard)
                        .record(permit, answered, this.clock.instant());
                }
            }
            result
        }
    }

    /// The direct calls' results as their items' outcomes: a failed call's items by their rules'
    /// fail modes, or what a release frees.
    fn direct_outcomes(
        &self,
        plan: &[Planned],
        groups: &[(Route, Vec<usize>)],
        results: Vec<Result<Vec<Outcome>, StoreError>>,
        out: &mut [Option<(Outcome, Source)>],
    ) {
        let now = self.clock.now_ms();
        for ((_, items), result) in groups.iter().zip(results) {
            // A release also frees what the agent holds for its rule from a time the store
            // was away (answering it when the store cannot). A release by lease frees it
            // wherever it is held; one by count only where the store could not answer, or it
            // would free its count twice.
            let released = |i: usize| {
                let p = &plan[i];
                let g = self.guard.as_ref().filter(|_| p.mode.gives_back())?;
                Some(g.fallback.release(p, self.live_agents()))
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
                    self.note_store_error(&e);
                    for &i in items {
                        let o = released(i)
                            .unwrap_or_else(|| fail_outcome(&plan[i].rule, now, FAIL_CLOSED_RETRY_MS));
                        out[i] = Some((o, Source::Fallback));
                    }
                }
            }
        }
    }

    /// A check rejected by a cached rejection whose other items must still say what they hold: those
    /// are peeked at (one read of their shards, nothing counted, under their breakers), the cached
    /// items keep the cache's verdict and cost the store nothing.
    pub(super) fn cached_with_others(
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
