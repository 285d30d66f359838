//! Counter stores: the embedded in-memory store and Redis, behind one interface.
//!
//! Both run the same algorithms (`crate::algo` in Rust, `lua/` in Redis) with all-or-nothing semantics
//! within one call: costs are committed only if every enforced item passes.

mod coalesce;
pub mod layout;
mod memory;
mod redis;
mod sentinel;
pub mod shards;

use std::sync::Arc;

pub use self::layout::Layout;
pub use self::memory::{Clock, MemoryStore};
pub use self::redis::{
    Adjust, Adjusted, FlushReply, RedisConfig, RedisStore, Route, ADJUST_CHUNK, CHECK_LUA, DEFAULT_COALESCE,
    FLUSH_CHUNK, FLUSH_LUA,
};

use crate::rules::Rule;

/// One item to check: a rule, the client key it counts, and the cost.
#[derive(Debug, Clone)]
pub struct Planned {
    /// The rule.
    pub rule: Arc<Rule>,
    /// The client key, e.g. `user:123` (validated: no braces).
    pub key: String,
    /// Units to consume.
    pub cost: u64,
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
}

/// The store an agent uses.
#[derive(Clone)]
pub enum Store {
    /// The embedded in-memory store: exact for one agent, no fleet-wide sharing.
    Memory(Arc<MemoryStore>),
    /// Redis: fleet-wide state through atomic scripts.
    Redis(Arc<RedisStore>),
}

impl Store {
    /// A short name for logs: `memory` or the Redis URL without credentials.
    pub fn describe(&self) -> String {
        match self {
            Store::Memory(_) => "embedded in-memory store".into(),
            Store::Redis(r) => format!("redis: {}", r.describe()),
        }
    }
}
