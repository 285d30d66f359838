//! The rejection events' writer: takes what has queued (`floodgate_core::events`), up to [`BATCH`]
//! at a time, and writes it as one pipeline of `XADD <stream> MAXLEN ~ N`. A write that fails drops
//! its events and counts them (they are not worth holding the agent's memory for while Redis is away).

use std::time::Duration;

use floodgate_core::events::Event;
use floodgate_core::metrics;
use floodgate_core::tasks::stopped;
use tokio::sync::{mpsc, watch};

use crate::shards::Shards;

/// Events per pipeline.
pub const BATCH: usize = 512;

/// Where the writer writes.
#[derive(Debug, Clone)]
pub struct StreamConfig {
    /// The stream's key.
    pub stream: String,
    /// `MAXLEN ~` of every XADD: Redis trims the stream to about this many entries.
    pub maxlen: u64,
    /// The agent's id, in every event.
    pub agent: String,
}

/// Writes queued events until `stop`, then what is left in the queue (the agent turns `stop` on only
/// after the last check was answered); what cannot be written then is counted as dropped. `shards`
/// is a connection of the writer's own (a pipeline of events must not queue ahead of checks on
/// theirs); the stream lives on the shard of bucket 0 (on a Cluster, wherever its key's slot is).
pub async fn write_loop(
    shards: Shards,
    mut rx: mpsc::Receiver<Event>,
    config: StreamConfig,
    mut stop: watch::Receiver<bool>,
) {
    let mut batch = Vec::with_capacity(BATCH);
    let mut failures = 0u64;
    loop {
        let got = tokio::select! {
            n = rx.recv_many(&mut batch, BATCH) => n,
            _ = stopped(&mut stop) => {
                // Stopping: every check is answered, so the queue holds all there will be. Write it
                // out; what a failed write loses is counted.
                rx.close();
                loop {
                    batch.clear();
                    if rx.recv_many(&mut batch, BATCH).await == 0 {
                        return;
                    }
                    let ok = match shards.conn(shards.shard_of_bucket(0)).await {
                        Ok(mut conn) => write(&mut conn, &batch, &config).await.is_ok(),
                        Err(_) => false,
                    };
                    let n = batch.len() as u64;
                    if ok {
                        metrics::events(n, 0);
                    } else {
                        metrics::events(0, n);
                    }
                }
            }
        };
        if got == 0 {
            return;
        }
        let written = match shards.conn(shards.shard_of_bucket(0)).await {
            Ok(mut conn) => write(&mut conn, &batch, &config).await.map_err(|e| e.to_string()),
            Err(e) => Err(e.to_string()),
        };
        match written {
            Ok(()) => metrics::events(batch.len() as u64, 0),
            Err(e) => {
                failures += 1;
                metrics::events(0, batch.len() as u64);
                if failures == 1 || failures.is_multiple_of(100) {
                    tracing::warn!(error = %e, events = batch.len(), failures, "could not write rejection events; dropped");
                }
            }
        }
        batch.clear();
    }
}

async fn write<C>(conn: &mut C, batch: &[Event], config: &StreamConfig) -> redis::RedisResult<()>
where
    C: redis::aio::ConnectionLike + Send,
{
    let mut pipe = redis::pipe();
    for e in batch {
        pipe.cmd("XADD")
            .arg(&config.stream)
            .arg("MAXLEN")
            .arg("~")
            .arg(config.maxlen)
            .arg("*")
            .arg("key")
            .arg(&e.key)
            .arg("ruleId")
            .arg(&e.rule)
            .arg("ts")
            .arg(e.ts_ms)
            .arg("agent")
            .arg(&config.agent)
            .arg("version")
            .arg(e.version)
            .arg("mode")
            .arg(if e.dry_run { "log" } else { "enforce" })
            .ignore();
    }
    // A slow Redis must not pile up writes: the queue fills and drops instead.
    match tokio::time::timeout(Duration::from_secs(2), pipe.query_async::<()>(conn)).await {
        Ok(r) => r,
        Err(_) => Err(redis::RedisError::from((
            redis::ErrorKind::Io,
            "XADD pipeline timed out after 2 s",
        ))),
    }
}
