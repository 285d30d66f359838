//! Sync checks that arrive together for one call group go to Redis as one script call: the script's
//! fixed cost (~4 µs of Lua entry and `TIME` per call) is paid once per call instead of once per
//! check. A check never waits for a batch to fill: a worker per call group sends what is queued as
//! soon as fewer than [`MAX_IN_FLIGHT`] of its calls are in flight, so a lone check goes at once and
//! checks only pile up (and share a call) while Redis is busy anyway.
//!
//! This worker serves a Cluster or a Sentinel-named master, whose calls go through redis-rs;
//! independent nodes get the same coalescing from their own connection's task (`node`).

use std::sync::Weak;

use futures::stream::{FuturesUnordered, StreamExt};
use tokio::sync::{mpsc, oneshot};

use floodgate_core::algo::Outcome;
use floodgate_core::store::{Planned, StoreError};

use super::RedisStore;

/// Script calls in flight per call group: one being run by Redis while the next is on the wire.
pub const MAX_IN_FLIGHT: usize = 2;

/// One check waiting for its call.
pub struct Job {
    /// Its items (one call group).
    pub items: Vec<Planned>,
    /// Where its outcomes go.
    pub reply: oneshot::Sender<Result<Vec<Outcome>, StoreError>>,
    /// When its budget ends (its frame's read plus the store timeout).
    pub deadline: std::time::Instant,
    /// Its check's span, when traced (`floodgate_core::call_trace`).
    pub span: Option<floodgate_core::call_trace::SpanName>,
    /// Its number in its node's queue (`node::Pipe::send_check`); 0 where no node task numbers it.
    pub seq: u64,
}

/// Starts the worker of one call group; it ends when the store is dropped.
pub fn spawn(store: Weak<RedisStore>, shard: usize, max_items: usize) -> mpsc::UnboundedSender<Job> {
    let (tx, rx) = mpsc::unbounded_channel();
    tokio::spawn(worker(store, shard, max_items.max(1), rx));
    tx
}

async fn worker(
    store: Weak<RedisStore>,
    shard: usize,
    max_items: usize,
    mut rx: mpsc::UnboundedReceiver<Job>,
) {
    let mut in_flight = FuturesUnordered::new();
    loop {
        tokio::select! {
            job = rx.recv(), if in_flight.len() < MAX_IN_FLIGHT => {
                let Some(job) = job else { break };
                let mut items = job.items.len();
                let mut jobs = vec![job];
                while items < max_items {
                    match rx.try_recv() {
                        Ok(job) => {
                            items += job.items.len();
                            jobs.push(job);
                        }
                        Err(_) => break,
                    }
                }
                let Some(store) = store.upgrade() else { break };
                in_flight.push(async move { store.run_coalesced(shard, jobs).await });
            }
            Some(()) = in_flight.next(), if !in_flight.is_empty() => {}
        }
    }
}
