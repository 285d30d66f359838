//! One frames connection: decode every complete frame as it arrives, answer at once what the
//! engine answers at once, keep store-bound checks in flight (pipelined, many request ids) and write
//! answers as they complete. A connection that holds nothing in flight for the idle timeout is
//! closed, a frame not completed within the frame timeout closes it with an Error, and its read
//! buffer past 8 KiB is charged to the agent's budget and given back once drained.

use std::sync::Arc;
use std::time::{Duration, Instant};

use futures::stream::{FuturesUnordered, StreamExt};
use tokio::io::{AsyncRead, AsyncReadExt, AsyncWrite, AsyncWriteExt};
use tokio::sync::watch;

use floodgate_protocol::{decode, Body, DecodeError, ErrorBody, ErrorCode, Frame, MIN_VERSION, VERSION};

use floodgate_core::engine::{Answer, Engine};
use floodgate_core::tasks::stopped;

use super::cap::{BufferBudget, Charge, BASE_BUFFER};

/// Most checks one connection may have waiting on the store; past it the agent stops reading that
/// connection until answers drain (backpressure instead of unbounded memory).
pub const MAX_IN_FLIGHT: usize = 4096;

/// Longest the agent waits for a client to take its answers; a client that stops reading is
/// disconnected instead of pinning a task and its in-flight checks.
pub const WRITE_TIMEOUT: Duration = Duration::from_secs(1);

/// A connection with nothing in flight and nothing sent for this long is closed: 5 minutes. An SDK
/// keeps one connection per process and reconnects in the background within ~10 ms when it closes,
/// so this only frees the slots of clients that went quiet (or hold connections to starve others).
pub const DEFAULT_IDLE_TIMEOUT: Duration = Duration::from_secs(300);

/// A frame whose first bytes arrived must be complete within this: 2 s. A whole 64 KiB frame takes
/// microseconds on a local socket and milliseconds across a node; a client that sends a frame's
/// head and stops is holding a buffer (and a slot) for nothing.
pub const DEFAULT_FRAME_TIMEOUT: Duration = Duration::from_secs(2);

/// The least room a read gets in the buffer.
const MIN_READ: usize = 1024;

/// An answer buffer past this after a write (a burst of answers to a deep pipeline) is given back.
const OUT_KEEP: usize = 64 * 1024;

/// A connection's timeouts.
#[derive(Debug, Clone, Copy)]
pub struct Limits {
    /// Nothing in flight and nothing read for this long: closed.
    pub idle: Duration,
    /// A frame started and not completed within this: closed with an Error.
    pub frame: Duration,
}

impl Default for Limits {
    fn default() -> Self {
        Limits {
            idle: DEFAULT_IDLE_TIMEOUT,
            frame: DEFAULT_FRAME_TIMEOUT,
        }
    }
}

