//! A node's task: takes checks off its queue, coalesces them into one check-script call while fewer
//! than [`MAX_IN_FLIGHT`] calls are live, writes it, reads the replies (each answers its call in
//! `replies.rs`); connects again with a backoff, and drops a connection that stops answering.

use std::collections::VecDeque;
use std::pin::Pin;
use std::sync::atomic::Ordering;
use std::sync::Arc;
use std::time::{Duration, Instant};

use tokio::io::AsyncReadExt;
use tokio::sync::mpsc;

use floodgate_core::metrics;
use floodgate_core::store::StoreError;

use super::calls::{fail, write, Pending, Waiter};
use super::connect::{Io, CONNECT_TIMEOUT};
use super::{NodeTask, PipeState, Request};
use crate::store::call;
use crate::store::coalesce::{Job, MAX_IN_FLIGHT};
use crate::store::resp;

/// Calls written and not yet answered (their callers gone or not) that close the connection: Redis
/// has not answered for that long, and the replies still owed are not worth waiting for.
pub const MAX_PENDING: usize = 64;

/// How long past its deadline an unanswered call makes the connection count as dead.
pub const STALE_AFTER: Duration = Duration::from_secs(1);

const MIN_BACKOFF: Duration = Duration::from_millis(10);
const MAX_BACKOFF: Duration = Duration::from_millis(200);

/// A node's task: its connection, the calls written on it and not yet answered, and the requests
/// waiting for one of the [`MAX_IN_FLIGHT`] slots.
pub(super) struct Node {
    pub(super) task: NodeTask,
    /// `SCRIPT LOAD` of the check script, as RESP.
    pub(super) load: Vec<u8>,
    conn: Option<Box<dyn Io>>,
    pub(super) rbuf: Vec<u8>,
    pub(super) rpos: usize,
    pub(super) pending: VecDeque<Pending>,
    waiting: VecDeque<Request>,
    /// Command buffers of answered calls, reused.
    pub(super) spare: Vec<Vec<u8>>,
    retry_at: Option<Instant>,
    backoff: Duration,
    last_error: StoreError,
    /// The timer of [`Node::slot_frees`], and the instant it is set to.
    timer: Option<Pin<Box<tokio::time::Sleep>>>,
    timer_at: Option<Instant>,
    /// What the store reads before queueing a check
    /// ([`Pipe::send_check`](super::Pipe::send_check)): while it says the node is overloaded the
    /// store sheds new checks, so the queue drains and the checks it does take are answered within
    /// their budget; past capacity, a share of checks is answered by its fail mode at once rather
    /// than every check late.
    pub(super) state: Arc<PipeState>,
}

/// Waits for the timer (never ready without one).
async fn expiry(timer: &mut Option<Pin<Box<tokio::time::Sleep>>>) {
    match timer {
        Some(timer) => timer.as_mut().await,
        None => std::future::pending().await,
    }
}

/// Reads more of the connection into `buf` (never ready without one).
async fn read_more(conn: &mut Option<Box<dyn Io>>, buf: &mut Vec<u8>) -> std::io::Result<usize> {
    match conn {
        Some(io) => {
            buf.reserve(4096);
            io.read_buf(buf).await
        }
        None => std::future::pending().await,
    }
}

impl Node {
    /// The task of `task`'s node, not yet connected, publishing its queue through `state`.
    pub(super) fn new(task: NodeTask, state: Arc<PipeState>) -> Node {
        let mut load = Vec::new();
        resp::command(&mut load, &[b"SCRIPT", b"LOAD", task.script.as_bytes()]);
        Node {
            task,
            load,
            conn: None,
            rbuf: Vec::with_capacity(4096),
            rpos: 0,
            pending: VecDeque::new(),
            waiting: VecDeque::new(),
            spare: Vec::new(),
            retry_at: None,
            backoff: MIN_BACKOFF,
            last_error: StoreError::Connection("not connected".into()),
            timer: None,
            timer_at: None,
            state,
        }
    }

