//! One HTTP/2 connection serving unary gRPC calls: frames read and answered in the connection's own
//! task, each call handed to the service as soon as its last frame is read, answers written together.
//!
//! What it keeps per stream is a request head (three flags), its body until complete, and a send
//! window; nothing is spawned per request and nothing is locked. The frames read are handled in
//! `recv`, the answers written in `send`, the read buffer and the timer's verdicts are `inbound`'s,
//! a stream's state is in `stream`, and what a client may make it hold is in `budget`. What
//! bounds a client: at most [`MAX_STREAMS`] streams at once (more are refused with REFUSED_STREAM);
//! request bodies held in all count against a connection receive window of [`CONN_WINDOW`] that is
//! credited back only when a body is used or dropped; a header block of at most
//! [`MAX_HEADER_BLOCK`] bytes in at most [`MAX_CONTINUATIONS`] CONTINUATIONs, completed within the
//! frame timeout of its HEADERS; a request (or a frame) started and not completed within the frame
//! timeout is dropped (the connection, for a frame); an answer waiting for flow-control window past
//! the frame timeout, or past the parked budgets, is dropped and its stream reset; streams reset or
//! refused and SETTINGS frames spend a budget that ends in GOAWAY ENHANCE_YOUR_CALM; a peer that
//! stops reading is closed after the write timeout; and a connection that keeps the worker busy
//! yields it every [`TURN`]. A connection error is a GOAWAY naming it, then the close.

use std::collections::{HashMap, VecDeque};
use std::ops::ControlFlow;
use std::sync::Arc;
use std::time::Duration;

use futures::stream::FuturesUnordered;
use futures::{FutureExt, StreamExt};
use tokio::io::{AsyncRead, AsyncReadExt, AsyncWrite, AsyncWriteExt};
use tokio::sync::watch;
use tokio::time::Instant;

use crate::budget::{ClosedStreams, Parked, CALM};
use crate::frame::{self, code, setting, HEAD, MAX_PAYLOAD};
use crate::hpack;
use crate::inbound::{Inbound, Tick};
use crate::service::{Config, Service};
pub(crate) use crate::stream::{Answering, Continuing, State, Stream};

/// Streams a client may have open at once (announced as SETTINGS_MAX_CONCURRENT_STREAMS).
pub const MAX_STREAMS: usize = 1_024;

/// The connection's receive window: request body bytes not yet used, across all streams.
pub const CONN_WINDOW: i64 = 1 << 20;

/// Each stream's receive window (the default, never credited back: a request message is at most
/// [`crate::grpc::MAX_MESSAGE`], well within it).
pub(crate) const STREAM_WINDOW: usize = 65_535;

/// The largest header block (HEADERS and its CONTINUATIONs, compressed), and the largest header
/// list decoded from one (announced as SETTINGS_MAX_HEADER_LIST_SIZE).
pub const MAX_HEADER_BLOCK: usize = 32 * 1024;

/// CONTINUATION frames one header block may take (nghttp2 allows 8 since CVE-2024-27316; a 32 KiB
/// block needs 2 of 16 KiB).
pub const MAX_CONTINUATIONS: u32 = 16;

/// A connection nothing was read from for this long is sent a PING...
pub const KEEPALIVE: Duration = Duration::from_secs(30);

/// ... and closed if its answer does not come within this.
pub const KEEPALIVE_TIMEOUT: Duration = Duration::from_secs(10);

/// The longest a connection keeps the worker before it lets other tasks run: one connection's flood
/// of valid requests delays another's by about this much, not by its whole backlog.
pub const TURN: Duration = Duration::from_micros(500);

/// A connection error: GOAWAY with this code, then close.
pub(crate) struct ConnError {
    pub code: u32,
    pub why: String,
}

pub(crate) fn conn_error<T>(code: u32, why: impl Into<String>) -> Result<T, ConnError> {
    Err(ConnError {
        code,
        why: why.into(),
    })
}

pub(crate) struct Conn<S: Service> {
    pub service: Arc<S>,
    pub config: Arc<Config>,
    /// Whether the service reads `traceparent`.
    pub trace: bool,
    pub hpack: hpack::Decoder,
    pub streams: HashMap<u32, Stream, foldhash::fast::FixedState>,
    /// The highest stream id the client opened.
    pub last_stream: u32,
    pub continuing: Option<Continuing>,
    /// The header block being read opened a stream that depends on itself (a stream error once the
    /// block is decoded).
    pub self_dependent: Option<u32>,
    pub block: Vec<u8>,
    /// Where a Huffman-coded value read is decoded.
    pub scratch: Vec<u8>,
    /// The client's SETTINGS_INITIAL_WINDOW_SIZE.
    pub peer_initial: i64,
    /// What this server may still send on the connection.
    pub send_window: i64,
    /// What the client may still send on the connection, and bytes used since the last credit.
    pub recv_window: i64,
    pub uncredited: i64,
    /// Streams whose answers wait for window, oldest first.
    pub blocked: VecDeque<u32>,
    /// The bytes of those answers, under the connection's and the agent's budgets.
    pub parked: Parked,
    /// Window arrived since the waiting answers were last looked at.
    pub window_changed: bool,
    /// Streams in state Receiving (their frames still arriving).
    pub receiving: usize,
    /// What the client may still spend on resets, refusals and settings ([`CALM`]).
    pub calm: u32,
    /// The client's first SETTINGS (its preface) has come.
    pub settled: bool,
    /// Streams lately closed, and how.
    pub closed: ClosedStreams,
    /// GOAWAY sent (the agent is stopping): streams past `last_stream` are refused.
    pub going_away: bool,
    /// The last stream id the first GOAWAY named (a later one never names a higher one).
    pub goaway_last: Option<u32>,
    /// The client sent GOAWAY: no new streams will come.
    pub peer_gone: bool,
    /// When the last stream opened (or the connection, before any): a connection with no call for
    /// the idle timeout is closed.
    pub last_call: Instant,
    pub out: Vec<u8>,
    pub pending: FuturesUnordered<Answering<S::Future>>,
}

