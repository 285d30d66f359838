//! The check path's own connection to one Redis node. One task per node owns the socket: it takes
//! checks off its queue, coalesces them into one check-script call (as `coalesce` does for a Cluster
//! or a Sentinel-named master), writes the EVALSHA as RESP straight from the checks, reads the
//! replies in order and answers each check from its five integers per item. There is no second task
//! (redis-rs's multiplexer), no packing of a command twice and no general reply parser between a
//! check and its answer (BENCHMARKS.md, "The check path's own connection per node").
//!
//! What it owns, and how it behaves:
//! - connecting (TCP, TLS for `rediss://` with the `--redis-ca` roots or the system's, a Unix socket),
//!   AUTH (without the user name for a Redis 5), SELECT and a PING, within
//!   [`CONNECT_TIMEOUT`](connect::CONNECT_TIMEOUT); after a failed connect, checks fail at once (the
//!   error is the connect's) until a backoff of 10 ms, doubling to 200 ms, has passed;
//! - at most [`MAX_IN_FLIGHT`] calls whose callers still wait: a call past its deadline (its caller
//!   has had its timeout) stops counting, so a slow Redis does not hold new calls back longer than
//!   the store timeout; [`MAX_PENDING`](task::MAX_PENDING) unanswered calls, or one unanswered
//!   [`STALE_AFTER`](task::STALE_AFTER) past its deadline, close the connection (a host gone without
//!   a reset is not waited for);
//! - NOSCRIPT (a restarted or flushed Redis): `SCRIPT LOAD` and the same call again, once;
//! - a reply it cannot read, one that nobody waits for, a failed write or a closed socket: the
//!   connection is dropped and every call on it fails with a connection error (the breaker and the
//!   rule's fail mode decide), and the next call connects again.
//!
//! Flushes, heartbeats, pings and script preloads are not on the request path and still go through
//! redis-rs's connection manager (`shards`), as everything does for a Cluster or Sentinel.
//!
//! Here: what the store sees of a node's task (the requests it takes, its shedding estimate, `spawn`);
//! - `connect.rs`: where a node is, from its URL, and the connect and sign-in;
//! - `task.rs`: the task's loop: coalescing, writing and reading, and the connection's failures
//!   and backoff;
//! - `replies.rs`: the replies read, each answering its call (NOSCRIPT: the script loaded, the call
//!   sent again).

mod calls;
mod connect;
mod replies;
mod task;

