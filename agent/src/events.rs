//! Rejection events `{key, ruleId, ts, agent, version, mode}` to a Redis Stream, off the request
//! path: a check that the limiter rejects (not a repeat answered from the rejection cache), and a
//! would-be rejection of a rule in log mode (`mode` `log`: its dry run), puts its event in a bounded
//! queue (`try_send`, never waiting); a writer task takes what
//! has queued, up to [`BATCH`] at a time, and writes it as one pipeline of `XADD <stream> MAXLEN ~ N`.
//! A full queue drops the event and counts it; so does a write that fails (the events are not worth
//! holding the agent's memory for while Redis is away).

use std::sync::atomic::{AtomicU64, Ordering};
use std::time::Duration;

use tokio::sync::{mpsc, watch};

use crate::store::shards::Shards;

/// Events per pipeline.
pub const BATCH: usize = 512;

/// One rejection.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Event {
    /// The client key that was rejected.
    pub key: String,
    /// The rule that rejected it.
    pub rule: String,
    /// When (Unix ms).
    pub ts_ms: u64,
    /// The rule's version.
    pub version: u64,
    /// A log-mode rule's would-be rejection (the request passed).
    pub dry_run: bool,
}

/// The request path's side: a bounded queue and its counters.
pub struct Events {
    tx: mpsc::Sender<Event>,
    /// Events dropped because the queue was full.
    pub dropped: AtomicU64,
    /// Events queued.
    pub queued: AtomicU64,
}

impl std::fmt::Debug for Events {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Events")
            .field("queued", &self.queued)
            .field("dropped", &self.dropped)
            .finish()
    }
}

impl Events {
    /// A queue of `capacity` events and its receiving end (for [`write_loop`]).
    pub fn new(capacity: usize) -> (Events, mpsc::Receiver<Event>) {
        let (tx, rx) = mpsc::channel(capacity.max(1));
        (
            Events {
                tx,
                dropped: AtomicU64::new(0),
                queued: AtomicU64::new(0),
            },
            rx,
        )
    }

    /// Queues an event, or drops and counts it when the queue is full (or the writer is gone).
    pub fn emit(&self, event: Event) {
        match self.tx.try_send(event) {
            Ok(()) => {
                self.queued.fetch_add(1, Ordering::Relaxed);
            }
            Err(_) => {
                self.dropped.fetch_add(1, Ordering::Relaxed);
                crate::metrics::events(0, 1);
            }
        }
    }
}

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
            _ = crate::server::stopped(&mut stop) => {
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
                        crate::metrics::events(n, 0);
                    } else {
                        crate::metrics::events(0, n);
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
            Ok(()) => crate::metrics::events(batch.len() as u64, 0),
            Err(e) => {
                failures += 1;
                crate::metrics::events(0, batch.len() as u64);
                if failures == 1 || failures % 100 == 0 {
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

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_full_queue_drops_and_counts_without_waiting() {
        let (events, mut rx) = Events::new(2);
        for i in 0..5 {
            events.emit(Event {
                key: format!("user:{i}"),
                rule: "r".into(),
                ts_ms: i,
                version: 1,
                dry_run: false,
            });
        }
        assert_eq!(events.queued.load(Ordering::Relaxed), 2);
        assert_eq!(events.dropped.load(Ordering::Relaxed), 3);
        assert_eq!(rx.try_recv().unwrap().key, "user:0");
    }
}