/// How a connection ended.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Ended {
    /// The peer closed it, or it drained after a shutdown, or a write timed out.
    Closed,
    /// No call came for the idle timeout: GOAWAY `NO_ERROR`, then the close (a client reconnects).
    Idle,
    /// This server sent GOAWAY with this error code (ENHANCE_YOUR_CALM: a budget was spent).
    Error {
        /// The GOAWAY's code (RFC 9113 §7).
        code: u32,
        /// Why, as the GOAWAY's debug data says it.
        why: String,
    },
}

/// Resolves once `shutdown` says true (or its sender is gone).
async fn stopped(shutdown: &mut watch::Receiver<bool>) {
    let _ = shutdown.wait_for(|s| *s).await;
}

/// Serves one connection until the client closes it, an error closes it, or `shutdown` (then a
/// GOAWAY, the streams in flight answered, and the close).
pub async fn serve<IO, S>(
    io: IO,
    service: Arc<S>,
    config: Arc<Config>,
    shutdown: watch::Receiver<bool>,
) -> Ended
where
    IO: AsyncRead + AsyncWrite + Unpin,
    S: Service,
{
    serve_reporting(io, service, config, shutdown, |_| {}).await
}

/// [`serve`], telling `report` how the connection ends as soon as that is decided: before the
/// [`LINGER`] that reads what the client still sends, which a client that keeps its socket open
/// makes last a second.
pub async fn serve_reporting<IO, S>(
    mut io: IO,
    service: Arc<S>,
    config: Arc<Config>,
    shutdown: watch::Receiver<bool>,
    report: impl FnOnce(&Ended),
) -> Ended
where
    IO: AsyncRead + AsyncWrite + Unpin,
    S: Service,
{
    let (ended, gracefully) = drive(&mut io, service, config, shutdown).await;
    report(&ended);
    if gracefully {
        linger(&mut io).await;
    }
    ended
}

/// The connection until it ends, and whether it ended gracefully (GOAWAY written: linger).
async fn drive<IO, S>(
    io: &mut IO,
    service: Arc<S>,
    config: Arc<Config>,
    mut shutdown: watch::Receiver<bool>,
) -> (Ended, bool)
where
    IO: AsyncRead + AsyncWrite + Unpin,
    S: Service,
{
    let (frame_timeout, write_timeout, idle_timeout) =
        (config.frame_timeout, config.write_timeout, config.idle_timeout);
    let mut idle = false;
    let mut c = Conn::new(service, config);
    let mut inbound = Inbound::new(Instant::now());
    let mut closing = false;
    let mut fatal: Option<ConnError> = None;
    let timer = tokio::time::sleep(frame_timeout);
    tokio::pin!(timer);
    // Shutdown is looked at every turn (one atomic load), since a client that keeps the socket
    // readable would starve the select's branch for it; the branch wakes an idle connection.
    let peek = shutdown.clone();
    let stop = stopped(&mut shutdown);
    tokio::pin!(stop);
    loop {
        if !c.going_away && peek.has_changed().unwrap_or(true) {
            c.going_away = true;
            c.goaway(code::NO_ERROR, "the agent is stopping");
        }
        if let Some(ended) = c.write_out(io, fatal.take(), write_timeout).await {
            return ended;
        }
        let done = if closing {
            c.pending.is_empty()
        } else {
            (c.going_away || c.peer_gone) && c.streams.is_empty() && c.pending.is_empty()
        };
        if done {
            return (if idle { Ended::Idle } else { Ended::Closed }, true);
        }
        if inbound.buf.capacity() - inbound.buf.len() < 4 * 1024 {
            inbound.buf.reserve(HEAD + MAX_PAYLOAD);
        }
        tokio::select! {
            biased;
            Some((id, result)) = c.pending.next(), if !c.pending.is_empty() => {
                c.answer(id, result);
                while let Some(Some((id, result))) = c.pending.next().now_or_never() {
                    c.answer(id, result);
                }
                c.flush_if_changed();
            }
            read = io.read_buf(&mut inbound.buf), if !closing => {
                match read {
                    Ok(0) | Err(_) => {
                        closing = true;
                        inbound.closed(&mut c);
                    }
                    Ok(_) => match inbound.on_read(&mut c, timer.as_mut(), frame_timeout).await {
                        // The client's preface not (all) there yet, or not a preface.
                        ControlFlow::Break(e) => {
                            if e.is_some() {
                                fatal = e;
                            }
                            continue;
                        }
                        ControlFlow::Continue(e) => {
                            if e.is_some() {
                                fatal = e;
                            }
                        }
                    },
                }
            }
            _ = &mut stop, if !c.going_away => {
                c.going_away = true;
                c.goaway(code::NO_ERROR, "the agent is stopping");
            }
            _ = &mut timer => {
                match inbound.on_timer(&mut c, Instant::now(), frame_timeout, idle_timeout) {
                    Tick::Stuck(e) => {
                        fatal = Some(e);
                        continue;
                    }
                    Tick::Dead => return (Ended::Closed, false),
                    Tick::Idle => {
                        idle = true;
                        continue;
                    }
                    Tick::Next(next) => timer.as_mut().reset(next),
                }
            }
        }
        if fatal.is_none() {
            fatal = c.calm_spent();
        }
    }
}

