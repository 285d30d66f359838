//! The guard's background calls, run by the agent's loop every 100 ms (and driven by hand under
//! simulated time by the model test, `core/tests/model.rs`): the breaker's probe of a shard that is
//! away, and the write-back of what the fallback admitted meanwhile.

use std::time::Instant;

use super::{BreakerState, Guard, Permit, Transition};
use crate::shared_store::{Adjust, Route, SharedStore};

/// Once the cool-down is over, one background call decides whether the store is back: it loads the
/// check script (a restarted Redis has an empty cache) with a timeout no check could afford, so a
/// slow reconnection does not keep the breaker open, and no caller waits on it. `now` reads the
/// clock (before the call and after it).
pub async fn probe(guard: &Guard, redis: &dyn SharedStore, shard: usize, now: impl Fn() -> Instant) {
    let breaker = guard.breaker(shard);
    let permit = breaker.permit(now());
    if permit != Permit::Probe {
        return;
    }
    let ok = redis.probe(shard).await.is_ok();
    if breaker.record(permit, ok, now()) == Some(Transition::Closed) {
        tracing::info!(shard, "store answers again: circuit breaker closed");
    }
}

/// Most ledger entries one write-back pass takes: bounded work per pass on the agent's thread.
pub const WRITE_BACK_BATCH: usize = 10_000;

/// Most ledger entries a write-back pass takes while a shard sheds checks (the agent is past its
/// capacity toward it): one call's worth, so that the write-back does not hold one of the node's two
/// call slots for many calls while checks are being shed for want of one.
pub const WRITE_BACK_WHILE_SHEDDING: usize = 64;

/// Writes back what the fallback admitted, for the shards whose breaker is closed (the rest waits
/// in the ledger, untouched).
pub async fn write_back(guard: &Guard, redis: &dyn SharedStore, now: Instant) {
    let shards = redis.shard_count();
    let closed: Vec<bool> = (0..shards)
        .map(|shard| guard.breaker(shard).snapshot().state == BreakerState::Closed)
        .collect();
    if !closed.contains(&true) {
        return;
    }
    let shedding = (0..shards).any(|shard| {
        let call = u32::try_from(shard).unwrap_or(u32::MAX);
        closed[shard] && redis.sheds(&Route { shard, call }, now)
    });
    let max = if shedding {
        WRITE_BACK_WHILE_SHEDDING
    } else {
        WRITE_BACK_BATCH
    };
    let ready = guard
        .fallback
        .drain(max, |e| closed.get(redis.route(&e.key).shard) == Some(&true));
    if ready.is_empty() {
        return;
    }
    let keys = ready.len();
    let in_flight = &guard.fallback.writing_back;
    in_flight.fetch_add(keys as u64, std::sync::atomic::Ordering::Relaxed);
    let done = redis.adjust(ready, Adjust::Add).await;
    guard
        .fallback
        .written_back
        .fetch_add(done.units, std::sync::atomic::Ordering::Relaxed);
    guard
        .fallback
        .write_back_refused
        .fetch_add(done.refused, std::sync::atomic::Ordering::Relaxed);
    match done.error {
        None => tracing::info!(
            keys,
            units = done.units,
            over_limit = done.over,
            refused_units = done.refused,
            "wrote back what the fallback admitted while Redis was away"
        ),
        Some(e) => {
            // A timed-out call may have been applied: it is dropped rather than risk counting twice.
            tracing::warn!(error = %e, keys, units = done.units, over_limit = done.over, refused_units = done.refused, retry = done.retry.len(), unknown_units = done.unknown, "write-back failed part-way; retrying the rest");
            guard.fallback.restore(done.retry);
        }
    }
    // After the counters and the retries' return: a status read in between sees them waiting.
    in_flight.fetch_sub(keys as u64, std::sync::atomic::Ordering::Relaxed);
}
