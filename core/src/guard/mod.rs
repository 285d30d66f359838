//! Keeping the limiter from becoming the outage: a circuit breaker per shard, the limit/N fallback
//! limiter with its write-back ledger, and fleet membership (N) from heartbeats in Redis.

mod breaker;
mod fallback;
mod leases;
pub mod membership;
mod recent;
pub mod upkeep;

pub use breaker::{Breaker, BreakerConfig, BreakerSnapshot, BreakerState, Permit, Transition};
pub use fallback::{Fallback, LedgerEntry};
pub use membership::{Membership, MembershipConfig};
pub use recent::{horizon, Recent, LONG_REPLAY_MS, REPLAY_MS};

use crate::store::Clock;

/// What guards one Redis store: a breaker per shard, the fallback limiter and fleet membership.
pub struct Guard {
    /// One circuit breaker per shard (a Redis Cluster is one shard: redis-rs follows its failovers).
    pub breakers: Vec<Breaker>,
    /// The local limiter used while the breaker is not closed.
    pub fallback: Fallback,
    /// N, the live agents.
    pub membership: Membership,
}

impl Guard {
    /// A guard for `shards` shards with these settings.
    pub fn new(breaker: BreakerConfig, membership: MembershipConfig, shards: usize) -> Self {
        Self::with_clock(breaker, membership, shards, Clock::System)
    }

    /// The same on `clock` (a manual one in simulations).
    pub fn with_clock(
        breaker: BreakerConfig,
        membership: MembershipConfig,
        shards: usize,
        clock: Clock,
    ) -> Self {
        Guard {
            breakers: (0..shards.max(1)).map(|_| Breaker::new(breaker)).collect(),
            fallback: Fallback::new(clock),
            membership: Membership::new(membership),
        }
    }

    /// The breaker of a shard.
    pub fn breaker(&self, shard: usize) -> &Breaker {
        &self.breakers[shard % self.breakers.len()]
    }

    /// Whether every shard's breaker is closed.
    pub fn all_closed(&self) -> bool {
        self.breakers
            .iter()
            .all(|b| b.snapshot().state == BreakerState::Closed)
    }
}
