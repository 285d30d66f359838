//! One HTTP/2 connection serving ShouldRateLimit: frames read and answered in the connection's own
//! task, each request decided as soon as its last frame is read, answers written together.
//!
//! What it keeps per stream is a request head (three flags), its body until complete, and a send
//! window; nothing is spawned per request and nothing is locked. What bounds a client: at most
//! [`MAX_STREAMS`] streams at once (more are refused with REFUSED_STREAM), request bodies held in
//! all count against a connection receive window of [`CONN_WINDOW`] that is credited back only when
//! a body is used or dropped, a header block of at most [`MAX_HEADER_BLOCK`], a request (or a frame)
//! started and not completed within the frame timeout is dropped (the connection, for a frame), and a
//! peer that stops reading is closed after [`WRITE_TIMEOUT`]. A connection error is a GOAWAY
//! naming it, then the close.

use std::collections::{HashMap, VecDeque};
use std::future::Future;
use std::pin::Pin;
use std::sync::Arc;
use std::time::Duration;

use futures::stream::FuturesUnordered;
use futures::{FutureExt, StreamExt};
use prost::Message;
use tokio::io::{AsyncRead, AsyncReadExt, AsyncWrite, AsyncWriteExt};
use tokio::sync::watch;
use tokio::time::Instant;

use super::frame::{self, code, flag, kind, setting, Head, HEAD, MAX_PAYLOAD, MAX_WINDOW, PREFACE};
use super::grpc::{self, status};
use super::hpack;
use crate::envoy::proto::RateLimitRequest;
use crate::envoy::EnvoyService;
use crate::server::WRITE_TIMEOUT;

/// Streams a client may have open at once (announced as SETTINGS_MAX_CONCURRENT_STREAMS).
pub const MAX_STREAMS: usize = 1_024;

/// The connection's receive window: request body bytes not yet used, across all streams.
pub const CONN_WINDOW: i64 = 1 << 20;

/// Each stream's receive window (the default, never credited back: a request message is at most
/// [`grpc::MAX_MESSAGE`], well within it).
const STREAM_WINDOW: usize = 65_535;

/// The largest header block (HEADERS and its CONTINUATIONs, compressed) accepted.
pub const MAX_HEADER_BLOCK: usize = 32 * 1024;

/// A connection nothing was read from for this long is sent a PING...
pub const KEEPALIVE: Duration = Duration::from_secs(30);

/// ... and closed if its answer does not come within this.
pub const KEEPALIVE_TIMEOUT: Duration = Duration::from_secs(10);

type Answering = Pin<Box<dyn Future<Output = (u32, Result<Vec<u8>, tonic::Status>)> + Send>>;

/// What the server reads of a request's headers.
#[derive(Debug, Default, Clone)]
struct RequestHead {
    post: bool,
    path: bool,
    grpc: bool,
    /// The caller's `traceparent`, read only when traces are on (boxed: the head is copied per
    /// request, and a context is 25 bytes).
    trace: Option<Box<floodgate_protocol::TraceContext>>,
}

impl RequestHead {
    fn field(&mut self, name: &[u8], value: hpack::Value<'_>, buf: &mut Vec<u8>) {
        match name {
            b":method" => self.post = value.is(b"POST", &coded().post),
            b":path" => self.path = value.is(grpc::PATH, &coded().path),
            b"content-type" => {
                self.grpc = value
                    .bytes(buf)
                    .is_some_and(|v| v.starts_with(b"application/grpc"))
            }
            b"traceparent" if crate::otel::enabled() => {
                self.trace = value
                    .bytes(buf)
                    .and_then(|v| std::str::from_utf8(v).ok())
                    .and_then(floodgate_protocol::TraceContext::parse)
                    .map(Box::new)
            }
            _ => {}
        }
    }
}

/// The Huffman codes of the values compared.
struct Coded {
    post: Vec<u8>,
    path: Vec<u8>,
}