/// Serves one connection: decodes frames as they arrive, answers each request id when its check
/// completes. Frame-level garbage gets an Error and the connection is closed; a refused item gets an
/// Error for its request id and the connection goes on.
pub async fn connection<R, W>(
    mut rd: R,
    mut wr: W,
    engine: Arc<Engine>,
    limits: Limits,
    budget: BufferBudget,
    mut shutdown: watch::Receiver<bool>,
) where
    R: AsyncRead + Unpin,
    W: AsyncWrite + Unpin,
{
    let mut inbuf: Vec<u8> = Vec::with_capacity(BASE_BUFFER);
    let mut charge = Charge::new(budget);
    // When the last bytes came, and since when the frame at the buffer's head has been arriving:
    // checked lazily by one timer, which fires at the earliest a limit could be passed.
    let mut last_read = Instant::now();
    let mut partial_since: Option<Instant> = None;
    let timer = tokio::time::sleep(limits.frame.min(limits.idle));
    tokio::pin!(timer);
    let mut out: Vec<u8> = Vec::with_capacity(4 * 1024);
    let mut pending = FuturesUnordered::new();
    // The version the client's Hello settled (1 without one): what its decisions may carry.
    let mut peer: u8 = 1;
    let mut closing = false;
    // The Error to send last when the stream broke: in-flight checks are answered first, since their
    // costs may already be committed.
    let mut fatal: Option<Vec<u8>> = None;
    // One wait for shutdown for the connection's life (it wakes an idle connection), not one per
    // loop turn: each new wait reads the watch and registers with (and on drop unregisters from,
    // under a lock) its notifier, ~550 instructions a check. The select below polls it last, so a
    // client that keeps its socket readable would never let it run: each turn also looks at the
    // watch's version (one atomic load; it only ever turns true, and a dropped sender means
    // shutdown too).
    let peek = shutdown.clone();
    closing |= *peek.borrow();
    let stop = stopped(&mut shutdown);
    tokio::pin!(stop);
    loop {
        if !closing && peek.has_changed().unwrap_or(true) {
            closing = true;
        }
        if closing && pending.is_empty() {
            if let Some(bytes) = fatal.take() {
                out.extend_from_slice(&bytes);
            }
        }
        if !out.is_empty() {
            match tokio::time::timeout(WRITE_TIMEOUT, wr.write_all(&out)).await {
                Ok(Ok(())) if out.capacity() > OUT_KEEP => out = Vec::with_capacity(4 * 1024),
                Ok(Ok(())) => out.clear(),
                _ => return,
            }
        }
        if closing && pending.is_empty() {
            let _ = wr.shutdown().await;
            return;
        }
        // Room for the next read: the rest of the frame at the head (its length is in its prefix),
        // and at least MIN_READ. Past the base the budget pays, or the connection is refused.
        let need = frame_len(&inbuf).max(inbuf.len() + MIN_READ);
        if inbuf.capacity() < need && !closing {
            if charge.cover(need) {
                inbuf.reserve_exact(need - inbuf.len());
            } else {
                floodgate_core::metrics::connection_closed("buffers");
                let mut bytes = Vec::new();
                error(
                    &mut bytes,
                    0,
                    ErrorCode::Overloaded,
                    format!(
                        "the agent's buffers for frames still arriving are full ({} MiB); a frame of {need} bytes cannot be read now",
                        super::cap::BUFFER_BUDGET >> 20
                    ),
                );
                fatal = Some(bytes);
                closing = true;
                continue;
            }
        }
        // Polled in this order (no random start, which costs a random number per turn): answers
        // first, since they drain (at most MAX_IN_FLIGHT wait), so a client that keeps sending
        // cannot hold its own answers back.
        tokio::select! {
            biased;
            Some((id, result)) = pending.next(), if !pending.is_empty() => {
                answer(&mut out, id, result, peer);
                // Collect whatever else is ready so one write carries many answers.
                while let Some(Some((id, result))) = futures::FutureExt::now_or_never(pending.next()) {
                    answer(&mut out, id, result, peer);
                }
            }
            read = rd.read_buf(&mut inbuf), if !closing && pending.len() < MAX_IN_FLIGHT => {
                match read {
                    Ok(0) | Err(_) => closing = true,
                    Ok(_) => {
                        let now = Instant::now();
                        last_read = now;
                        match process(&mut inbuf, &mut out, &mut pending, &engine, now, &mut peer) {
                            Err(bytes) => {
                                fatal = Some(bytes);
                                closing = true;
                            }
                            // A frame completed: whatever is left is a new frame's head.
                            Ok(used) if used > 0 => partial_since = (!inbuf.is_empty()).then_some(now),
                            Ok(_) => {
                                partial_since.get_or_insert(now);
                            }
                        }
                        if inbuf.is_empty() && inbuf.capacity() > BASE_BUFFER {
                            inbuf = Vec::with_capacity(BASE_BUFFER);
                            charge.release();
                        }
                    }
                }
            }
            _ = &mut stop, if !closing => closing = true,
            _ = &mut timer, if !closing => {
                let now = Instant::now();
                match partial_since {
                    Some(since) if now >= since + limits.frame => {
                        floodgate_core::metrics::connection_closed("frame_timeout");
                        let mut bytes = Vec::new();
                        error(
                            &mut bytes,
                            0,
                            ErrorCode::MalformedFrame,
                            format!("a frame was not completed within {:?}; closing", limits.frame),
                        );
                        fatal = Some(bytes);
                        closing = true;
                    }
                    None if pending.is_empty() && now >= last_read + limits.idle => {
                        floodgate_core::metrics::connection_closed("idle");
                        tracing::debug!("closing a connection idle for {:?}", limits.idle);
                        closing = true;
                    }
                    _ => {
                        let next = match partial_since {
                            Some(since) => since + limits.frame,
                            None if pending.is_empty() => last_read + limits.idle,
                            None => now + limits.frame,
                        };
                        timer.as_mut().reset(next.into());
                    }
                }
            }
        }
    }
}

