//! The Redis store: one atomic Lua script call per check (per shard), EVALSHA with a transparent reload
//! on NOSCRIPT, a bounded timeout, and errors classified for the rule's fail mode. Independent nodes
//! or a Redis Cluster (`shards`), keys laid out by `floodgate_core::store::layout`.
//!
//! - `mod.rs`: [`RedisConfig`], [`RedisStore`] (its connections, routes and layout) and its
//!   `SharedStore` impl; the wait for a worker's answer;
//! - `scripts.rs`: the embedded Lua scripts and the live-agents key;
//! - `routes.rs`: a check's way to Redis: a node's own connection, a coalescing worker, or a call of
//!   its own through redis-rs; the check script's raw calls;
//! - `upkeep.rs`: off the request path: adjustments, flushes, the breaker's probe, preloads,
//!   heartbeats, pings;
//! - `errors.rs`: Redis failures classified (timeout, connection, script, server);
//! - `call.rs`: one check-script call's items and its EVALSHA, as a redis-rs command or as RESP;
//! - `coalesce.rs`: the coalescing worker of a Cluster's or a Sentinel-named master's call group;
//! - `resp.rs`: RESP, written and read: the commands' bytes and the replies' parser;
//! - `node/`: the check path's own connection to each independent node, and its task.

mod call;
mod coalesce;
mod errors;
mod node;
mod resp;
mod routes;
mod scripts;
mod upkeep;

pub use scripts::{AGENTS_KEY, CHECK_LUA, FLUSH_LUA, HEARTBEAT_LUA};
pub use upkeep::{ADJUST_CHUNK, FLUSH_CHUNK, FLUSH_CONCURRENCY};

use std::sync::{Arc, OnceLock};
use std::time::{Duration, Instant};

use redis::Script;

use floodgate_core::algo::Outcome;
use floodgate_core::batch::FlushEntry;
use floodgate_core::guard::LedgerEntry;
use floodgate_core::shared_store::{Adjust, Adjusted, BoxFuture, FailedOver, Flushed, Route, SharedStore};
use floodgate_core::store::{Layout, Planned, StoreError};

use crate::shards::{RedisAccess, Shards};

/// Check items one coalesced script call carries by default: 64 × ~1-3 µs keeps a call well under a
/// millisecond of Redis time.
pub const DEFAULT_COALESCE: usize = 64;

/// How to reach Redis.
#[derive(Debug, Clone)]
pub struct RedisConfig {
    /// `redis://host:port/db`: one node, several independent shards, or a cluster's seed nodes.
    pub urls: Vec<String>,
    /// Whether `urls` are seeds of one Redis Cluster.
    pub cluster: bool,
    /// Longest a check may wait for Redis before the rule's fail mode decides.
    pub timeout: Duration,
    /// Buckets and hash tags; the same on every agent of a fleet.
    pub layout: Layout,
    /// Most check items one coalesced script call carries (1: one call per check).
    pub coalesce: usize,
    /// TLS roots and the AUTH password kept out of the URLs.
    pub access: RedisAccess,
}

impl RedisConfig {
    /// One node at `url`, the default layout.
    pub fn single(url: &str, timeout: Duration) -> Self {
        RedisConfig {
            urls: vec![url.to_string()],
            cluster: false,
            timeout,
            layout: Layout::default(),
            coalesce: DEFAULT_COALESCE,
            access: Default::default(),
        }
    }
}

/// Redis as the shared counter store.
pub struct RedisStore {
    shards: Shards,
    layout: Layout,
    script: Script,
    flush: Script,
    heartbeat: Script,
    timeout: Duration,
    coalesce: usize,
    workers: OnceLock<Vec<tokio::sync::mpsc::UnboundedSender<coalesce::Job>>>,
    /// Independent nodes: where each is, for the check path's own connections (`node`); `None` for
    /// a Cluster or Sentinel, whose checks go through redis-rs.
    nodes: Option<Vec<Arc<node::NodeAddr>>>,
    /// The task of each node, started on first use.
    pipes: OnceLock<Vec<node::Pipe>>,
}

impl RedisStore {
    /// Prepares a store. Connects lazily: an agent starts (and fails open) even while Redis is away.
    pub fn new(config: &RedisConfig) -> Result<Self, StoreError> {
        let shards = Shards::new(
            &config.urls,
            config.cluster,
            config.layout.buckets(),
            &config.access,
        )?;
        shards.watch_failovers();
        let nodes = match shards {
            Shards::Nodes { .. } => config
                .urls
                .iter()
                .map(|url| node::NodeAddr::new(url, &config.access))
                .collect::<Result<Vec<_>, _>>()?
                .into_iter()
                .map(|addr| addr.map(Arc::new))
                .collect(),
            _ => None,
        };
        Ok(RedisStore {
            shards,
            layout: config.layout,
            script: Script::new(CHECK_LUA),
            flush: Script::new(FLUSH_LUA),
            heartbeat: Script::new(HEARTBEAT_LUA),
            timeout: config.timeout,
            coalesce: config.coalesce,
            workers: OnceLock::new(),
            nodes,
            pipes: OnceLock::new(),
        })
    }