fn coded() -> &'static Coded {
    static CODED: std::sync::OnceLock<Coded> = std::sync::OnceLock::new();
    CODED.get_or_init(|| Coded {
        post: super::huffman::encode(b"POST"),
        path: super::huffman::encode(grpc::PATH),
    })
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum State {
    /// The request's frames are arriving.
    Receiving,
    /// Decided by the engine; the answer is on its way.
    Answering,
    /// The answer's DATA waits for flow-control window.
    Sending,
}

struct Stream {
    state: State,
    head: RequestHead,
    body: Vec<u8>,
    /// DATA payload bytes received, padding included (the stream's receive window used).
    received: usize,
    /// Received bytes not yet credited back to the connection's window.
    uncredited: usize,
    send_window: i64,
    opened: Instant,
    /// The answer's DATA payload and how much of it is sent (state Sending).
    data: Vec<u8>,
    sent: usize,
}

/// A connection error: GOAWAY with this code, then close.
struct ConnError {
    code: u32,
    why: String,
}

fn conn_error<T>(code: u32, why: impl Into<String>) -> Result<T, ConnError> {
    Err(ConnError {
        code,
        why: why.into(),
    })
}

struct Conn {
    service: Arc<EnvoyService>,
    hpack: hpack::Decoder,
    streams: HashMap<u32, Stream, foldhash::fast::FixedState>,
    /// The highest stream id the client opened.
    last_stream: u32,
    /// A header block arriving in CONTINUATIONs: its stream and whether its HEADERS ended the stream.
    continuing: Option<(u32, bool)>,
    block: Vec<u8>,
    /// Where a Huffman-coded value read is decoded.
    scratch: Vec<u8>,
    /// The client's SETTINGS_INITIAL_WINDOW_SIZE.
    peer_initial: i64,
    /// What this server may still send on the connection.
    send_window: i64,
    /// What the client may still send on the connection, and bytes used since the last credit.
    recv_window: i64,
    uncredited: i64,
    /// Streams whose answers wait for window, oldest first.
    blocked: VecDeque<u32>,
    /// Streams in state Receiving (their frames still arriving).
    receiving: usize,
    /// GOAWAY sent (the agent is stopping): streams past `last_stream` are refused.
    going_away: bool,
    /// The last stream id the first GOAWAY named (a later one never names a higher one).
    goaway_last: Option<u32>,
    /// The client sent GOAWAY: no new streams will come.
    peer_gone: bool,
    out: Vec<u8>,
    pending: FuturesUnordered<Answering>,
}