impl<S: Service> Conn<S> {
    /// A connection's state, with the server's preface queued: its settings, and the connection
    /// window raised from 65,535.
    fn new(service: Arc<S>, config: Arc<Config>) -> Self {
        let mut c = Conn {
            trace: service.read_traceparent(),
            service,
            config,
            hpack: hpack::Decoder::default(),
            streams: HashMap::with_hasher(foldhash::fast::FixedState::default()),
            last_stream: 0,
            continuing: None,
            self_dependent: None,
            block: Vec::new(),
            scratch: Vec::new(),
            peer_initial: 65_535,
            send_window: 65_535,
            recv_window: CONN_WINDOW,
            uncredited: 0,
            blocked: VecDeque::new(),
            parked: Parked::default(),
            window_changed: false,
            receiving: 0,
            calm: CALM,
            settled: false,
            closed: ClosedStreams::default(),
            going_away: false,
            goaway_last: None,
            peer_gone: false,
            last_call: Instant::now(),
            out: Vec::with_capacity(4 * 1024),
            pending: FuturesUnordered::new(),
        };
        frame::settings(
            &mut c.out,
            &[
                (setting::MAX_CONCURRENT_STREAMS, MAX_STREAMS as u32),
                (setting::ENABLE_PUSH, 0),
                (setting::MAX_HEADER_LIST_SIZE, MAX_HEADER_BLOCK as u32),
            ],
        );
        frame::window_update(&mut c.out, 0, (CONN_WINDOW - 65_535) as u32);
        c
    }

    /// What is queued written, within the write timeout. After a connection error (`fatal`), its
    /// GOAWAY is written and the connection ends; a write that fails or times out ends it too.
    async fn write_out<IO: AsyncWrite + Unpin>(
        &mut self,
        io: &mut IO,
        fatal: Option<ConnError>,
        write_timeout: Duration,
    ) -> Option<(Ended, bool)> {
        if let Some(e) = fatal {
            self.goaway(e.code, &e.why);
            let _ = tokio::time::timeout(write_timeout, io.write_all(&self.out)).await;
            let ended = Ended::Error {
                code: e.code,
                why: e.why,
            };
            return Some((ended, true));
        }
        if !self.out.is_empty() {
            match tokio::time::timeout(write_timeout, io.write_all(&self.out)).await {
                Ok(Ok(())) if self.out.capacity() > 64 * 1024 => self.out = Vec::with_capacity(4 * 1024),
                Ok(Ok(())) => self.out.clear(),
                _ => return Some((Ended::Closed, false)),
            }
        }
        None
    }

    /// The connection error of a client that has spent its [`CALM`] budget.
    fn calm_spent(&self) -> Option<ConnError> {
        (self.calm == 0).then(|| ConnError {
            code: code::ENHANCE_YOUR_CALM,
            why: format!("{CALM} streams reset or refused, or settings changed, more than calls answered"),
        })
    }

    /// Whether something waits on the frame timeout: a frame or header block half-sent, a request
    /// still arriving, or an answer waiting for window.
    pub(crate) fn incomplete(&self, partial_since: Option<Instant>) -> bool {
        partial_since.is_some() || self.continuing.is_some() || self.receiving > 0 || !self.blocked.is_empty()
    }
}

/// How long a closing connection reads what the client still sends.
pub const LINGER: Duration = Duration::from_secs(1);

/// Closes gracefully: our side's FIN, then what the client still sends is read and dropped until it
/// closes too or [`LINGER`] passes. Closing a socket with unread bytes makes the kernel send a reset,
/// which can reach the client before the answers and GOAWAY already sent, and lose them.
async fn linger<IO: AsyncRead + AsyncWrite + Unpin>(io: &mut IO) {
    let _ = io.shutdown().await;
    let mut sink = [0u8; 4096];
    let _ = tokio::time::timeout(LINGER, async {
        while matches!(io.read(&mut sink).await, Ok(n) if n > 0) {}
    })
    .await;
}
