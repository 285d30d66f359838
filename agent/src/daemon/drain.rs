//! Draining the agent after shutdown: a numbered sequence of named steps, each bounded, so that every
//! check in flight is answered, every count batched rules admitted reaches Redis, and the process
//! exits within seconds whatever its peers do.
//!
//! 1. `socket` (its own 2 s deadline): the socket's server stops accepting, answers the checks in
//!    flight and closes its connections.
//! 2. `listeners` (2 s, [`LISTENERS`]): the TCP and gRPC listeners, which drained beside the socket;
//!    what is still open then (a peer that never lets its HTTP/2 connection go) is stopped.
//! 3. `socket files`: the frames and gRPC socket files are removed.
//! 4. `last flush` (2 s, [`FLUSH`], then the flush itself): the flush loop ends, and what batched
//!    rules admitted since its last flush goes to Redis.
//! 5. `guard` (2 s, [`GUARD`]): the guard leaves the heartbeat set and writes back what the
//!    fallback admitted.
//! 6. `events` (5 s, [`EVENTS`]): the rejection events' writer writes out its queue (every check is
//!    answered by now, so it holds every event).
//! 7. `traces` (6 s, [`TRACES`]): the trace exporter sends the spans it holds (with `--otlp-endpoint`).
//! 8. `ledger` (2 s, [`LEDGER`]): the decision ledger (with `--ledger`) writes what it holds and its
//!    closing line.

use std::future::Future;
use std::path::PathBuf;
use std::sync::Arc;
use std::time::{Duration, Instant};

use floodgate_core::engine::Engine;
use floodgate_core::shared_store::SharedStore;
use tokio::sync::watch;
use tokio::task::JoinHandle;

/// Step 2's bound: the other listeners after the socket's.
pub const LISTENERS: Duration = Duration::from_secs(2);
/// Step 4's bound on the flush loop's end (the last flush is bounded by the store's own timeouts).
pub const FLUSH: Duration = Duration::from_secs(2);
/// Step 5's bound.
pub const GUARD: Duration = Duration::from_secs(2);
/// Step 6's bound: each of the writer's writes has a 2 s timeout, and the queue is bounded.
pub const EVENTS: Duration = Duration::from_secs(5);
/// Step 7's bound: one POST of the exporter (5 s timeout) and a little.
pub const TRACES: Duration = Duration::from_secs(6);
/// Longest the decision ledger may take to write what it holds.
pub const LEDGER: Duration = Duration::from_secs(2);

/// The running agent, as the drain needs it: the tasks to wait for, in the order they stop.
pub(crate) struct Running {
    pub(super) engine: Arc<Engine>,
    pub(super) socket_server: JoinHandle<()>,
    pub(super) listeners: Vec<JoinHandle<()>>,
    pub(super) socket_files: Vec<PathBuf>,
    /// The flush loop, with its store (Redis only).
    pub(super) flusher: Option<(JoinHandle<()>, Arc<dyn SharedStore>)>,
    pub(super) guard: Option<JoinHandle<()>>,
    /// The events writer and its stop signal.
    pub(super) events: Option<(watch::Sender<bool>, JoinHandle<()>)>,
    /// The trace exporter and its stop signal.
    pub(super) traces: Option<(watch::Sender<bool>, JoinHandle<()>)>,
}

impl Running {
    /// Runs the steps once shutdown has begun; returns when the agent may exit.
    pub(crate) async fn drain(self) {
        step(1, "socket", None, self.socket_server).await;
        let aborts: Vec<_> = self.listeners.iter().map(JoinHandle::abort_handle).collect();
        if !step(
            2,
            "listeners",
            Some(LISTENERS),
            futures::future::join_all(self.listeners),
        )
        .await
        {
            tracing::warn!("listeners still open {LISTENERS:?} after shutdown; stopping them");
            aborts.iter().for_each(|a| a.abort());
        }
        step(3, "socket files", None, async {
            for path in &self.socket_files {
                let _ = std::fs::remove_file(path);
            }
        })
        .await;
        if let Some((task, store)) = self.flusher {
            let engine = self.engine.clone();
            step(4, "last flush", None, async move {
                let _ = tokio::time::timeout(FLUSH, task).await;
                let sent = engine.flush_batched(store.as_ref(), true).await;
                tracing::info!(entries = sent, "flushed batched counts on the way out");
            })
            .await;
        }
        if let Some(task) = self.guard {
            step(5, "guard", Some(GUARD), task).await;
        }
        if let Some((stop, task)) = self.events {
            let _ = stop.send(true);
            step(6, "events", Some(EVENTS), task).await;
        }
        if let Some((stop, task)) = self.traces {
            let _ = stop.send(true);
            step(7, "traces", Some(TRACES), task).await;
        }
        if let Some(ledger) = self.engine.ledger().cloned() {
            step(8, "ledger", None, async move {
                let _ = tokio::task::spawn_blocking(move || ledger.close(LEDGER)).await;
            })
            .await;
        }
        tracing::info!("floodgate agent stopped");
    }
}

/// Runs step `n`, within `limit` if it has one; false when the limit passed first.
async fn step<F: Future>(n: u8, name: &str, limit: Option<Duration>, f: F) -> bool {
    let started = Instant::now();
    let done = match limit {
        Some(limit) => tokio::time::timeout(limit, f).await.is_ok(),
        None => {
            f.await;
            true
        }
    };
    tracing::debug!(
        step = n,
        name,
        took_ms = started.elapsed().as_millis() as u64,
        done,
        "drain"
    );
    done
}
