//! The agent's background work against the shared store: flushes of batched counts, and the guard's
//! heartbeat, probes, write-back and sweeps.

use std::sync::Arc;
use std::time::Duration;

use floodgate_core::engine::Engine;
use floodgate_core::guard::{upkeep, BreakerState, Guard, LedgerEntry, LONG_REPLAY_MS};
use floodgate_core::shared_store::{Adjust, FailedOver, SharedStore};
use floodgate_core::store::Clock;
use floodgate_core::tasks::stopped;
use tokio::sync::watch;

/// How often the flusher looks for rules whose flush is due (the shortest useful interval).
const FLUSH_TICK: Duration = Duration::from_millis(5);

/// Flushes batched rules' counts when due, until shutdown.
pub(super) async fn flush_loop(
    engine: Arc<Engine>,
    redis: Arc<dyn SharedStore>,
    mut shutdown: watch::Receiver<bool>,
) {
    let mut tick = tokio::time::interval(FLUSH_TICK);
    tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
    loop {
        tokio::select! {
            _ = tick.tick() => { engine.flush_batched(redis.as_ref(), false).await; }
            _ = stopped(&mut shutdown) => break,
        }
    }
}

/// The guard's background work for a Redis store: the heartbeat (learning N), the write-back of what
/// the fallback admitted once the breaker is closed again, and the fallback's expiry sweep.
pub(super) async fn guard_loop(
    guard: Arc<Guard>,
    redis: Arc<dyn SharedStore>,
    engine: Arc<Engine>,
    warmed: bool,
    mut shutdown: watch::Receiver<bool>,
) {
    let interval = guard.membership.config().interval;
    let mut beat = tokio::time::interval(interval);
    beat.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
    let mut tick = tokio::time::interval(Duration::from_millis(100));
    let mut sweep = tokio::time::interval(Duration::from_secs(5));
    let id = guard.membership.config().id.clone();
    let ttl = guard.membership.config().ttl;
    // Loaded already when the start warmed the store up.
    if !warmed {
        if let Err(e) = redis.preload(Duration::from_millis(250)).await {
            tracing::warn!(error = %e, "could not load the check script yet; checks will load it on NOSCRIPT");
        }
    }
    let mut failovers = redis.failovers();
    // A failover's admissions are written again twice: at once, and one tick later for the calls
    // that were in flight to the old master when the switch was seen (answered within the store
    // timeout, after the first pass had taken what was recorded; the fault runner's Sentinel seed 2
    // lost 2 such units of one key-window without it). Both passes take the keys it moved.
    let mut again: Option<FailedOver> = None;
    // What a re-application could not write (the new primary not reachable yet: on an unplanned
    // Cluster failover redis-rs still sends to the old master until it learns the new slot map),
    // tried again every tick for as long as admissions are kept for a failover (15 s), then given
    // up.
    let mut unwritten: Vec<LedgerEntry> = Vec::new();
    let mut retry_until_ms = 0;
    loop {
        tokio::select! {
            _ = beat.tick() => match redis.heartbeat(&id, ttl, false).await {
                Ok(n) => {
                    let before = guard.membership.live();
                    guard.membership.observe(n);
                    if n != before {
                        tracing::info!(live_agents = n, "live agents changed");
                    }
                }
                Err(e) => tracing::debug!(error = %e, "heartbeat failed; keeping the last known agent count"),
            },
            _ = tick.tick() => {
                let seen = redis.failovers();
                if seen != failovers {
                    failovers = seen;
                    retry_until_ms = Clock::System.now_ms() + LONG_REPLAY_MS;
                    let moved = redis.failed_over();
                    unwritten = reapply(&engine, redis.as_ref(), &moved, std::mem::take(&mut unwritten)).await;
                    again = Some(moved);
                } else if let Some(moved) = again.take() {
                    unwritten = reapply(&engine, redis.as_ref(), &moved, std::mem::take(&mut unwritten)).await;
                } else if !unwritten.is_empty() && Clock::System.now_ms() > retry_until_ms {
                    let units: u64 = unwritten.iter().map(|e| e.units).sum();
                    tracing::warn!(keys = unwritten.len(), units, "the store failed over: gave up writing these recent admissions into the new primary");
                    unwritten.clear();
                } else if !unwritten.is_empty() {
                    let none = FailedOver::Keys(Arc::new(|_: &str| false));
                    unwritten = reapply(&engine, redis.as_ref(), &none, std::mem::take(&mut unwritten)).await;
                }
                for shard in 0..guard.breakers.len() {
                    if guard.breaker(shard).snapshot().state != BreakerState::Closed {
                        upkeep::probe(&guard, redis.as_ref(), shard, std::time::Instant::now).await;
                    }
                }
                if guard.fallback.pending() > 0 {
                    upkeep::write_back(&guard, redis.as_ref(), std::time::Instant::now()).await;
                }
            }
            _ = sweep.tick() => {
                guard.fallback.sweep();
                engine.cache().sweep(Clock::System.now_ms());
            }
            _ = stopped(&mut shutdown) => break,
        }
    }
    upkeep::write_back(&guard, redis.as_ref(), std::time::Instant::now()).await;
    let _ = redis.heartbeat(&id, ttl, true).await;
}

/// After a failover: writes what this agent admitted through the store in the last 3 to 15 s (as
/// long as each rule's counts last: [`horizon`](floodgate_core::guard::horizon)) into the new
/// primary, which may have lost it
/// (docs/accuracy.md, "Sentinel failover", "Cluster failover"), for the keys the failover `moved`,
/// with what an earlier pass could not write (`unwritten`). Units it had in fact received count
/// twice: stricter, never looser. Returns what it could not write (a call that failed or timed
/// out), to be tried again while it still counts.
async fn reapply(
    engine: &Engine,
    redis: &dyn SharedStore,
    moved: &FailedOver,
    unwritten: Vec<LedgerEntry>,
) -> Vec<LedgerEntry> {
    let Some(recent) = engine.recent() else {
        return Vec::new();
    };
    let now = Clock::System.now_ms();
    let mut entries = recent.take_moved(now, moved);
    entries.extend(unwritten);
    let keys = entries.len();
    let units: u64 = entries.iter().map(|e| e.units).sum();
    let done = redis.adjust(entries, Adjust::Add).await;
    let mut left = done.retry;
    left.extend(done.uncertain);
    match done.error {
        None => tracing::warn!(
            keys,
            units,
            over_limit = done.over,
            "the store failed over: wrote this agent's recent admissions into the new primary"
        ),
        Some(e) => {
            tracing::warn!(error = %e, keys, units, applied = done.units, left = left.len(), "the store failed over: writing this agent's recent admissions into the new primary failed part-way; trying the rest again")
        }
    }
    left
}