    /// The tasks of the nodes' own connections, if the check path has them.
    fn pipes(&self) -> Option<&[node::Pipe]> {
        let nodes = self.nodes.as_ref()?;
        let pipes = self.pipes.get_or_init(|| {
            nodes
                .iter()
                .enumerate()
                .map(|(shard, addr)| {
                    node::spawn(node::NodeTask {
                        shard,
                        addr: addr.clone(),
                        script_hash: self.script.get_hash().to_string(),
                        script: CHECK_LUA,
                        layout: self.layout,
                        timeout: self.timeout,
                        max_items: self.coalesce.max(1),
                    })
                })
                .collect()
        });
        Some(pipes)
    }

    /// The nodes or the cluster, without passwords, for logs.
    pub fn describe(&self) -> String {
        format!("redis: {}", self.shards.describe())
    }

    /// How many shards (each with its own breaker).
    pub fn shard_count(&self) -> usize {
        self.shards.len()
    }

    /// The key layout.
    pub fn layout(&self) -> &Layout {
        &self.layout
    }

    /// Where a client key's counters live.
    pub fn route(&self, key: &str) -> Route {
        let bucket = self.layout.bucket(key);
        let tag = bucket % self.layout.tags();
        let shard = self.shards.shard_of_bucket(bucket);
        let call = if self.shards.is_cluster() {
            tag
        } else {
            shard as u32
        };
        Route { shard, call }
    }
}

impl SharedStore for RedisStore {
    fn describe(&self) -> String {
        RedisStore::describe(self)
    }

    fn shard_count(&self) -> usize {
        RedisStore::shard_count(self)
    }

    fn route(&self, key: &str) -> Route {
        RedisStore::route(self, key)
    }

    fn fails_over(&self) -> bool {
        self.shards.is_sentinel() || self.shards.is_cluster()
    }

    fn failovers(&self) -> u64 {
        self.shards.failovers()
    }

    fn failed_over(&self) -> FailedOver {
        let Some(slots) = self.shards.take_failed_slots() else {
            return FailedOver::All;
        };
        // A client key's counters live under its hash tag (`fg:{7}:…`): its slot is the tag's.
        let layout = self.layout;
        FailedOver::Keys(Arc::new(move |key: &str| {
            let tag = itoa::Buffer::new().format(layout.tag(key)).to_string();
            crate::cluster_watch::has_slot(&slots, crate::cluster_watch::slot_of(&tag))
        }))
    }

    fn sheds(&self, route: &Route, received: Instant) -> bool {
        let Some(pipes) = self.pipes() else {
            return false;
        };
        let left = (received + self.timeout).saturating_duration_since(Instant::now());
        pipes[route.shard % pipes.len()].sheds(left)
    }

    fn check(
        self: Arc<Self>,
        items: Vec<Planned>,
        received: Instant,
    ) -> BoxFuture<'static, Result<Vec<Outcome>, StoreError>> {
        match self.check_on_pipe(items, received) {
            Ok(answer) => Box::pin(answer),
            Err(items) => Box::pin(async move { RedisStore::check(&self, items, received).await }),
        }
    }

    fn adjust(&self, entries: Vec<LedgerEntry>, how: Adjust) -> BoxFuture<'_, Adjusted> {
        Box::pin(RedisStore::adjust(self, entries, how))
    }

    fn flush(&self, entries: Vec<FlushEntry>) -> BoxFuture<'_, Flushed> {
        Box::pin(RedisStore::flush(self, entries))
    }

    fn probe(&self, shard: usize) -> BoxFuture<'_, Result<(), StoreError>> {
        Box::pin(RedisStore::probe(self, shard))
    }

    fn preload(&self, patience: Duration) -> BoxFuture<'_, Result<(), StoreError>> {
        Box::pin(RedisStore::preload(self, patience))
    }

    fn warm_up(&self, patience: Duration) -> BoxFuture<'_, Result<(), StoreError>> {
        Box::pin(RedisStore::warm_up(self, patience))
    }

    fn heartbeat<'a>(
        &'a self,
        id: &'a str,
        ttl: Duration,
        leaving: bool,
    ) -> BoxFuture<'a, Result<u64, StoreError>> {
        Box::pin(RedisStore::heartbeat(self, id, ttl, leaving))
    }

    fn ping(&self) -> BoxFuture<'_, Result<(), StoreError>> {
        Box::pin(RedisStore::ping(self))
    }
}

/// Hands a request to a worker (`send` gets where the answer goes; false: the worker is gone) and
/// waits for the answer within `timeout`.
async fn ask<T>(
    timeout: Duration,
    send: impl FnOnce(tokio::sync::oneshot::Sender<Result<T, StoreError>>) -> bool,
) -> Result<T, StoreError> {
    let (tx, rx) = tokio::sync::oneshot::channel();
    let sent = send(tx);
    answer(sent, rx, timeout).await
}

/// The wait for a worker's answer to a request handed to it (`sent`: it took the request).
async fn answer<T>(
    sent: bool,
    rx: tokio::sync::oneshot::Receiver<Result<T, StoreError>>,
    timeout: Duration,
) -> Result<T, StoreError> {
    let shutting_down = || StoreError::Connection("store is shutting down".into());
    if !sent {
        return Err(shutting_down());
    }
    match tokio::time::timeout(timeout, rx).await {
        Ok(Ok(result)) => result,
        Ok(Err(_)) => Err(shutting_down()),
        Err(_) => Err(StoreError::Timeout(timeout)),
    }
}
