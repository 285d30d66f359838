//! The store's work off the request path: adjustments (write-back, take-back), flushes of batched
//! counts, the breaker's probe, script preloads, heartbeats and readiness pings, each with a longer
//! timeout than a check gets.

use std::time::Duration;

use floodgate_core::batch::{FlushEntry, Learned};
use floodgate_core::guard::LedgerEntry;
use floodgate_core::metrics;
use floodgate_core::shared_store::{Adjust, Adjusted, FlushReply, Flushed, Route};
use floodgate_core::store::StoreError;

use super::call::{self, CallItem};
use super::errors::classify;
use super::scripts::AGENTS_KEY;
use super::RedisStore;

/// Entries one flush script call carries: ~1 µs of Redis time each, so a call stays well under a
/// millisecond and never holds up the checks queued behind it.
pub const FLUSH_CHUNK: usize = 256;

/// Flush calls in flight at once.
pub const FLUSH_CONCURRENCY: usize = 4;

/// Entries one adjustment script call carries (keeps each call short: Redis runs one script at a time).
pub const ADJUST_CHUNK: usize = 64;

impl RedisStore {
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
                            StoreError::Timeout(_) => {
                                done.unknown += units;
                                done.uncertain.extend(chunk.iter().cloned());
                            }
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
            let mut buf = String::with_capacity(64);
            for e in &chunk {
                // A batched rule is a sliding window: its two window hashes.
                self.layout.script_keys(&mut buf, &e.rule, &e.key, 0, |k| {
                    inv.key(k);
                });
                inv.arg(e.rule.window_ms())
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

    /// Loads the check and flush scripts (SCRIPT LOAD) on every shard, so that a burst of checks after
    /// a start or a Redis restart finds them cached instead of each paying NOSCRIPT and a reload
    /// within its timeout. Each load waits at most `patience` (at least the store timeout).
    pub async fn preload(&self, patience: Duration) -> Result<(), StoreError> {
        let patience = patience.max(self.timeout);
        for shard in 0..self.shards.len() {
            let mut conn = self.shards.conn(shard).await?;
            for script in [&self.script, &self.flush] {
                tokio::time::timeout(patience, script.prepare_invoke().load_async(&mut conn))
                    .await
                    .map_err(|_| StoreError::Timeout(self.timeout))?
                    .map_err(classify)?;
            }
        }
        Ok(())
    }

    /// [`preload`](Self::preload), and the check path's own connection to every shard opened (one
    /// call of the breaker's probe), each step waiting at most `patience`: what a start does before
    /// it serves, so that its first checks do not pay a connect and a load within their timeout (a
    /// cold agent's first checks were answered by its fallback: issue 33).
    pub async fn warm_up(&self, patience: Duration) -> Result<(), StoreError> {
        self.preload(patience).await?;
        let patience = patience.max(self.timeout);
        for shard in 0..self.shards.len() {
            let cmd = call::probe_cmd(self.script.get_hash());
            self.invoke(&cmd, shard, 1, patience).await?;
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
}
