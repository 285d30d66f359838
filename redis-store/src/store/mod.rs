//! The Redis store: one atomic Lua script call per check (per shard), EVALSHA with a transparent reload
//! on NOSCRIPT, a bounded timeout, and errors classified for the rule's fail mode. Independent nodes
//! or a Redis Cluster (`shards`), keys laid out by `floodgate_core::store::layout`.

mod call;
mod coalesce;
mod errors;
mod node;
mod resp;
mod scripts;

pub use scripts::{AGENTS_KEY, CHECK_LUA, FLUSH_LUA, HEARTBEAT_LUA};

use std::future::Future;
use std::sync::{Arc, OnceLock};
use std::time::{Duration, Instant};

use redis::{Cmd, ErrorKind, Script, ServerErrorKind};

use call::CallItem;
use errors::classify;
use floodgate_core::algo::Outcome;
use floodgate_core::batch::{FlushEntry, Learned};
use floodgate_core::guard::LedgerEntry;
use floodgate_core::metrics;
use floodgate_core::shared::{Adjust, Adjusted, BoxFuture, FlushReply, Flushed, Route, SharedStore};
use floodgate_core::store::{Layout, Planned, StoreError};

use crate::shards::{RedisAccess, Shards};

/// Entries one flush script call carries: ~1 µs of Redis time each, so a call stays well under a
/// millisecond and never holds up the checks queued behind it.
pub const FLUSH_CHUNK: usize = 256;

/// Check items one coalesced script call carries by default: 64 × ~1-3 µs keeps a call well under a
/// millisecond of Redis time.
pub const DEFAULT_COALESCE: usize = 64;

/// Flush calls in flight at once.
pub const FLUSH_CONCURRENCY: usize = 4;

