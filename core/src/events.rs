//! Rejection events `{key, ruleId, ts, agent, version, mode}`, off the request path: a check that
//! the limiter rejects (not a repeat answered from the rejection cache), and a would-be rejection of
//! a rule in log mode (`mode` `log`: its dry run), puts its event in a bounded queue (`try_send`,
//! never waiting). A full queue drops the event and counts it. The writer that empties the queue
//! into a Redis Stream is `floodgate-redis`'s (`events::write_loop`).

use std::sync::atomic::{AtomicU64, Ordering};
use tokio::sync::mpsc;

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
    /// A queue of `capacity` events and its receiving end (for the writer).
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