type Pending = FuturesUnordered<InFlight>;

/// A check waiting on the store: the engine's future with its request id and start time (no box of
/// its own around the engine's).
struct InFlight {
    id: u32,
    start: Option<std::time::Instant>,
    /// Which items are charges (never counted as rejections; `metrics::charges`).
    charges: u32,
    /// The check's trace span, when traces are on and it is sampled.
    span: Option<Box<crate::otel::SpanStart>>,
    answer: std::pin::Pin<
        Box<dyn std::future::Future<Output = Result<floodgate_protocol::Decision, ErrorBody>> + Send>,
    >,
}

impl std::future::Future for InFlight {
    type Output = (u32, Result<floodgate_protocol::Decision, ErrorBody>);

    fn poll(
        mut self: std::pin::Pin<&mut Self>,
        cx: &mut std::task::Context<'_>,
    ) -> std::task::Poll<Self::Output> {
        // A traced check names its span to the store call it may join (`call_trace`).
        let result = match self.span.as_ref().map(|s| s.name()) {
            Some(name) => std::task::ready!(floodgate_core::call_trace::poll_named(name, || self
                .answer
                .as_mut()
                .poll(cx))),
            None => std::task::ready!(self.answer.as_mut().poll(cx)),
        };
        if let Some(start) = self.start {
            floodgate_core::metrics::check_charged(&result, start.elapsed(), self.charges);
        }
        if let Some(span) = self.span.take() {
            let wait = span.elapsed();
            crate::otel::end_check(
                *span,
                "frames",
                result.as_ref().map(Some).map_err(|e| e.message.as_str()),
                Some(wait),
            );
        }
        std::task::Poll::Ready((self.id, result))
    }
}

/// The whole length of the frame at the head of `buf`, once its length prefix is there (0 before).
fn frame_len(buf: &[u8]) -> usize {
    match buf.get(..4) {
        Some(prefix) => 4 + u32::from_be_bytes(prefix.try_into().expect("4 bytes")) as usize,
        None => 0,
    }
    .min(floodgate_protocol::MAX_FRAME)
}

/// Handles every complete frame in `inbuf`: the bytes consumed, or the encoded fatal Error when the
/// stream is broken.
fn process(
    inbuf: &mut Vec<u8>,
    out: &mut Vec<u8>,
    pending: &mut Pending,
    engine: &Arc<Engine>,
    received: Instant,
    peer: &mut u8,
) -> Result<usize, Vec<u8>> {
    let mut pos = 0;
    let result = loop {
        match decode(&inbuf[pos..]) {
            Ok((frame, used)) => {
                pos += used;
                handle(frame, out, pending, engine, received, peer);
            }
            Err(DecodeError::Incomplete) => break Ok(pos),
            Err(DecodeError::Rejected {
                code,
                request_id,
                reason,
                frame_len,
            }) => {
                pos += frame_len;
                floodgate_core::metrics::check_error();
                error(out, request_id, code, reason);
            }
            Err(DecodeError::Fatal {
                code,
                request_id,
                reason,
            }) => {
                tracing::debug!(%code, %reason, "closing a connection that sent a bad frame");
                let mut bytes = Vec::new();
                error(&mut bytes, request_id.unwrap_or(0), code, reason);
                break Err(bytes);
            }
            Err(other) => {
                let mut bytes = Vec::new();
                error(&mut bytes, 0, ErrorCode::MalformedFrame, other.to_string());
                break Err(bytes);
            }
        }
    };
    inbuf.drain(..pos);
    result
}