use std::sync::atomic::{AtomicU64, AtomicUsize, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use tokio::sync::{mpsc, oneshot};

use floodgate_core::store::{Layout, StoreError};

use super::coalesce::{Job, MAX_IN_FLIGHT};

pub use connect::NodeAddr;

/// What a node's task is asked to do.
pub enum Request {
    /// A check: coalesced with the checks queued with it into one script call.
    Check(Job),
    /// A ready command of the check script (adjustments, the breaker's probe) and where its reply
    /// goes: `items` × 5 integers.
    Raw {
        /// The command, as RESP.
        cmd: Vec<u8>,
        /// Items it carries.
        items: usize,
        /// How long its caller waits.
        timeout: Duration,
        /// Where the reply goes.
        reply: oneshot::Sender<Result<Vec<i64>, StoreError>>,
    },
}

impl Request {
    fn gone(&self) -> bool {
        match self {
            Request::Check(j) => j.reply.is_closed(),
            Request::Raw { reply, .. } => reply.is_closed(),
        }
    }

    fn fail(self, e: &StoreError) {
        match self {
            Request::Check(j) => {
                let _ = j.reply.send(Err(e.clone()));
            }
            Request::Raw { reply, .. } => {
                let _ = reply.send(Err(e.clone()));
            }
        }
    }
}

/// What the node's task needs of the store.
pub struct NodeTask {
    /// The shard, for metrics.
    pub shard: usize,
    /// Where the node is.
    pub addr: Arc<NodeAddr>,
    /// The check script's hash and text.
    pub script_hash: String,
    /// The check script (for SCRIPT LOAD after NOSCRIPT).
    pub script: &'static str,
    /// The key layout.
    pub layout: Layout,
    /// The checks' timeout.
    pub timeout: Duration,
    /// Most items one call carries.
    pub max_items: usize,
}

/// A node's task, as the store holds it: where requests go, and what the store needs to know to
/// shed a check rather than queue it past its budget.
pub struct Pipe {
    /// The task's queue.
    pub tx: mpsc::UnboundedSender<Request>,
    state: Arc<PipeState>,
    max_items: usize,
}

/// What the node's task tells the checks about to queue (relaxed atomics: an estimate).
#[derive(Debug)]
struct PipeState {
    /// Where the µs below count from.
    epoch: Instant,
    /// Until when (µs from `epoch`) new checks are shed: set half a store timeout ahead when a call
    /// goes out with its oldest check three quarters through its budget (`left < timeout / 4`: the
    /// queue before Redis is nearly a check's whole budget long, or the agent that far behind), and a
    /// whole timeout ahead when a check's budget is gone before it is sent; 0 when the queue drains.
    /// On a 2.5 ms stall of the VM, tripping at half a budget and holding a whole timeout shed 0.1-3.6 %
    /// of checks at 0.5-1× capacity, these thresholds 0.0-0.3 % (BENCHMARKS.md, "Past capacity"). It
    /// lapses by itself, so a flag set just before Redis hung (no reply, no queue, nothing to clear
    /// it) lets a check through within one timeout, whose timeout then counts toward the breaker.
    overloaded_until_us: AtomicU64,
    /// Checks sent to the task and not yet in its queue, and the queue's length.
    incoming: AtomicUsize,
    waiting: AtomicUsize,
    /// Recent calls' time from send to reply, in µs (a moving average of 1/8 per call).
    rtt_us: AtomicU64,
    /// The number given to the last check handed to the task (the first is 1).
    numbered: AtomicU64,
    /// The highest number among the checks the task has taken off its queue into a call (or
    /// dropped, their callers gone): a check numbered above it has not been sent to Redis.
    taken: AtomicU64,
}

impl PipeState {
    fn new() -> Self {
        PipeState {
            epoch: Instant::now(),
            overloaded_until_us: AtomicU64::new(0),
            incoming: AtomicUsize::new(0),
            waiting: AtomicUsize::new(0),
            rtt_us: AtomicU64::new(0),
            numbered: AtomicU64::new(0),
            taken: AtomicU64::new(0),
        }
    }

    fn now_us(&self) -> u64 {
        self.epoch.elapsed().as_micros() as u64
    }

    fn overloaded(&self) -> bool {
        let until = self.overloaded_until_us.load(Ordering::Relaxed);
        until != 0 && self.now_us() < until
    }

    /// Sheds new checks for one `timeout` from now (`true`), or no longer (`false`).
    fn set_overloaded(&self, on: bool, timeout: Duration) {
        let until = if on {
            self.now_us() + timeout.as_micros() as u64
        } else {
            0
        };
        self.overloaded_until_us.store(until, Ordering::Relaxed);
    }
}

impl Pipe {
    /// Whether a check with `left` of its budget would be shed now (see [`send_check`](Self::send_check)).
    pub fn sheds(&self, left: Duration) -> bool {
        let s = &self.state;
        let ahead = s.incoming.load(Ordering::Relaxed) + s.waiting.load(Ordering::Relaxed);
        let calls_ahead = ahead / self.max_items;
        let rtt = Duration::from_micros(s.rtt_us.load(Ordering::Relaxed));
        let wait = rtt * (1 + calls_ahead / MAX_IN_FLIGHT) as u32;
        left.is_zero() || (ahead > 0 && s.overloaded()) || (calls_ahead > 0 && wait >= left)
    }

    /// Hands a check to the node's task, or sheds it (`Err` gives it back): when its budget is
    /// gone, when checks are queued and the task says it is past capacity, or when the calls
    /// queued ahead of it would take longer than the `left` of its budget (a queue of calls is
    /// estimated at one round trip per [`MAX_IN_FLIGHT`] calls, each carrying up to `max_items`
    /// items). With nothing queued a check is always sent, so a slow Redis still meets the timeouts
    /// that open its breaker, and the estimate keeps learning.
    pub fn send_check(&self, mut job: Job, left: Duration) -> Result<Queued, Job> {
        if self.sheds(left) {
            return Err(job);
        }
        job.seq = self.state.numbered.fetch_add(1, Ordering::Relaxed) + 1;
        let seq = job.seq;
        self.state.incoming.fetch_add(1, Ordering::Relaxed);
        self.tx.send(Request::Check(job)).map_err(|e| match e.0 {
            Request::Check(job) => job,
            Request::Raw { .. } => unreachable!("a check was sent"),
        })?;
        Ok(Queued {
            seq,
            state: self.state.clone(),
        })
    }
}

/// A check handed to a node's task: whether it has left the agent's queue for Redis yet.
pub struct Queued {
    seq: u64,
    state: Arc<PipeState>,
}

impl Queued {
    /// Whether the task has taken it into a call (or dropped it, its caller gone). One that has
    /// not never reached Redis: a timeout then is the agent's own queue, not Redis.
    pub fn sent(&self) -> bool {
        self.state.taken.load(Ordering::Relaxed) >= self.seq
    }
}

/// Starts the task of one node; it ends when the store (every sender) is dropped.
pub fn spawn(task: NodeTask) -> Pipe {
    let (tx, rx) = mpsc::unbounded_channel();
    let state = Arc::new(PipeState::new());
    let max_items = task.max_items.max(1);
    tokio::spawn(task::Node::new(task, state.clone()).run(rx));
    Pipe { tx, state, max_items }
}
