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
    let mut replay = Replay::new(redis.failovers());
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
                replay.tick(&engine, redis.as_ref()).await;
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

/// A failover's re-application of recent admissions (docs/accuracy.md, "Sentinel failover",
/// "Cluster failover"): what this agent admitted through the store while it still counts (3 to
/// 15 s: [`horizon`](floodgate_core::guard::horizon)) is written into the new primary, for the keys
/// the failover moved, which may have lost it. Units it had in fact received count twice: stricter,
/// never looser.
struct Replay {
    /// Failovers seen so far.
    seen: u64,
    /// The keys the last failover moved, for its second pass: one tick after the first, for the
    /// calls that were in flight to the old master when the switch was seen (answered within the
    /// store timeout, after the first pass took what was recorded; the fault runner's Sentinel seed
    /// 2 lost 2 such units of one key-window without it).
    again: Option<FailedOver>,
    /// What a pass could not write (the new primary not reachable yet: on an unplanned Cluster
    /// failover redis-rs sends to the old master until it learns the new slot map), tried again
    /// every tick until `until_ms`, as long as admissions are kept for a failover.
    unwritten: Vec<LedgerEntry>,
    until_ms: u64,
}

impl Replay {
    fn new(seen: u64) -> Self {
        Replay {
            seen,
            again: None,
            unwritten: Vec::new(),
            until_ms: 0,
        }
    }

    /// One guard tick: a new failover's first pass, its second, or another try of what is left.
    async fn tick(&mut self, engine: &Engine, redis: &dyn SharedStore) {
        let Some(recent) = engine.recent() else { return };
        let now = Clock::System.now_ms();
        let seen = redis.failovers();
        let mut entries = if seen != self.seen {
            self.seen = seen;
            self.until_ms = now + LONG_REPLAY_MS;
            let moved = redis.failed_over();
            let taken = recent.take_moved(now, &moved);
            self.again = Some(moved);
            taken
        } else if let Some(moved) = self.again.take() {
            recent.take_moved(now, &moved)
        } else if self.unwritten.is_empty() {
            return;
        } else if now > self.until_ms {
            let units: u64 = self.unwritten.iter().map(|e| e.units).sum();
            tracing::warn!(
                keys = self.unwritten.len(),
                units,
                "the store failed over: gave up writing these recent admissions into the new primary"
            );
            self.unwritten.clear();
            return;
        } else {
            Vec::new()
        };
        entries.append(&mut self.unwritten);
        let keys = entries.len();
        let units: u64 = entries.iter().map(|e| e.units).sum();
        let done = redis.adjust(entries, Adjust::Add).await;
        self.unwritten = done.retry;
        self.unwritten.extend(done.uncertain);
        match done.error {
            None => tracing::warn!(
                keys,
                units,
                over_limit = done.over,
                "the store failed over: wrote this agent's recent admissions into the new primary"
            ),
            Some(e) => {
                tracing::warn!(error = %e, keys, units, applied = done.units, left = self.unwritten.len(), "the store failed over: writing this agent's recent admissions into the new primary failed part-way; trying the rest again")
            }
        }
    }
}