fn handle(
    frame: Frame,
    out: &mut Vec<u8>,
    pending: &mut Pending,
    engine: &Arc<Engine>,
    received: Instant,
    peer: &mut u8,
) {
    let id = frame.request_id;
    let trace = frame.trace;
    match frame.body {
        Body::Check(check) => {
            // Off, one atomic load.
            let span = if crate::otel::enabled() {
                crate::otel::start_check(trace)
            } else {
                None
            };
            // The check's time runs from its frame's read (one clock read per read, not per check):
            // the store's budget and the metric's duration both.
            let start = floodgate_core::metrics::on().then_some(received);
            let charges = if start.is_some() {
                floodgate_core::metrics::charges(&check)
            } else {
                0
            };
            match engine.check_received(check, received) {
                Answer::Ready(result) => {
                    if let Some(start) = start {
                        floodgate_core::metrics::check_charged(&result, start.elapsed(), charges);
                    }
                    if let Some(span) = span {
                        crate::otel::end_check(
                            *span,
                            "frames",
                            result.as_ref().map(Some).map_err(|e| e.message.as_str()),
                            None,
                        );
                    }
                    answer(out, id, result, *peer)
                }
                Answer::Pending(answer) => pending.push(InFlight {
                    id,
                    start,
                    charges,
                    span,
                    answer,
                }),
            }
        }
        Body::Hello {
            min_version,
            max_version,
        } => {
            // The highest version both speak.
            let version = max_version.min(VERSION);
            if version >= min_version.max(MIN_VERSION) {
                *peer = version;
                encode(out, Frame::new(id, Body::HelloOk { version }));
            } else {
                error(
                    out,
                    id,
                    ErrorCode::UnsupportedVersion,
                    format!(
                        "client speaks {min_version}..={max_version}; this agent speaks {MIN_VERSION}..={VERSION}"
                    ),
                );
            }
        }
        Body::Ping => encode(out, Frame::new(id, Body::Pong)),
        Body::FailModes => {
            let list = floodgate_core::rules::fail_mode_list(&engine.rules());
            encode(out, Frame::new(id, Body::FailModeList(list)));
        }
        _ => error(
            out,
            id,
            ErrorCode::UnexpectedFrame,
            "only Hello, Check, Ping and FailModes go to an agent".into(),
        ),
    }
}

fn answer(out: &mut Vec<u8>, id: u32, result: Result<floodgate_protocol::Decision, ErrorBody>, peer: u8) {
    match result {
        Ok(d) => encode_for(out, Frame::new(id, Body::Decision(d)), peer),
        Err(e) => encode(out, Frame::new(id, Body::Error(e))),
    }
}

pub(super) fn error(out: &mut Vec<u8>, id: u32, code: ErrorCode, message: String) {
    encode(out, Frame::new(id, Body::Error(ErrorBody { code, message })));
}

fn encode(out: &mut Vec<u8>, frame: Frame) {
    encode_for(out, frame, 1);
}

/// Encodes a frame in the form a peer of version `peer` reads.
fn encode_for(out: &mut Vec<u8>, frame: Frame, peer: u8) {
    if let Err(e) = frame.encode_for(out, peer) {
        // Only a decision with more items than the protocol allows can fail; the engine caps items
        // at MAX_ITEMS, so this is a bug: say so to the client instead of dropping the request.
        tracing::error!(error = %e, "could not encode an answer");
        let _ = Frame::new(
            frame.request_id,
            Body::Error(ErrorBody {
                code: ErrorCode::Internal,
                message: e.to_string(),
            }),
        )
        .encode(out);
    }
}
