//! Keeping the limiter from becoming the outage: a circuit breaker per shard, the limit/N fallback
//! limiter with its write-back ledger, and fleet membership (N) from heartbeats in Redis.

mod breaker;
mod fallback;
pub(crate) mod membership;

pub use breaker::{Breaker, BreakerConfig, BreakerSnapshot, BreakerState, Permit, Transition};
pub use fallback::{Fallback, LedgerEntry};
pub use membership::{Membership, MembershipConfig};

/// What guards one Redis store: its breaker, the fallback limiter and fleet membership.
pub struct Guard {
    /// The store's circuit breaker (one shard for now).
    pub breaker: Breaker,
    /// The local limiter used while the breaker is not closed.
    pub fallback: Fallback,
    /// N, the live agents.
    pub membership: Membership,
}

impl Guard {
    /// A guard with these settings.
    pub fn new(breaker: BreakerConfig, membership: MembershipConfig) -> Self {
        Guard {
            breaker: Breaker::new(breaker),
            fallback: Fallback::default(),
            membership: Membership::new(membership),
        }
    }
}
