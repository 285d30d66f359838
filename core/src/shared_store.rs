//! The store the fleet shares (Redis): what the engine and the agent's background loops ask of it,
//! as a trait, so the engine holds no I/O of its own. `floodgate-redis` implements it.

use std::future::Future;
use std::pin::Pin;
use std::sync::Arc;
use std::time::Duration;

use crate::algo::Outcome;
use crate::batch::{FlushEntry, Learned};
use crate::guard::LedgerEntry;
use crate::store::{Planned, StoreError};

/// A boxed future: what the trait's calls return (the engine holds the store as a trait object).
pub type BoxFuture<'a, T> = Pin<Box<dyn Future<Output = T> + Send + 'a>>;

/// A flush's answers: each chunk of entries sent, with its own result.
pub type Flushed = Vec<(Vec<FlushEntry>, Result<FlushReply, StoreError>)>;

/// A counter store shared by the fleet. Every call is bounded by the store's own timeout.
pub trait SharedStore: Send + Sync + 'static {
    /// The nodes without passwords, for logs.
    fn describe(&self) -> String;
    /// How many shards (each with its own breaker).
    fn shard_count(&self) -> usize;
    /// Where a client key's counters live.
    fn route(&self, key: &str) -> Route;
    /// Whether a check for `route` read at `received` would be shed now (the store is past its
    /// capacity there): the engine then answers it by its fail modes at once, without a future, a
    /// queue or a call. A store that never sheds says no.
    fn sheds(&self, _route: &Route, _received: std::time::Instant) -> bool {
        false
    }
    /// Whether the store can fail over to a replica that lacks its latest writes (Sentinel, a
    /// Cluster): the engine then keeps what it admitted in the last seconds, to write again after a
    /// failover.
    fn fails_over(&self) -> bool {
        false
    }
    /// Failovers seen so far (each time a new primary was named): the agent's loop writes the
    /// recent admissions again after each.
    fn failovers(&self) -> u64 {
        0
    }
    /// Which client keys the failovers seen since the last call moved to a new primary: every key
    /// (one primary, as under Sentinel), or those on a Cluster's failed-over slots.
    fn failed_over(&self) -> FailedOver {
        FailedOver::All
    }
    /// Checks the items of one check atomically (all or nothing); outcomes in item order. Every item
    /// has the same route (the engine groups them). `received` is when the check's frame was read:
    /// its budget (the store timeout) runs from then, not from when it reaches the store.
    fn check(
        self: Arc<Self>,
        items: Vec<Planned>,
        received: std::time::Instant,
    ) -> BoxFuture<'static, Result<Vec<Outcome>, StoreError>>;
    /// Adds or takes back ledger entries' units.
    fn adjust(&self, entries: Vec<LedgerEntry>, how: Adjust) -> BoxFuture<'_, Adjusted>;
    /// Writes batched counts and learns the fleet's; each chunk comes back with its own result.
    fn flush(&self, entries: Vec<FlushEntry>) -> BoxFuture<'_, Flushed>;
    /// The breaker's probe of one shard: succeeds only when checks would.
    fn probe(&self, shard: usize) -> BoxFuture<'_, Result<(), StoreError>>;
    /// Loads the scripts on every shard ahead of the checks, each load waiting at most `patience`.
    fn preload(&self, patience: Duration) -> BoxFuture<'_, Result<(), StoreError>>;
    /// Loads the scripts and opens the check path's connection to every shard, each step waiting at
    /// most `patience` (before the agent serves).
    fn warm_up(&self, patience: Duration) -> BoxFuture<'_, Result<(), StoreError>>;
    /// Writes this agent's heartbeat (removes it when `leaving`); answers the live-agent count.
    fn heartbeat<'a>(
        &'a self,
        id: &'a str,
        ttl: Duration,
        leaving: bool,
    ) -> BoxFuture<'a, Result<u64, StoreError>>;
    /// Whether every shard answers (readiness).
    fn ping(&self) -> BoxFuture<'_, Result<(), StoreError>>;
}

/// Where an item goes: the shard (whose breaker guards it) and the call group (items one script call
/// may carry together: a whole node, or on a cluster one hash tag).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub struct Route {
    /// The shard index.
    pub shard: usize,
    /// The call group.
    pub call: u32,
}

/// The client keys a failover moved to a new primary ([`SharedStore::failed_over`]).
#[derive(Clone)]
pub enum FailedOver {
    /// Every key.
    All,
    /// The keys this says yes to.
    Keys(Arc<dyn Fn(&str) -> bool + Send + Sync>),
}

impl FailedOver {
    /// Whether a failover moved `key`.
    pub fn moved(&self, key: &str) -> bool {
        match self {
            FailedOver::All => true,
            FailedOver::Keys(f) => f(key),
        }
    }
}

/// What an adjustment does to the counters.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Adjust {
    /// Add units whatever the verdict (what agents admitted locally).
    Add,
    /// Take units back (a check consumed them here but was rejected elsewhere).
    TakeBack,
}

/// What an adjustment did: units applied, entries to try again (the call failed), and the error.
#[derive(Debug, Default)]
pub struct Adjusted {
    /// Units applied by calls that succeeded.
    pub units: u64,
    /// Entries of calls that failed surely (not applied): try them again later.
    pub retry: Vec<LedgerEntry>,
    /// Units of calls that timed out: they may or may not have been applied, and the write-back does
    /// not retry them (counting them twice would be worse).
    pub unknown: u64,
    /// The entries of those calls: a failover's re-application, which counts twice by design
    /// (stricter, never looser), tries them again.
    pub uncertain: Vec<LedgerEntry>,
    /// Units that landed past their rule's limit (adds only; also counted in the metrics).
    pub over: u64,
    /// Units of entries Redis refused (an error of the script on that entry, e.g. its key holds
    /// another type): dropped, never retried, since the same entry would fail the same way and hold
    /// back the rest; the call's other entries were applied.
    pub refused: u64,
    /// The last error.
    pub error: Option<StoreError>,
}

/// A flush call's answer: Redis's clock, and what each entry learned.
#[derive(Debug, Clone)]
pub struct FlushReply {
    /// Redis `TIME` in ms when the call ran.
    pub now_ms: u64,
    /// Local clock (ms) when the call was sent and when it was answered: Redis's clock was read in
    /// between, which is what the clock offset is learned from.
    pub sent_ms: u64,
    /// See `sent_ms`.
    pub answered_ms: u64,
    /// Per entry, in order.
    pub learned: Vec<Learned>,
}