/// Entries one adjustment script call carries (keeps each call short: Redis runs one script at a time).
pub const ADJUST_CHUNK: usize = 64;

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
        self.shards.describe()
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

    /// Checks the items of one check atomically (all or nothing); outcomes come back in item order.
    /// Every item must have the same route (the engine groups them). With coalescing on, checks that
    /// arrive together for one call group share a script call (`coalesce`), each still all or
    /// nothing; the wait is bounded by the store timeout either way.
    pub async fn check(
        self: &Arc<Self>,
        items: Vec<Planned>,
        received: Instant,
    ) -> Result<Vec<Outcome>, StoreError> {
        let items = match self.check_on_pipe(items, received) {
            Ok(answer) => return answer.await,
            Err(items) => items,
        };
        let Some(first) = items.first() else {
            return Ok(Vec::new());
        };
        let route = self.route(&first.key);
        if self.coalesce <= 1 {
            let mut reply = self.run_batch_direct(route.shard, vec![items]).await?;
            return Ok(reply.pop().unwrap_or_default());
        }
        let workers = self.workers.get_or_init(|| {
            let calls = if self.shards.is_cluster() {
                self.layout.tags() as usize
            } else {
                self.shards.len()
            };
            (0..calls)
                .map(|call| {
                    let shard = if self.shards.is_cluster() { 0 } else { call };
                    coalesce::spawn(Arc::downgrade(self), shard, self.coalesce)
                })
                .collect()
        });
        let worker = &workers[route.call as usize % workers.len()];
        let deadline = received + self.timeout;
        let left = deadline.saturating_duration_since(Instant::now());
        if left.is_zero() {
            return Err(StoreError::Shed);
        }
        ask(left, |reply| {
            worker
                .send(coalesce::Job {
                    items,
                    reply,
                    deadline,
                })
                .is_ok()
        })
        .await
    }

    /// Hands a check to its node's own connection (`node/`) at once and returns the wait for its
    /// answer: a oneshot and a timer, 168 bytes, where `check`'s whole future (which also holds the
    /// redis-rs paths' calls) is 1,152 bytes, past glibc's per-thread cache of small blocks (1,032
    /// bytes): boxed on its own, the common path's future no longer takes malloc's slow path.
    /// `Err` gives the items back: no node connections (a Cluster, Sentinel), or nothing to check.
    fn check_on_pipe(
        &self,
        items: Vec<Planned>,
        received: Instant,
    ) -> Result<impl Future<Output = Result<Vec<Outcome>, StoreError>> + Send + 'static, Vec<Planned>> {
        let (Some(pipes), Some(first)) = (self.pipes(), items.first()) else {
            return Err(items);
        };
        let pipe = &pipes[self.route(&first.key).shard % pipes.len()];
        // The budget runs from the frame's read. Past capacity (the node's queue already waits
        // longer than a check may: its task says so), or with no time left, the check is shed at
        // once: answered by its rules' fail modes without a queue, a timer or a call.
        let deadline = received + self.timeout;
        let left = deadline.saturating_duration_since(Instant::now());
        let (reply, rx) = tokio::sync::oneshot::channel();
        let job = coalesce::Job {
            items,
            reply,
            deadline,
        };
        let shed = pipe.send_check(job, left).is_err();
        let closed = shed && pipe.tx.is_closed();
        Ok(async move {
            if closed {
                return Err(StoreError::Connection("store is shutting down".into()));
            }
            if shed {
                return Err(StoreError::Shed);
            }
            answer(true, rx, left).await
        })
    }

    /// Runs queued checks of one call group as one script call and answers each.
    pub(crate) async fn run_batch(&self, shard: usize, batch: Vec<coalesce::Job>) {
        // A check whose caller gave up (its timeout passed) is not sent: nobody would learn whether
        // it counted.
        let batch: Vec<coalesce::Job> = batch.into_iter().filter(|j| !j.reply.is_closed()).collect();
        if batch.is_empty() {
            return;
        }
        let (checks, replies): (Vec<Vec<Planned>>, Vec<_>) =
            batch.into_iter().map(|j| (j.items, j.reply)).unzip();
        match self.run_batch_direct(shard, checks).await {
            Ok(outcomes) => {
                for (reply, o) in replies.into_iter().zip(outcomes) {
                    let _ = reply.send(Ok(o));
                }
            }
            Err(e) => {
                for reply in replies {
                    let _ = reply.send(Err(e.clone()));
                }
            }
        }
    }

    /// One script call for several checks (each all or nothing): outcomes per check, in order.
    async fn run_batch_direct(
        &self,
        shard: usize,
        checks: Vec<Vec<Planned>>,
    ) -> Result<Vec<Vec<Outcome>>, StoreError> {
        let items = call::check_items(checks.iter().map(Vec::as_slice));
        let reply = self
            .invoke(&self.check_cmd(&items), shard, items.len(), self.timeout)
            .await?;
        let mut outcomes = reply.chunks_exact(5).map(call::outcome);
        Ok(checks
            .iter()
            .map(|items| outcomes.by_ref().take(items.len()).collect())
            .collect())
    }

    /// Adds (`Adjust::Add`: what the fallback admitted while a shard was away, each into the window
    /// it was admitted in, so the limit holds across the outage) or takes back (`Adjust::TakeBack`)
    /// units, grouped by call and in chunks of [`ADJUST_CHUNK`]. Not on the request path: a longer
    /// timeout than checks get.
    pub async fn adjust(&self, entries: Vec<LedgerEntry>, how: Adjust) -> Adjusted {
        let mut groups: Vec<(Route, Vec<LedgerEntry>)> = Vec::new();
        for e in entries {
            let route = self.route(&e.key);
            match groups.iter_mut().find(|(r, _)| r.call == route.call) {
                Some((_, g)) => g.push(e),
                None => groups.push((route, vec![e])),
            }
        }
        let timeout = self.timeout.max(Duration::from_millis(250));
        let op = match how {
            Adjust::Add => "write_back",
            Adjust::TakeBack => "take_back",
        };
        let mut done = Adjusted::default();
        for (route, group) in groups {
            for chunk in group.chunks(ADJUST_CHUNK) {
                let mode = match how {
                    Adjust::Add => 2,
                    Adjust::TakeBack => 3,
                };
                let items: Vec<CallItem<'_>> = chunk
                    .iter()
                    .map(|e| CallItem {
                        rule: &e.rule,
                        key: &e.key,
                        cost: e.units,
                        mode,
                        target: e.window,
                        last: true,
                    })
                    .collect();
                let units: u64 = chunk.iter().map(|e| e.units).sum();
                match self
                    .invoke(&self.check_cmd(&items), route.shard, chunk.len(), timeout)
                    .await
                {
                    Ok(reply) => {
                        for (e, r) in chunk.iter().zip(reply.chunks_exact(5)) {
                            // -1: Redis refused this entry (check.lua's pcall caught the error);
                            // nothing of it was applied. Dropped: it would fail again and again.
                            if r[0] == -1 {
                                done.refused += e.units;
                                metrics::script_errors(op, 1);
                                tracing::warn!(rule = %e.rule.id, key = %e.key, units = e.units, op, "Redis refused this entry's script; dropped (the others applied)");
                                continue;
                            }
                            done.units += e.units;
                            // Each add answers its window's count after it, as a flush write does.
                            if matches!(how, Adjust::Add) {
                                let count = u64::try_from(r[4]).unwrap_or(0);
                                done.over += metrics::over_admitted(
                                    &e.rule,
                                    metrics::OverSource::Fallback,
                                    count,
                                    e.units,
                                );
                            }
                        }
                    }
                    Err(e) => {
                        match e {
                            StoreError::Timeout(_) => done.unknown += units,
                            // The script itself failed (not one entry): the same call would fail
                            // the same way, so it is dropped rather than retried for ever.
                            StoreError::Script(_) => {
                                done.refused += units;
                                metrics::script_errors(op, chunk.len() as u64);
                            }
                            _ => done.retry.extend(chunk.iter().cloned()),
                        }
                        done.error = Some(e);
                    }
                }
            }
        }
        done
    }

    /// Sends a flush: entries grouped by call and in chunks of [`FLUSH_CHUNK`], a few calls at once.
    /// Each chunk comes back with its own result (a failing shard does not fail the others).
    pub async fn flush(&self, entries: Vec<FlushEntry>) -> Flushed {
        let mut groups: Vec<(Route, Vec<FlushEntry>)> = Vec::new();
        for e in entries {
            let route = self.route(&e.key);
            match groups
                .iter_mut()
                .find(|(r, g)| r.call == route.call && g.len() < FLUSH_CHUNK)
            {
                Some((_, g)) => g.push(e),
                None => groups.push((route, vec![e])),
            }
        }
        // Not on the request path: a longer timeout than checks get.
        let timeout = self.timeout.max(Duration::from_millis(250));
        let calls = groups.into_iter().map(|(route, chunk)| async move {
            let mut inv = self.flush.prepare_invoke();
            for e in &chunk {
                inv.key(self.layout.state_key(&e.rule, &e.key))
                    .arg(e.rule.window_ms())
                    .arg(e.target)
                    .arg(e.units)
                    .arg(e.key.as_str());
            }
            let call = async {
                let mut conn = self.shards.conn(route.shard).await?;
                inv.invoke_async::<Vec<u64>>(&mut conn).await.map_err(classify)
            };
            let sent_ms = floodgate_core::store::Clock::System.now_ms();
            metrics::flush_batch(chunk.len());
            let reply = match tokio::time::timeout(timeout, call).await {
                Err(_) => Err(StoreError::Timeout(timeout)),
                Ok(Err(e)) => Err(e),
                Ok(Ok(v)) if v.len() != 1 + 3 * chunk.len() => Err(StoreError::Script(format!(
                    "flush returned {} values for {} entries",
                    v.len(),
                    chunk.len()
                ))),
                Ok(Ok(v)) => Ok(FlushReply {
                    now_ms: v[0],
                    sent_ms,
                    answered_ms: floodgate_core::store::Clock::System.now_ms(),
                    learned: v[1..]
                        .chunks_exact(3)
                        .map(|x| Learned {
                            window: x[0],
                            cur: x[1],
                            prev: x[2],
                        })
                        .collect(),
                }),
            };
            metrics::redis_call(route.shard, reply.is_ok());
            (chunk, reply)
        });
        // A few calls at a time: a flush of many keys must not queue hundreds of calls (and their
        // buffers) at once ahead of the checks.
        futures::stream::StreamExt::collect(futures::stream::StreamExt::buffer_unordered(
            futures::stream::iter(calls),
            FLUSH_CONCURRENCY,
        ))
        .await
    }

    /// The breaker's probe for one shard: loads the check script (a restarted Redis has an empty
    /// cache; a slow reconnection gets 250 ms), then runs one check-shaped call under the checks' own
    /// timeout, so the breaker closes only when checks would succeed too.
    pub async fn probe(&self, shard: usize) -> Result<(), StoreError> {
        let mut conn = self.shards.conn(shard).await?;
        tokio::time::timeout(
            self.timeout.max(Duration::from_millis(250)),
            self.script.prepare_invoke().load_async(&mut conn),
        )
        .await
        .map_err(|_| StoreError::Timeout(self.timeout))?
        .map_err(classify)?;
        // The call goes to this shard's connection (a cluster routes it by the key's slot).
        let cmd = call::probe_cmd(self.script.get_hash());
        self.invoke(&cmd, shard, 1, self.timeout).await.map(|_| ())
    }

    /// Loads the check and flush scripts (SCRIPT LOAD) on every shard, so that a burst of checks after a start or
    /// a Redis restart finds it cached instead of each paying NOSCRIPT and a reload within its timeout.
    pub async fn preload(&self) -> Result<(), StoreError> {
        for shard in 0..self.shards.len() {
            let mut conn = self.shards.conn(shard).await?;
            for script in [&self.script, &self.flush] {
                tokio::time::timeout(
                    self.timeout.max(Duration::from_millis(250)),
                    script.prepare_invoke().load_async(&mut conn),
                )
                .await
                .map_err(|_| StoreError::Timeout(self.timeout))?
                .map_err(classify)?;
            }
        }
        Ok(())
    }

    /// Writes this agent's heartbeat (or removes it when `leaving`) and returns the live-agent count.
    /// The set lives on the shard that holds bucket 0.
    pub async fn heartbeat(&self, id: &str, ttl: Duration, leaving: bool) -> Result<u64, StoreError> {
        let mut inv = self.heartbeat.prepare_invoke();
        inv.key(AGENTS_KEY)
            .arg(id)
            .arg(ttl.as_millis() as u64)
            .arg(if leaving { 1 } else { 0 });
        let mut conn = self.shards.conn(self.shards.shard_of_bucket(0)).await?;
        let n: u64 = tokio::time::timeout(
            self.timeout.max(Duration::from_millis(250)),
            inv.invoke_async(&mut conn),
        )
        .await
        .map_err(|_| StoreError::Timeout(self.timeout))?
        .map_err(classify)?;
        Ok(n)
    }

    /// PING every shard with the store timeout, for readiness.
    pub async fn ping(&self) -> Result<(), StoreError> {
        for shard in 0..self.shards.len() {
            let mut conn = self.shards.conn(shard).await?;
            tokio::time::timeout(
                self.timeout.max(Duration::from_millis(100)),
                redis::cmd("PING").query_async::<String>(&mut conn),
            )
            .await
            .map_err(|_| StoreError::Timeout(self.timeout))?
            .map_err(classify)?;
        }
        Ok(())
    }

    /// The check script's EVALSHA for `items`, as a redis-rs command.
    fn check_cmd(&self, items: &[CallItem<'_>]) -> Cmd {
        call::check_cmd(self.script.get_hash(), &self.layout, items)
    }

    /// Runs a check-script command on `shard` within `timeout`; a Redis that lost the script
    /// (NOSCRIPT: restarted, or flushed) gets it loaded and the command again.
    async fn invoke(
        &self,
        cmd: &Cmd,
        shard: usize,
        items: usize,
        timeout: Duration,
    ) -> Result<Vec<i64>, StoreError> {
        if let Some(pipes) = self.pipes() {
            // The node's own connection (it answers only with `items` × 5 integers, and counts the call).
            let pipe = &pipes[shard % pipes.len()];
            return ask(timeout, |reply| {
                let cmd = cmd.get_packed_command();
                pipe.tx
                    .send(node::Request::Raw {
                        cmd,
                        items,
                        timeout,
                        reply,
                    })
                    .is_ok()
            })
            .await;
        }
        let call = async {
            let mut conn = self.shards.conn(shard).await?;
            match cmd.query_async::<Vec<i64>>(&mut conn).await {
                Err(e) if e.kind() == ErrorKind::Server(ServerErrorKind::NoScript) => {
                    self.script.load_async(&mut conn).await.map_err(classify)?;
                    cmd.query_async::<Vec<i64>>(&mut conn).await.map_err(classify)
                }
                reply => reply.map_err(classify),
            }
        };
        let reply = tokio::time::timeout(timeout, call)
            .await
            .map_err(|_| StoreError::Timeout(timeout))
            .and_then(|r| r)
            .and_then(|reply| {
                if reply.len() == items * 5 {
                    Ok(reply)
                } else {
                    Err(StoreError::Script(format!(
                        "script returned {} values for {items} items",
                        reply.len()
                    )))
                }
            });
        metrics::redis_call(shard, reply.is_ok());
        reply
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

    fn preload(&self) -> BoxFuture<'_, Result<(), StoreError>> {
        Box::pin(RedisStore::preload(self))
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