    /// Serves requests until the store (every sender) is dropped.
    pub(super) async fn run(mut self, mut rx: mpsc::UnboundedReceiver<Request>) {
        loop {
            // Calls wait and both slots are held: the first deadline to pass frees one. One timer,
            // moved only when that deadline changes (once per call, not per check).
            let frees = self.slot_frees();
            if let Some(at) = frees {
                match &mut self.timer {
                    Some(_) if self.timer_at == Some(at) => {}
                    Some(timer) => timer.as_mut().reset(at.into()),
                    None => self.timer = Some(Box::pin(tokio::time::sleep_until(at.into()))),
                }
                self.timer_at = Some(at);
            }
            tokio::select! {
                biased;
                // Read whenever connected: a Redis that closes an idle connection is noticed at once,
                // not by the next check's call.
                read = read_more(&mut self.conn, &mut self.rbuf), if self.conn.is_some() => match read {
                    Ok(0) => self.drop_conn(StoreError::Connection("Redis closed the connection".into())),
                    Ok(_) => self.on_data().await,
                    Err(e) => self.drop_conn(StoreError::Connection(e.to_string())),
                },
                _ = expiry(&mut self.timer), if frees.is_some() => {}
                request = rx.recv() => {
                    let Some(request) = request else { break };
                    self.take(request);
                    while let Ok(request) = rx.try_recv() {
                        self.take(request);
                    }
                }
            }
            self.pump().await;
            self.state.waiting.store(self.waiting.len(), Ordering::Relaxed);
        }
    }

    /// Queues a request from the channel.
    fn take(&mut self, request: Request) {
        if matches!(request, Request::Check(_)) {
            self.state.incoming.fetch_sub(1, Ordering::Relaxed);
        }
        self.waiting.push_back(request);
    }

    /// When the next in-flight call passes its deadline (and stops holding a slot).
    fn slot_frees(&self) -> Option<Instant> {
        if self.waiting.is_empty() {
            return None;
        }
        self.live(Instant::now()).min()
    }

