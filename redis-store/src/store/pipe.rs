//! The check path's own connection to one Redis node. One task per node owns the socket: it takes
//! checks off its queue, coalesces them into one check-script call (as `coalesce` does for a Cluster
//! or a Sentinel-named master), writes the EVALSHA as RESP straight from the checks, reads the
//! replies in order and answers each check from its five integers per item. There is no second task
//! (redis-rs's multiplexer), no packing of a command twice and no general reply parser between a
//! check and its answer (BENCHMARKS.md, issue 14).
//!
//! What it owns, and how it behaves:
//! - connecting (TCP, TLS for `rediss://` with the `--redis-ca` roots or the system's, a Unix socket),
//!   AUTH (without the user name for a Redis 5), SELECT and a PING, within [`CONNECT_TIMEOUT`]; after
//!   a failed connect, checks fail at once (the error is the connect's) until a backoff of 10 ms,
//!   doubling to 200 ms, has passed;
//! - at most [`MAX_IN_FLIGHT`] calls whose callers still wait: a call past its deadline (its caller
//!   has had its timeout) stops counting, so a slow Redis does not hold new calls back longer than
//!   the store timeout; [`MAX_PENDING`] unanswered calls, or one unanswered [`STALE_AFTER`] past its
//!   deadline, close the connection (a host gone without a reset is not waited for);
//! - NOSCRIPT (a restarted or flushed Redis): `SCRIPT LOAD` and the same call again, once;
//! - a reply it cannot read, one that nobody waits for, a failed write or a closed socket: the
//!   connection is dropped and every call on it fails with a connection error (the breaker and the
//!   rule's fail mode decide), and the next call connects again.
//!
//! Flushes, heartbeats, pings and script preloads are not on the request path and still go through
//! redis-rs's connection manager (`shards`), as everything does for a Cluster or Sentinel.

use std::collections::VecDeque;
use std::path::PathBuf;
use std::pin::{pin, Pin};
use std::sync::atomic::{AtomicU64, AtomicUsize, Ordering};
use std::sync::Arc;
use std::task::Poll;
use std::time::{Duration, Instant};

use rustls::pki_types::{CertificateDer, ServerName};
use tokio::io::{AsyncRead, AsyncReadExt, AsyncWrite, AsyncWriteExt};
use tokio::sync::{mpsc, oneshot};

use floodgate_core::algo::Outcome;
use floodgate_core::metrics;
use floodgate_core::store::{Layout, StoreError};

use super::call;
use super::coalesce::{Job, MAX_IN_FLIGHT};
use super::resp::{self, Reply, RespError, MAX_REPLY};
use crate::shards::RedisAccess;

/// Longest a connect (TCP, TLS, AUTH, SELECT) may take.
pub const CONNECT_TIMEOUT: Duration = Duration::from_millis(500);

/// Calls written and not yet answered (their callers gone or not) that close the connection: Redis
/// has not answered for that long, and the replies still owed are not worth waiting for.
pub const MAX_PENDING: usize = 64;

/// How long past its deadline an unanswered call makes the connection count as dead.
pub const STALE_AFTER: Duration = Duration::from_secs(1);

const MIN_BACKOFF: Duration = Duration::from_millis(10);
const MAX_BACKOFF: Duration = Duration::from_millis(200);

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

/// Where a node is and how to sign in, from its URL.
pub struct NodeAddr {
    target: Target,
    tls: Option<(Arc<rustls::ClientConfig>, ServerName<'static>)>,
    username: Option<String>,
    password: Option<String>,
    db: i64,
}

enum Target {
    Tcp(String, u16),
    Unix(PathBuf),
}

/// A connection: TCP, TLS over TCP, or a Unix socket.
trait Io: AsyncRead + AsyncWrite + Unpin + Send {}
impl<T: AsyncRead + AsyncWrite + Unpin + Send> Io for T {}

impl NodeAddr {
    /// The node behind `url`; `None` for a URL whose checks stay with redis-rs (`rediss://…#insecure`:
    /// TLS without checking the certificate's name is not built here). One such URL keeps every
    /// node's checks with redis-rs.
    pub fn new(url: &str, access: &RedisAccess) -> Result<Option<NodeAddr>, StoreError> {
        let err = |e: String| StoreError::Connection(format!("{}: {e}", floodgate_core::store::redact(url)));
        let info = redis::IntoConnectionInfo::into_connection_info(url).map_err(|e| err(e.to_string()))?;
        let settings = info.redis_settings();
        let (target, tls) = match info.addr() {
            redis::ConnectionAddr::Tcp(host, port) => (Target::Tcp(host.clone(), *port), None),
            redis::ConnectionAddr::TcpTls { insecure: true, .. } => return Ok(None),
            redis::ConnectionAddr::TcpTls { host, port, .. } => {
                let name = ServerName::try_from(host.clone()).map_err(|e| err(e.to_string()))?;
                let roots = roots(access.ca.as_deref()).map_err(err)?;
                let config = rustls::ClientConfig::builder()
                    .with_root_certificates(roots)
                    .with_no_client_auth();
                (Target::Tcp(host.clone(), *port), Some((Arc::new(config), name)))
            }
            redis::ConnectionAddr::Unix(path) => (Target::Unix(path.clone()), None),
            // A kind of address a later redis-rs may add.
            _ => return Ok(None),
        };
        Ok(Some(NodeAddr {
            target,
            tls,
            username: settings.username().map(str::to_string),
            password: access
                .password
                .clone()
                .or_else(|| settings.password().map(str::to_string)),
            db: settings.db(),
        }))
    }