/// Serves one connection until the client closes it, an error closes it, or `shutdown` (then a
/// GOAWAY, the streams in flight answered, and the close).
pub async fn serve<IO>(
    mut io: IO,
    service: Arc<EnvoyService>,
    frame_timeout: Duration,
    mut shutdown: watch::Receiver<bool>,
) where
    IO: AsyncRead + AsyncWrite + Unpin,
{
    let mut c = Conn {
        service,
        hpack: hpack::Decoder::default(),
        streams: HashMap::with_hasher(foldhash::fast::FixedState::default()),
        last_stream: 0,
        continuing: None,
        block: Vec::new(),
        scratch: Vec::new(),
        peer_initial: 65_535,
        send_window: 65_535,
        recv_window: CONN_WINDOW,
        uncredited: 0,
        blocked: VecDeque::new(),
        receiving: 0,
        going_away: false,
        goaway_last: None,
        peer_gone: false,
        out: Vec::with_capacity(4 * 1024),
        pending: FuturesUnordered::new(),
    };
    // The server's preface: its settings, and the connection window raised from 65,535.
    frame::settings(
        &mut c.out,
        &[
            (setting::MAX_CONCURRENT_STREAMS, MAX_STREAMS as u32),
            (setting::ENABLE_PUSH, 0),
            (setting::MAX_HEADER_LIST_SIZE, MAX_HEADER_BLOCK as u32),
        ],
    );
    frame::window_update(&mut c.out, 0, (CONN_WINDOW - 65_535) as u32);
    let mut inbuf: Vec<u8> = Vec::with_capacity(HEAD + MAX_PAYLOAD);
    let mut preface = false;
    let opened = Instant::now();
    let mut last_read = opened;
    let mut partial_since: Option<Instant> = Some(opened);
    let mut ping_sent: Option<Instant> = None;
    let mut closing = false;
    let mut fatal: Option<ConnError> = None;
    let timer = tokio::time::sleep(frame_timeout);
    tokio::pin!(timer);
    // Shutdown is looked at every turn (one atomic load), since a client that keeps the socket
    // readable would starve the select's branch for it; the branch wakes an idle connection.
    let peek = shutdown.clone();
    let stop = floodgate_core::tasks::stopped(&mut shutdown);
    tokio::pin!(stop);
    loop {
        if !c.going_away && peek.has_changed().unwrap_or(true) {
            c.going_away = true;
            c.goaway(code::NO_ERROR, "the agent is stopping");
        }
        if let Some(e) = fatal.take() {
            tracing::debug!(code = e.code, why = %e.why, "closing a gRPC connection");
            c.goaway(e.code, &e.why);
            let _ = tokio::time::timeout(WRITE_TIMEOUT, io.write_all(&c.out)).await;
            linger(&mut io).await;
            return;
        }
        if !c.out.is_empty() {
            match tokio::time::timeout(WRITE_TIMEOUT, io.write_all(&c.out)).await {
                Ok(Ok(())) if c.out.capacity() > 64 * 1024 => c.out = Vec::with_capacity(4 * 1024),
                Ok(Ok(())) => c.out.clear(),
                _ => return,
            }
        }
        let done = if closing {
            c.pending.is_empty()
        } else {
            (c.going_away || c.peer_gone) && c.streams.is_empty() && c.pending.is_empty()
        };
        if done {
            linger(&mut io).await;
            return;
        }
        if inbuf.capacity() - inbuf.len() < 4 * 1024 {
            inbuf.reserve(HEAD + MAX_PAYLOAD);
        }
        tokio::select! {
            biased;
            Some((id, result)) = c.pending.next(), if !c.pending.is_empty() => {
                c.answer(id, result);
                while let Some(Some((id, result))) = c.pending.next().now_or_never() {
                    c.answer(id, result);
                }
            }
            read = io.read_buf(&mut inbuf), if !closing => {
                match read {
                    Ok(0) | Err(_) => {
                        // Nothing more will arrive: requests still arriving are dropped; those being
                        // decided are answered if the socket still takes it.
                        closing = true;
                        c.streams.retain(|_, s| s.state == State::Answering);
                        c.blocked.clear();
                        c.receiving = 0;
                        partial_since = None;
                    }
                    Ok(_) => {
                        let now = Instant::now();
                        last_read = now;
                        ping_sent = None;
                        let mut pos = 0;
                        if !preface {
                            if inbuf.len() < PREFACE.len() {
                                if !PREFACE.starts_with(&inbuf) {
                                    fatal = Some(ConnError { code: code::PROTOCOL_ERROR, why: "not an HTTP/2 preface".into() });
                                }
                                continue;
                            }
                            if inbuf[..PREFACE.len()] != PREFACE[..] {
                                fatal = Some(ConnError { code: code::PROTOCOL_ERROR, why: "not an HTTP/2 preface".into() });
                                continue;
                            }
                            preface = true;
                            pos = PREFACE.len();
                        }
                        match c.process(&inbuf[pos..]) {
                            Ok(used) => pos += used,
                            Err(e) => fatal = Some(e),
                        }
                        inbuf.drain(..pos);
                        // Since when the head of the buffer has been waiting: a read that completed
                        // a frame starts the wait again (a busy connection's reads end mid-frame
                        // every time, and that is progress), one that did not keeps it.
                        let waiting = !inbuf.is_empty() || c.continuing.is_some();
                        partial_since = match (waiting, pos > 0) {
                            (false, _) => None,
                            (true, true) => Some(now),
                            (true, false) => partial_since.or(Some(now)),
                        };
                        c.credit();
                        // Something incomplete: the timer fires by the time it may be stale.
                        if (partial_since.is_some() || c.receiving > 0) && timer.deadline() > now + frame_timeout {
                            timer.as_mut().reset(now + frame_timeout);
                        }
                    }
                }
            }
            _ = &mut stop, if !c.going_away => {
                c.going_away = true;
                c.goaway(code::NO_ERROR, "the agent is stopping");
            }
            _ = &mut timer => {
                let now = Instant::now();
                if partial_since.is_some_and(|t| now >= t + frame_timeout) {
                    fatal = Some(ConnError {
                        code: code::PROTOCOL_ERROR,
                        why: format!("a frame was not completed within {frame_timeout:?}"),
                    });
                    continue;
                }
                if ping_sent.is_some_and(|t| now >= t + KEEPALIVE_TIMEOUT) {
                    tracing::debug!("closing a gRPC connection whose peer did not answer a PING");
                    return;
                }
                if ping_sent.is_none() && now >= last_read + KEEPALIVE {
                    frame::ping(&mut c.out, [0; 8], false);
                    ping_sent = Some(now);
                }
                c.drop_stale(now, frame_timeout);
                let next = if partial_since.is_some() || c.receiving > 0 {
                    now + frame_timeout
                } else {
                    match ping_sent {
                        Some(t) => t + KEEPALIVE_TIMEOUT,
                        None => (last_read + KEEPALIVE).max(now + frame_timeout),
                    }
                };
                timer.as_mut().reset(next);
            }
        }
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

impl Conn {
    /// Handles every complete frame in `buf`: the bytes used.
    fn process(&mut self, buf: &[u8]) -> Result<usize, ConnError> {
        let mut pos = 0;
        while let Some(h) = Head::parse(&buf[pos..]) {
            if h.len > MAX_PAYLOAD {
                return conn_error(
                    code::FRAME_SIZE_ERROR,
                    format!("a frame of {} bytes; at most {MAX_PAYLOAD}", h.len),
                );
            }
            let Some(payload) = buf.get(pos + HEAD..pos + HEAD + h.len) else {
                break;
            };
            pos += HEAD + h.len;
            self.frame(h, payload)?;
        }
        Ok(pos)
    }

    fn frame(&mut self, h: Head, payload: &[u8]) -> Result<(), ConnError> {
        if let Some((stream, _)) = self.continuing {
            if h.kind != kind::CONTINUATION || h.stream != stream {
                return conn_error(code::PROTOCOL_ERROR, "a header block interrupted");
            }
        }
        match h.kind {
            kind::DATA => self.data(h, payload),
            kind::HEADERS => self.headers(h, payload),
            kind::CONTINUATION => {
                let Some((stream, end_stream)) = self.continuing else {
                    return conn_error(code::PROTOCOL_ERROR, "CONTINUATION without HEADERS");
                };
                self.fragment(payload)?;
                if h.has(flag::END_HEADERS) {
                    self.continuing = None;
                    self.end_headers(stream, end_stream)?;
                }
                Ok(())
            }
            kind::RST_STREAM => {
                if h.len != 4 {
                    return conn_error(code::FRAME_SIZE_ERROR, "RST_STREAM of a length other than 4");
                }
                if h.stream == 0 || h.stream > self.last_stream {
                    return conn_error(code::PROTOCOL_ERROR, "RST_STREAM of an idle stream");
                }
                self.remove(h.stream);
                Ok(())
            }
            kind::SETTINGS => self.settings(h, payload),
            kind::PING => {
                if h.len != 8 {
                    return conn_error(code::FRAME_SIZE_ERROR, "PING of a length other than 8");
                }
                if h.stream != 0 {
                    return conn_error(code::PROTOCOL_ERROR, "PING on a stream");
                }
                if !h.has(flag::ACK) {
                    let mut p = [0; 8];
                    p.copy_from_slice(payload);
                    frame::ping(&mut self.out, p, true);
                }
                Ok(())
            }
            kind::GOAWAY => {
                self.peer_gone = true;
                Ok(())
            }
            kind::WINDOW_UPDATE => self.window_update(h, payload),
            kind::PUSH_PROMISE => conn_error(code::PROTOCOL_ERROR, "a client sent PUSH_PROMISE"),
            // PRIORITY and unknown kinds: ignored.
            _ => Ok(()),
        }
    }

    fn headers(&mut self, h: Head, payload: &[u8]) -> Result<(), ConnError> {
        if h.stream == 0 || h.stream % 2 == 0 {
            return conn_error(code::PROTOCOL_ERROR, "HEADERS on stream 0 or a server's stream");
        }
        let Some(mut range) = frame::unpadded(&h, payload) else {
            return conn_error(code::PROTOCOL_ERROR, "padding longer than its frame");
        };
        if h.has(flag::PRIORITY) {
            range.start += 5;
            if range.start > range.end {
                return conn_error(code::FRAME_SIZE_ERROR, "HEADERS too short for its priority");
            }
        }
        self.block.clear();
        self.fragment(&payload[range])?;
        let end_stream = h.has(flag::END_STREAM);
        if h.has(flag::END_HEADERS) {
            self.end_headers(h.stream, end_stream)
        } else {
            self.continuing = Some((h.stream, end_stream));
            Ok(())
        }
    }

    fn fragment(&mut self, bytes: &[u8]) -> Result<(), ConnError> {
        if self.block.len() + bytes.len() > MAX_HEADER_BLOCK {
            return conn_error(
                code::ENHANCE_YOUR_CALM,
                format!("a header block past {MAX_HEADER_BLOCK} bytes"),
            );
        }
        self.block.extend_from_slice(bytes);
        Ok(())
    }

    /// A whole header block: a new request, a request's trailers, or (decoded and dropped) one of a
    /// stream already gone.
    fn end_headers(&mut self, id: u32, end_stream: bool) -> Result<(), ConnError> {
        let mut head = RequestHead::default();
        let block = std::mem::take(&mut self.block);
        let mut buf = std::mem::take(&mut self.scratch);
        let decoded = self.hpack.decode(&block, |n, v| head.field(n, v, &mut buf));
        self.scratch = buf;
        self.block = block;
        if let Err(e) = decoded {
            return conn_error(code::COMPRESSION_ERROR, e.to_string());
        }
        if id > self.last_stream {
            self.last_stream = id;
            // Checks still being decided count too: a stream reset while its check runs (the rapid
            // reset pattern) leaves the stream map, not the store.
            if self.going_away || self.streams.len().max(self.pending.len()) >= MAX_STREAMS {
                frame::rst_stream(&mut self.out, id, code::REFUSED_STREAM);
                return Ok(());
            }
            self.streams.insert(
                id,
                Stream {
                    state: State::Receiving,
                    head,
                    body: Vec::new(),
                    received: 0,
                    uncredited: 0,
                    send_window: self.peer_initial,
                    opened: Instant::now(),
                    data: Vec::new(),
                    sent: 0,
                },
            );
            self.receiving += 1;
            if end_stream {
                self.dispatch(id, None);
            }
            return Ok(());
        }
        match self.streams.get(&id).map(|s| s.state) {
            // Trailers end a request.
            Some(State::Receiving) if end_stream => self.dispatch(id, None),
            Some(State::Receiving) => {
                self.reset(id, code::PROTOCOL_ERROR);
            }
            _ => {}
        }
        Ok(())
    }

    fn data(&mut self, h: Head, payload: &[u8]) -> Result<(), ConnError> {
        if h.stream == 0 || h.stream > self.last_stream {
            return conn_error(code::PROTOCOL_ERROR, "DATA on stream 0 or an idle stream");
        }
        self.recv_window -= h.len as i64;
        if self.recv_window < 0 {
            return conn_error(code::FLOW_CONTROL_ERROR, "DATA past the connection's window");
        }
        let Some(range) = frame::unpadded(&h, payload) else {
            return conn_error(code::PROTOCOL_ERROR, "padding longer than its frame");
        };
        let Some(s) = self
            .streams
            .get_mut(&h.stream)
            .filter(|s| s.state == State::Receiving)
        else {
            // A stream answered or reset already: its bytes are credited back at once.
            self.uncredited += h.len as i64;
            return Ok(());
        };
        s.received += h.len;
        s.uncredited += h.len;
        if s.received > STREAM_WINDOW {
            self.reset(h.stream, code::FLOW_CONTROL_ERROR);
            return Ok(());
        }
        let chunk = &payload[range];
        // A request in one DATA frame (the usual) is decoded from the frame; else it is gathered.
        let whole = s.body.is_empty() && h.has(flag::END_STREAM);
        if !whole {
            if s.body.is_empty() {
                s.body
                    .reserve(grpc::declared_len(chunk).map_or(0, |n| 5 + n.min(grpc::MAX_MESSAGE)));
            }
            s.body.extend_from_slice(chunk);
        }
        let declared = grpc::declared_len(if whole { chunk } else { &s.body }).unwrap_or(0);
        if declared > grpc::MAX_MESSAGE {
            let why = format!(
                "a request message of {declared} bytes; at most {}",
                grpc::MAX_MESSAGE
            );
            self.trailers_only(h.stream, status::RESOURCE_EXHAUSTED, &why);
            // Answered: the client may stop sending.
            frame::rst_stream(&mut self.out, h.stream, code::NO_ERROR);
            return Ok(());
        }
        if h.has(flag::END_STREAM) {
            self.dispatch(h.stream, whole.then_some(chunk));
        }
        Ok(())
    }

    fn settings(&mut self, h: Head, payload: &[u8]) -> Result<(), ConnError> {
        if h.stream != 0 {
            return conn_error(code::PROTOCOL_ERROR, "SETTINGS on a stream");
        }
        if h.has(flag::ACK) {
            return if h.len == 0 {
                Ok(())
            } else {
                conn_error(
                    code::FRAME_SIZE_ERROR,
                    "a SETTINGS acknowledgement with a payload",
                )
            };
        }
        if h.len % 6 != 0 {
            return conn_error(code::FRAME_SIZE_ERROR, "SETTINGS of a length not a multiple of 6");
        }
        for entry in payload.chunks_exact(6) {
            let id = u16::from_be_bytes([entry[0], entry[1]]);
            let v = u32::from_be_bytes([entry[2], entry[3], entry[4], entry[5]]);
            match id {
                setting::INITIAL_WINDOW_SIZE => {
                    if i64::from(v) > MAX_WINDOW {
                        return conn_error(code::FLOW_CONTROL_ERROR, "an initial window past 2^31-1");
                    }
                    let delta = i64::from(v) - self.peer_initial;
                    self.peer_initial = i64::from(v);
                    for s in self.streams.values_mut() {
                        s.send_window += delta;
                    }
                }
                setting::ENABLE_PUSH if v > 1 => {
                    return conn_error(code::PROTOCOL_ERROR, "ENABLE_PUSH other than 0 or 1")
                }
                setting::MAX_FRAME_SIZE if !(16_384..=16_777_215).contains(&v) => {
                    return conn_error(code::PROTOCOL_ERROR, "MAX_FRAME_SIZE out of range")
                }
                // The rest change nothing here: this server never pushes, sends frames of at most
                // 16 KiB, and encodes without the dynamic table.
                _ => {}
            }
        }
        frame::settings_ack(&mut self.out);
        self.flush_blocked();
        Ok(())
    }

    fn window_update(&mut self, h: Head, payload: &[u8]) -> Result<(), ConnError> {
        if h.len != 4 {
            return conn_error(code::FRAME_SIZE_ERROR, "WINDOW_UPDATE of a length other than 4");
        }
        let inc =
            i64::from(u32::from_be_bytes([payload[0], payload[1], payload[2], payload[3]]) & 0x7fff_ffff);
        if h.stream == 0 {
            if inc == 0 {
                return conn_error(code::PROTOCOL_ERROR, "a connection window update of 0");
            }
            self.send_window += inc;
            if self.send_window > MAX_WINDOW {
                return conn_error(
                    code::FLOW_CONTROL_ERROR,
                    "a connection window update of 0 or past 2^31-1",
                );
            }
        } else if let Some(s) = self.streams.get_mut(&h.stream) {
            s.send_window += inc;
            if inc == 0 {
                self.reset(h.stream, code::PROTOCOL_ERROR);
            } else if s.send_window > MAX_WINDOW {
                self.reset(h.stream, code::FLOW_CONTROL_ERROR);
            }
        }
        self.flush_blocked();
        Ok(())
    }

    /// A complete request (its body in `whole`, or gathered in the stream): refused at once, or
    /// its check started (and answered at once when the store answers at once).
    fn dispatch(&mut self, id: u32, whole: Option<&[u8]>) {
        let Some(s) = self.streams.get_mut(&id).filter(|s| s.state == State::Receiving) else {
            return;
        };
        s.state = State::Answering;
        self.receiving -= 1;
        self.uncredited += std::mem::take(&mut s.uncredited) as i64;
        let gathered = std::mem::take(&mut s.body);
        let body = whole.unwrap_or(&gathered);
        let head = std::mem::take(&mut s.head);
        if !(head.post && head.grpc) {
            let mut block = Vec::with_capacity(8);
            block.extend_from_slice(grpc::NOT_GRPC);
            self.header_frame(id, &block, true);
            self.remove(id);
            return;
        }
        if !head.path {
            self.trailers_only(id, status::UNIMPLEMENTED, "this server has only ShouldRateLimit");
            return;
        }
        let request = match grpc::message(body).map(RateLimitRequest::decode) {
            Ok(Ok(r)) => r,
            Ok(Err(e)) => {
                self.trailers_only(id, status::INTERNAL, &format!("the request does not decode: {e}"));
                return;
            }
            Err(bad) => {
                self.trailers_only(id, bad.code, &bad.message);
                return;
            }
        };
        let service = self.service.clone();
        let mut answering: Answering =
            Box::pin(async move { (id, service.decide_bytes(request, head.trace.map(|t| *t)).await) });
        match (&mut answering).now_or_never() {
            Some((id, result)) => self.answer(id, result),
            None => self.pending.push(answering),
        }
    }

    /// Writes the answer to stream `id` (if the client has not reset it meanwhile).
    fn answer(&mut self, id: u32, result: Result<Vec<u8>, tonic::Status>) {
        let Some(s) = self.streams.get_mut(&id) else {
            return;
        };
        let response = match result {
            Ok(r) => r,
            Err(e) => {
                self.trailers_only(id, e.code() as i32, e.message());
                return;
            }
        };
        let len = 5 + response.len();
        frame::head(
            &mut self.out,
            grpc::RESPONSE_HEAD.len(),
            kind::HEADERS,
            flag::END_HEADERS,
            id,
        );
        self.out.extend_from_slice(grpc::RESPONSE_HEAD);
        let fits = len as i64 <= self.send_window.min(s.send_window) && len <= MAX_PAYLOAD;
        if fits {
            self.send_window -= len as i64;
            frame::head(&mut self.out, len, kind::DATA, 0, id);
            message_into(&mut self.out, &response, len);
            self.ok_trailers(id);
        } else {
            s.data = Vec::with_capacity(len);
            message_into(&mut s.data, &response, len);
            s.state = State::Sending;
            self.blocked.push_back(id);
            self.flush_blocked();
        }
    }

    /// Sends what the windows allow of the answers waiting for them, oldest first; a stream out of
    /// its own window is passed over, not waited on.
    fn flush_blocked(&mut self) {
        let mut i = 0;
        while i < self.blocked.len() && self.send_window > 0 {
            let id = self.blocked[i];
            let Some(s) = self.streams.get_mut(&id).filter(|s| s.state == State::Sending) else {
                self.blocked.remove(i);
                continue;
            };
            while s.sent < s.data.len() {
                let n = (s.data.len() - s.sent)
                    .min(MAX_PAYLOAD)
                    .min(self.send_window.max(0) as usize)
                    .min(s.send_window.max(0) as usize);
                if n == 0 {
                    break;
                }
                frame::head(&mut self.out, n, kind::DATA, 0, id);
                self.out.extend_from_slice(&s.data[s.sent..s.sent + n]);
                s.sent += n;
                self.send_window -= n as i64;
                s.send_window -= n as i64;
            }
            if s.sent == s.data.len() {
                self.blocked.remove(i);
                self.ok_trailers(id);
            } else {
                i += 1;
            }
        }
    }

    /// A GOAWAY with `code`: the last stream id is the first GOAWAY's, if one was sent.
    fn goaway(&mut self, code: u32, why: &str) {
        let last = *self.goaway_last.get_or_insert(self.last_stream);
        frame::goaway(&mut self.out, last, code, why);
    }

    /// The trailers of an answered call (`grpc-status: 0`), which end its stream.
    fn ok_trailers(&mut self, id: u32) {
        frame::head(
            &mut self.out,
            grpc::OK_TRAILERS.len(),
            kind::HEADERS,
            flag::END_HEADERS | flag::END_STREAM,
            id,
        );
        self.out.extend_from_slice(grpc::OK_TRAILERS);
        self.streams.remove(&id);
    }

    /// A response of headers only: gRPC's Trailers-Only, with a status other than OK; the stream
    /// is done.
    fn trailers_only(&mut self, id: u32, code: i32, message: &str) {
        let mut block = Vec::with_capacity(64 + message.len());
        block.extend_from_slice(grpc::RESPONSE_HEAD);
        grpc::status_fields(&mut block, code, message);
        self.header_frame(id, &block, true);
        self.remove(id);
    }

    /// One header block as HEADERS and, past a frame, CONTINUATIONs.
    fn header_frame(&mut self, id: u32, block: &[u8], end_stream: bool) {
        let mut chunks = block.chunks(MAX_PAYLOAD).peekable();
        let mut first = true;
        while let Some(chunk) = chunks.next() {
            let last = chunks.peek().is_none();
            let (k, mut flags) = if first {
                (kind::HEADERS, if end_stream { flag::END_STREAM } else { 0 })
            } else {
                (kind::CONTINUATION, 0)
            };
            if last {
                flags |= flag::END_HEADERS;
            }
            frame::head(&mut self.out, chunk.len(), k, flags, id);
            self.out.extend_from_slice(chunk);
            first = false;
        }
    }

    /// Ends a stream with RST_STREAM.
    fn reset(&mut self, id: u32, code: u32) {
        frame::rst_stream(&mut self.out, id, code);
        self.remove(id);
    }

    /// Forgets a stream, crediting back its unused bytes.
    fn remove(&mut self, id: u32) {
        if let Some(s) = self.streams.remove(&id) {
            self.uncredited += s.uncredited as i64;
            match s.state {
                State::Receiving => self.receiving -= 1,
                State::Sending => self.blocked.retain(|&b| b != id),
                State::Answering => {}
            }
        }
    }

    /// Gives the client back the window its used bytes took, once they are a quarter of it or the
    /// window is half gone.
    fn credit(&mut self) {
        if self.uncredited >= CONN_WINDOW / 4 || (self.uncredited > 0 && self.recv_window < CONN_WINDOW / 2) {
            frame::window_update(&mut self.out, 0, self.uncredited as u32);
            self.recv_window += self.uncredited;
            self.uncredited = 0;
        }
    }

    /// Resets the requests that did not arrive whole within the frame timeout.
    fn drop_stale(&mut self, now: Instant, frame_timeout: Duration) {
        if self.receiving == 0 {
            return;
        }
        let stale: Vec<u32> = self
            .streams
            .iter()
            .filter(|(_, s)| s.state == State::Receiving && now >= s.opened + frame_timeout)
            .map(|(id, _)| *id)
            .collect();
        for id in stale {
            self.reset(id, code::CANCEL);
        }
    }
}

/// A message with its 5-byte gRPC prefix (`len`: the prefix and the message).
fn message_into(out: &mut Vec<u8>, m: &[u8], len: usize) {
    out.push(0);
    out.extend_from_slice(&((len - 5) as u32).to_be_bytes());
    out.extend_from_slice(m);
}
