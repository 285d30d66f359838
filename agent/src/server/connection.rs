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

use floodgate_protocol::ErrorCode;

use floodgate_core::engine::Engine;
use floodgate_core::tasks::stopped;

use super::cap::{BufferBudget, Charge, BASE_BUFFER};
use super::frames::{answer, error, process, Pending};

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
    let mut inbound = Inbound::new(budget);
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
        if !closing {
            if let Err(bytes) = inbound.make_room() {
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
            read = rd.read_buf(&mut inbound.buf), if !closing && pending.len() < MAX_IN_FLIGHT => {
                match read {
                    Ok(0) | Err(_) => closing = true,
                    Ok(_) => {
                        if let Some(bytes) = inbound.on_read(&mut out, &mut pending, &engine, &mut peer) {
                            fatal = Some(bytes);
                            closing = true;
                        }
                    }
                }
            }
            _ = &mut stop, if !closing => closing = true,
            _ = &mut timer, if !closing => {
                match inbound.expired(Instant::now(), pending.is_empty(), &limits) {
                    Expiry::FrameLate(bytes) => {
                        fatal = Some(bytes);
                        closing = true;
                    }
                    Expiry::Idle => closing = true,
                    Expiry::Next(next) => timer.as_mut().reset(next.into()),
                }
            }
        }
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

/// The read side of a connection: its buffer (past `BASE_BUFFER`, charged to the agent's budget),
/// when the last bytes came, and since when the frame at the buffer's head has been arriving:
/// checked lazily by one timer, which fires at the earliest a limit could be passed.
struct Inbound {
    buf: Vec<u8>,
    charge: Charge,
    last_read: Instant,
    partial_since: Option<Instant>,
}

impl Inbound {
    fn new(budget: BufferBudget) -> Self {
        Inbound {
            buf: Vec::with_capacity(BASE_BUFFER),
            charge: Charge::new(budget),
            last_read: Instant::now(),
            partial_since: None,
        }
    }

    /// Room for the next read: the rest of the frame at the head (its length is in its prefix),
    /// and at least MIN_READ. Past the base the budget pays, or the connection is refused (this
    /// Error).
    fn make_room(&mut self) -> Result<(), Vec<u8>> {
        let need = frame_len(&self.buf).max(self.buf.len() + MIN_READ);
        if self.buf.capacity() < need {
            if self.charge.cover(need) {
                self.buf.reserve_exact(need - self.buf.len());
            } else {
                return Err(buffers_full(need));
            }
        }
        Ok(())
    }

    /// Bytes arrived: every complete frame handled (`process`), the frame left at the head timed,
    /// the buffer back to its base size once drained; the Error that closes the connection if the
    /// stream broke.
    fn on_read(
        &mut self,
        out: &mut Vec<u8>,
        pending: &mut Pending,
        engine: &Arc<Engine>,
        peer: &mut u8,
    ) -> Option<Vec<u8>> {
        let now = Instant::now();
        self.last_read = now;
        let mut fatal = None;
        match process(&mut self.buf, out, pending, engine, now, peer) {
            Err(bytes) => fatal = Some(bytes),
            // A frame completed: whatever is left is a new frame's head.
            Ok(used) if used > 0 => self.partial_since = (!self.buf.is_empty()).then_some(now),
            Ok(_) => {
                self.partial_since.get_or_insert(now);
            }
        }
        if self.buf.is_empty() && self.buf.capacity() > BASE_BUFFER {
            self.buf = Vec::with_capacity(BASE_BUFFER);
            self.charge.release();
        }
        fatal
    }

    /// The timer fired at `now`: is the frame at the head late, or the connection idle since its
    /// last read with nothing in flight (`idle`), and if neither, when to look again.
    fn expired(&self, now: Instant, idle: bool, limits: &Limits) -> Expiry {
        match self.partial_since {
            Some(since) if now >= since + limits.frame => {
                floodgate_core::metrics::connection_closed("frame_timeout");
                let mut bytes = Vec::new();
                error(
                    &mut bytes,
                    0,
                    ErrorCode::MalformedFrame,
                    format!("a frame was not completed within {:?}; closing", limits.frame),
                );
                Expiry::FrameLate(bytes)
            }
            None if idle && now >= self.last_read + limits.idle => {
                floodgate_core::metrics::connection_closed("idle");
                tracing::debug!("closing a connection idle for {:?}", limits.idle);
                Expiry::Idle
            }
            _ => Expiry::Next(match self.partial_since {
                Some(since) => since + limits.frame,
                None if idle => self.last_read + limits.idle,
                None => now + limits.frame,
            }),
        }
    }
}

/// What the connection's timer means when it fires.
enum Expiry {
    /// The frame at the buffer's head was not completed within the frame timeout: this Error, then
    /// close.
    FrameLate(Vec<u8>),
    /// Nothing read and nothing in flight for the idle timeout: close.
    Idle,
    /// Neither yet: look again then.
    Next(Instant),
}

/// The Error that closes a connection whose next read of `need` bytes the agent's read-buffer
/// budget cannot cover.
fn buffers_full(need: usize) -> Vec<u8> {
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
    bytes
}