    /// Connects and signs in (AUTH, SELECT).
    async fn connect(&self) -> Result<Box<dyn Io>, StoreError> {
        let io_err = |e: std::io::Error| StoreError::Connection(e.to_string());
        let mut io: Box<dyn Io> = match &self.target {
            Target::Tcp(host, port) => {
                let tcp = tokio::net::TcpStream::connect((host.as_str(), *port))
                    .await
                    .map_err(io_err)?;
                tcp.set_nodelay(true).map_err(io_err)?;
                match &self.tls {
                    Some((config, name)) => Box::new(
                        tokio_rustls::TlsConnector::from(config.clone())
                            .connect(name.clone(), tcp)
                            .await
                            .map_err(io_err)?,
                    ),
                    None => Box::new(tcp),
                }
            }
            Target::Unix(path) => Box::new(tokio::net::UnixStream::connect(path).await.map_err(io_err)?),
        };
        // One command at a time: AUTH (Redis 5 and older know no user name: without it, as redis-rs
        // does), SELECT, and always a PING, so that a Redis that accepts and then refuses (maxclients,
        // protected mode, still loading) is a failed connect, with its backoff, not a connection that
        // fails its first call.
        if let Some(password) = &self.password {
            let pass = password.as_bytes();
            let mut refused = match &self.username {
                Some(user) => sign_in(&mut io, &[b"AUTH", user.as_bytes(), pass]).await?,
                None => sign_in(&mut io, &[b"AUTH", pass]).await?,
            };
            if self.username.is_some()
                && refused
                    .as_deref()
                    .is_some_and(|e| e.contains("wrong number of arguments"))
            {
                refused = sign_in(&mut io, &[b"AUTH", pass]).await?;
            }
            if let Some(e) = refused {
                return Err(StoreError::Connection(format!("Redis refused the sign-in: {e}")));
            }
        }
        if self.db != 0 {
            if let Some(e) = sign_in(&mut io, &[b"SELECT", self.db.to_string().as_bytes()]).await? {
                return Err(StoreError::Connection(format!(
                    "Redis refused SELECT {}: {e}",
                    self.db
                )));
            }
        }
        if let Some(e) = sign_in(&mut io, &[b"PING"]).await? {
            return Err(StoreError::Connection(format!("Redis refused PING: {e}")));
        }
        Ok(io)
    }
}

/// Sends one command of the sign-in and reads its reply: `Some(error text)` if Redis refused it.
async fn sign_in(io: &mut Box<dyn Io>, args: &[&[u8]]) -> Result<Option<String>, StoreError> {
    let io_err = |e: std::io::Error| StoreError::Connection(e.to_string());
    let mut out = Vec::new();
    resp::command(&mut out, args);
    io.write_all(&out).await.map_err(io_err)?;
    io.flush().await.map_err(io_err)?;
    let mut buf = Vec::with_capacity(128);
    loop {
        match resp::parse(&buf) {
            Ok((Reply::Error(e), _)) => return Ok(Some(e)),
            Ok(_) => return Ok(None),
            Err(RespError::Incomplete) => {
                if io.read_buf(&mut buf).await.map_err(io_err)? == 0 {
                    return Err(StoreError::Connection("Redis closed the connection".into()));
                }
            }
            Err(e) => return Err(StoreError::Connection(e.to_string())),
        }
    }
}

/// The roots a `rediss://` connection trusts: the `--redis-ca` certificates only, or the system's.
fn roots(ca: Option<&[u8]>) -> Result<rustls::RootCertStore, String> {
    use rustls::pki_types::pem::PemObject;
    let mut roots = rustls::RootCertStore::empty();
    match ca {
        Some(pem) => {
            for cert in CertificateDer::pem_slice_iter(pem) {
                let cert = cert.map_err(|e| format!("the Redis CA is not PEM certificates: {e}"))?;
                roots.add(cert).map_err(|e| format!("the Redis CA: {e}"))?;
            }
        }
        None => {
            for cert in rustls_native_certs::load_native_certs().certs {
                let _ = roots.add(cert);
            }
        }
    }
    Ok(roots)
}

/// Where one check's outcomes go.
type CheckReply = oneshot::Sender<Result<Vec<Outcome>, StoreError>>;

/// Who waits for a call's reply.
enum Waiter {
    /// Coalesced checks: how many items each, and where its outcomes go.
    Checks(Vec<(usize, CheckReply)>),
    /// A raw call.
    Raw(oneshot::Sender<Result<Vec<i64>, StoreError>>),
    /// A `SCRIPT LOAD` sent after NOSCRIPT; the call sent again after it gets the answer.
    Load,
}

/// A call written and not yet answered.
struct Pending {
    waiter: Waiter,
    items: usize,
    deadline: Instant,
    /// The command, kept to send once more after NOSCRIPT.
    cmd: Vec<u8>,
    /// Whether it was sent again after NOSCRIPT (it is not sent a third time).
    resent: bool,
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
}

impl PipeState {
    fn new() -> Self {
        PipeState {
            epoch: Instant::now(),
            overloaded_until_us: AtomicU64::new(0),
            incoming: AtomicUsize::new(0),
            waiting: AtomicUsize::new(0),
            rtt_us: AtomicU64::new(0),
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
    pub fn send_check(&self, job: Job, left: Duration) -> Result<(), Job> {
        if self.sheds(left) {
            return Err(job);
        }
        self.state.incoming.fetch_add(1, Ordering::Relaxed);
        self.tx.send(Request::Check(job)).map_err(|e| match e.0 {
            Request::Check(job) => job,
            Request::Raw { .. } => unreachable!("a check was sent"),
        })
    }
}

/// Starts the task of one node; it ends when the store (every sender) is dropped.
pub fn spawn(task: NodeTask) -> Pipe {
    let (tx, rx) = mpsc::unbounded_channel();
    let state = Arc::new(PipeState::new());
    let max_items = task.max_items.max(1);
    let mut load = Vec::new();
    resp::command(&mut load, &[b"SCRIPT", b"LOAD", task.script.as_bytes()]);
    let node = Node {
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
        state: state.clone(),
    };
    tokio::spawn(node.run(rx));
    Pipe { tx, state, max_items }
}

struct Node {
    task: NodeTask,
    /// `SCRIPT LOAD` of the check script, as RESP.
    load: Vec<u8>,
    conn: Option<Box<dyn Io>>,
    rbuf: Vec<u8>,
    rpos: usize,
    pending: VecDeque<Pending>,
    waiting: VecDeque<Request>,
    /// Command buffers of answered calls, reused.
    spare: Vec<Vec<u8>>,
    retry_at: Option<Instant>,
    backoff: Duration,
    last_error: StoreError,
    /// The timer of [`Node::slot_frees`], and the instant it is set to.
    timer: Option<Pin<Box<tokio::time::Sleep>>>,
    timer_at: Option<Instant>,
    /// What the store reads before queueing a check ([`Pipe::send_check`]): while it says the node
    /// is overloaded the store sheds new checks, so the queue drains and the checks it does take are answered
    /// within their budget; past capacity, a share of checks is answered by its fail mode at once
    /// rather than every check late.
    state: Arc<PipeState>,
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
    async fn run(mut self, mut rx: mpsc::UnboundedReceiver<Request>) {
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
            let (cmd, waiter, items, timeout) = match self.waiting.pop_front() {
                Some(Request::Raw {
                    cmd,
                    items,
                    timeout,
                    reply,
                }) => (cmd, Waiter::Raw(reply), items, timeout),
                Some(Request::Check(first)) => {
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
                        continue;
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
                    let mut cmd = self.spare.pop().unwrap_or_default();
                    cmd.clear();
                    let call_items = call::check_items(jobs.iter().map(|j| j.items.as_slice()));
                    call::write_check(&mut cmd, &self.task.script_hash, &self.task.layout, &call_items);
                    drop(call_items);
                    let waiter = Waiter::Checks(jobs.into_iter().map(|j| (j.items.len(), j.reply)).collect());
                    (cmd, waiter, items, self.task.timeout)
                }
                None => return,
            };
            let pending = Pending {
                waiter,
                items,
                deadline: now + timeout,
                cmd,
                resent: false,
            };
            self.send(pending).await;
        }
    }

    /// Writes a call and queues it for its reply; a failed write fails it and the connection.
    async fn send(&mut self, p: Pending) {
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

    /// Answers every reply read so far.
    async fn on_data(&mut self) {
        let mut again = Vec::new();
        let broken = loop {
            let (reply, used) = match resp::parse(&self.rbuf[self.rpos..]) {
                Ok(r) => r,
                Err(RespError::Incomplete) if self.rbuf.len() - self.rpos > MAX_REPLY => {
                    break Some("a reply longer than any the check script gives".to_string())
                }
                Err(RespError::Incomplete) => break None,
                Err(e) => break Some(e.to_string()),
            };
            self.rpos += used;
            let Some(mut p) = self.pending.pop_front() else {
                break Some("a reply no call waits for".into());
            };
            if let Reply::Error(e) = &reply {
                if e.starts_with("NOSCRIPT") && !p.resent {
                    p.resent = true;
                    again.push(p);
                    continue;
                }
            }
            self.answer(&mut p, reply);
            if self.spare.len() < MAX_IN_FLIGHT * 2 {
                self.spare.push(std::mem::take(&mut p.cmd));
            }
        };
        if let Some(why) = broken {
            let e = StoreError::Connection(why);
            for p in again {
                metrics::redis_call(self.task.shard, false);
                fail(p.waiter, &e);
            }
            self.drop_conn(e);
            return;
        }
        // What is left is the start of a reply still arriving: moved to the front, so the buffer never
        // grows past the longest reply.
        self.rbuf.drain(..self.rpos);
        self.rpos = 0;
        // NOSCRIPT: load the script, then the same call once more (its reply comes after the load's).
        for p in again {
            let load = Pending {
                waiter: Waiter::Load,
                items: 0,
                deadline: p.deadline,
                cmd: self.load.clone(),
                resent: true,
            };
            self.send(load).await;
            self.send(p).await;
        }
    }

    /// Gives a call's reply to whoever waits for it.
    fn answer(&self, p: &mut Pending, reply: Reply) {
        if !p.resent && matches!(p.waiter, Waiter::Checks(_)) {
            // A check call's time, sent to answered (its deadline is its send plus the checks'
            // timeout; a raw call has a timeout of its own), in a moving average of 1/8 per call:
            // what a check sent now should expect to wait.
            let took = Instant::now()
                .saturating_duration_since(p.deadline - self.task.timeout)
                .as_micros() as u64;
            let rtt = self.state.rtt_us.load(Ordering::Relaxed);
            // The first call sets it; after that each moves it by an eighth.
            let rtt = if rtt == 0 { took } else { (rtt * 7 + took) / 8 };
            self.state.rtt_us.store(rtt.max(1), Ordering::Relaxed);
        }
        let waiter = std::mem::replace(&mut p.waiter, Waiter::Load);
        let result = match reply {
            Reply::Ints(v) if v.len() == p.items * 5 => Ok(v),
            Reply::Ints(v) => Err(StoreError::Script(format!(
                "script returned {} values for {} items",
                v.len(),
                p.items
            ))),
            Reply::Error(e) => Err(super::reply_error("", e)),
            Reply::Int(_) | Reply::Other => {
                Err(StoreError::Script("script returned no array of integers".into()))
            }
        };
        if !matches!(waiter, Waiter::Load) {
            // A reply past its deadline came too late for its callers: counted as the failure it was.
            metrics::redis_call(self.task.shard, result.is_ok() && Instant::now() <= p.deadline);
        }
        match (waiter, result) {
            (Waiter::Load, _) => {}
            (Waiter::Raw(reply), result) => {
                let _ = reply.send(result);
            }
            (Waiter::Checks(checks), Ok(v)) => {
                let mut at = 0;
                for (n, reply) in checks {
                    let outcomes = v[at..at + n * 5].chunks_exact(5).map(call::outcome).collect();
                    at += n * 5;
                    let _ = reply.send(Ok(outcomes));
                }
            }
            (Waiter::Checks(checks), Err(e)) => {
                for (_, reply) in checks {
                    let _ = reply.send(Err(e.clone()));
                }
            }
        }
    }

    /// Drops the connection; every call on it fails with `e`.
    fn drop_conn(&mut self, e: StoreError) {
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

fn fail(waiter: Waiter, e: &StoreError) {
    match waiter {
        Waiter::Checks(checks) => {
            for (_, reply) in checks {
                let _ = reply.send(Err(e.clone()));
            }
        }
        Waiter::Raw(reply) => {
            let _ = reply.send(Err(e.clone()));
        }
        Waiter::Load => {}
    }
}

/// Writes `bytes` whole: at once when the socket takes them (the usual case, no timer), else within
/// `timeout` (a write cut short leaves half a command on the socket: the caller drops it).
async fn write(io: &mut Box<dyn Io>, bytes: &[u8], timeout: Duration) -> Result<(), StoreError> {
    let mut written = pin!(async {
        io.write_all(bytes).await?;
        io.flush().await
    });
    let result = match futures::poll!(written.as_mut()) {
        Poll::Ready(r) => r,
        Poll::Pending => match tokio::time::timeout(timeout.max(Duration::from_millis(100)), written).await {
            Ok(r) => r,
            Err(_) => return Err(StoreError::Timeout(timeout)),
        },
    };
    result.map_err(|e| StoreError::Connection(e.to_string()))
}