    /// The deadlines of the calls whose callers still wait for them.
    fn live(&self, now: Instant) -> impl Iterator<Item = Instant> + '_ {
        self.pending
            .iter()
            .filter(|p| !matches!(p.waiter, Waiter::Load))
            .map(|p| p.deadline)
            .filter(move |&d| d > now)
    }

    /// Sends what waits, while fewer than [`MAX_IN_FLIGHT`] calls are live.
    async fn pump(&mut self) {
        loop {
            while self.waiting.front().is_some_and(Request::gone) {
                self.waiting.pop_front();
            }
            if self.waiting.is_empty() {
                if self.state.overloaded_until_us.load(Ordering::Relaxed) != 0 {
                    self.state.set_overloaded(false, self.task.timeout);
                }
                return;
            }
            let now = Instant::now();
            if self.live(now).count() >= MAX_IN_FLIGHT {
                return;
            }
            if self.pending.len() >= MAX_PENDING
                || self
                    .pending
                    .front()
                    .is_some_and(|p| now > p.deadline + STALE_AFTER)
            {
                // Redis has not answered for that long (a host gone without a reset, a dropped
                // flow): the replies still owed are not worth waiting for; connect again.
                self.drop_conn(StoreError::Timeout(self.task.timeout));
            }
            if self.conn.is_none() {
                if let Err(e) = self.connect(now).await {
                    for r in self.waiting.drain(..) {
                        r.fail(&e);
                    }
                    return;
                }
            }
            let pending = match self.waiting.pop_front() {
                Some(Request::Raw {
                    cmd,
                    items,
                    timeout,
                    reply,
                }) => Pending {
                    waiter: Waiter::Raw(reply),
                    items,
                    deadline: now + timeout,
                    cmd,
                    resent: false,
                    traced: None,
                },
                Some(Request::Check(first)) => match self.coalesce(first, now) {
                    Some(pending) => pending,
                    None => continue,
                },
                None => return,
            };
            self.send(pending).await;
        }
    }

    /// The check first in the queue and the checks queued behind it, up to `max_items` items, as
    /// one script call; `None` when the first's budget is gone (it is shed, not sent).
    fn coalesce(&mut self, first: Job, now: Instant) -> Option<Pending> {
        // Three quarters of its budget gone before it is even sent: the store sheds new
        // checks for half a store timeout, or until the queue drains. One whose budget is
        // gone is shed here (and new checks for a whole timeout): its caller's timer may
        // not have run yet on a saturated agent, and sending it would only delay the
        // checks behind it.
        let left = first.deadline.saturating_duration_since(now);
        if left.is_zero() {
            // Its caller's budget is gone: not sent.
            let _ = first.reply.send(Err(StoreError::Shed));
            self.state.set_overloaded(true, self.task.timeout);
            return None;
        }
        // Not `left` against the round trip: a Redis slower than the budget must still
        // be sent checks, whose timeouts open its breaker.
        if left < self.task.timeout / 4 {
            self.state.set_overloaded(true, self.task.timeout / 2);
        }
        let mut jobs = vec![first];
        let mut items = jobs[0].items.len();
        while items < self.task.max_items {
            match self.waiting.front() {
                Some(Request::Check(j)) if j.reply.is_closed() => {
                    self.waiting.pop_front();
                }
                Some(Request::Check(_)) => {
                    if let Some(Request::Check(j)) = self.waiting.pop_front() {
                        items += j.items.len();
                        jobs.push(j);
                    }
                }
                _ => break,
            }
        }
        // These leave the agent's queue for Redis: a timeout of theirs from now on
        // may be Redis's (`Queued::sent`).
        let last = jobs.iter().map(|j| j.seq).max().unwrap_or(0);
        self.state.taken.fetch_max(last, Ordering::Relaxed);
        let mut cmd = self.spare.pop().unwrap_or_default();
        cmd.clear();
        let call_items = call::check_items(jobs.iter().map(|j| j.items.as_slice()));
        call::write_check(&mut cmd, &self.task.script_hash, &self.task.layout, &call_items);
        drop(call_items);
        // The traced checks it serves, when traces are on.
        let traced = if floodgate_core::call_trace::enabled() {
            let served: Vec<_> = jobs.iter().filter_map(|j| j.span).collect();
            (!served.is_empty()).then(|| Box::new((served, jobs.len(), now)))
        } else {
            None
        };
        let waiter = Waiter::Checks(jobs.into_iter().map(|j| (j.items.len(), j.reply)).collect());
        Some(Pending {
            waiter,
            items,
            deadline: now + self.task.timeout,
            cmd,
            resent: false,
            traced,
        })
    }

    /// Writes a call and queues it for its reply; a failed write fails it and the connection.
    pub(super) async fn send(&mut self, p: Pending) {
        let written = match &mut self.conn {
            Some(io) => write(io, &p.cmd, self.task.timeout).await,
            None => Err(StoreError::Connection("the connection to Redis closed".into())),
        };
        self.pending.push_back(p);
        if let Err(e) = written {
            self.drop_conn(e);
        }
    }

    async fn connect(&mut self, now: Instant) -> Result<(), StoreError> {
        if self.retry_at.is_some_and(|at| now < at) {
            return Err(self.last_error.clone());
        }
        let made = match tokio::time::timeout(CONNECT_TIMEOUT, self.task.addr.connect()).await {
            Ok(made) => made,
            Err(_) => Err(StoreError::Timeout(CONNECT_TIMEOUT)),
        };
        match made {
            Ok(io) => {
                self.conn = Some(io);
                self.retry_at = None;
                self.backoff = MIN_BACKOFF;
                Ok(())
            }
            Err(e) => {
                self.retry_at = Some(Instant::now() + self.backoff);
                self.backoff = (self.backoff * 2).min(MAX_BACKOFF);
                self.last_error = e.clone();
                Err(e)
            }
        }
    }

    /// Drops the connection; every call on it fails with `e`.
    pub(super) fn drop_conn(&mut self, e: StoreError) {
        self.conn = None;
        self.rbuf.clear();
        self.rpos = 0;
        for p in self.pending.drain(..) {
            if !matches!(p.waiter, Waiter::Load) {
                metrics::redis_call(self.task.shard, false);
            }
            fail(p.waiter, &e);
        }
    }
}
