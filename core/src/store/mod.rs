//! The embedded in-memory store, what every store is asked (`Planned` items) and how it fails
//! (`StoreError`); the key layout the Redis scripts use. The choice between the embedded store and
//! the fleet's shared one is the engine's `Store`.
//!
//! Both run the same algorithms (`crate::algo` in Rust, `lua/` in Redis) with all-or-nothing semantics
//! within one call: costs are committed only if every enforced item passes.

pub mod layout;
mod memory;

use std::sync::Arc;

pub use self::layout::{Layout, WINDOW_HASHES};
pub use self::memory::{Clock, MemoryStore};

use floodgate_protocol::CompactString;
pub use floodgate_protocol::ItemMode;

use crate::rules::Rule;

/// One item to check: a rule, the client key it counts, and the cost.
#[derive(Debug, Clone)]
pub struct Planned {
    /// The rule.
    pub rule: Arc<Rule>,
    /// The client key, e.g. `user:123` (validated: no braces; inline up to 24 bytes, so the store's
    /// copies of it cost no allocation).
    pub key: CompactString,
    /// Units to consume (or, by `mode`, to peek at or to charge).
    pub cost: u64,
    /// What the item does with its cost.
    pub mode: ItemMode,
    /// A concurrency rule's lease: the one its units are held under (an acquire) or to free (a
    /// release).
    pub lease: Lease,
}

impl Planned {
    /// An item that consumes `cost` of `rule` for `key`, with no lease.
    pub fn consume(rule: Arc<Rule>, key: &str, cost: u64) -> Self {
        Planned {
            rule,
            key: key.into(),
            cost,
            mode: ItemMode::default(),
            lease: Lease::None,
        }
    }
}

/// The lease of a concurrency rule's item.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum Lease {
    /// None: a rate rule's item, a peek, or a release by count.
    #[default]
    None,
    /// The client's: the decision tells it the lease is held, and it releases it.
    Client(u64),
    /// Picked by the agent for an acquire that came without one (Envoy, version-1 clients): freed by
    /// a release by count, or when it runs out.
    Agent(u64),
}

impl Lease {
    /// The lease id, if any.
    pub fn id(self) -> Option<u64> {
        match self {
            Lease::None => None,
            Lease::Client(id) | Lease::Agent(id) => Some(id),
        }
    }
}

/// Why a store could not answer, classified so that fail-open/closed decides on a kind, not a string.
#[derive(Debug, Clone, thiserror::Error)]
#[non_exhaustive]
pub enum StoreError {
    /// No answer within the store timeout.
    #[error("store timed out after {0:?}")]
    Timeout(std::time::Duration),
    /// The connection is down or was refused.
    #[error("store connection failed: {0}")]
    Connection(String),
    /// The script failed or returned something unexpected.
    #[error("store script failed: {0}")]
    Script(String),
    /// The server answered with an error (OOM, READONLY, …).
    #[error("store server error: {0}")]
    Server(String),
    /// Not sent: the agent is past what the store answers within a check's budget (its queue to
    /// the store already waits longer than the time left), so the check is answered by its rules'
    /// fail modes at once instead of queueing. Redis is not at fault: no breaker counts it.
    #[error("shed: the agent is past its capacity toward the store")]
    Shed,
}

/// The URL without its password, for logs.
pub fn redact(url: &str) -> String {
    match (url.find("://"), url.rfind('@')) {
        (Some(s), Some(at)) if at > s => format!("{}://***@{}", &url[..s], &url[at + 1..]),
        _ => url.to_string(),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn passwords_stay_out_of_logs() {
        assert_eq!(redact("redis://:secret@host:6379/0"), "redis://***@host:6379/0");
        assert_eq!(redact("redis://host:6379"), "redis://host:6379");
    }
}
