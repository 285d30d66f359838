//! The frames server: binds the Unix socket safely, listens on TCP where asked, and serves pipelined
//! connections (many request ids in flight, answers written as they complete) under a connection
//! cap per listener.

use std::io;
use std::os::unix::fs::{DirBuilderExt, FileTypeExt, PermissionsExt};
use std::path::Path;
use std::sync::Arc;

use futures::stream::{FuturesUnordered, StreamExt};
use tokio::io::{AsyncRead, AsyncReadExt, AsyncWrite, AsyncWriteExt};
use tokio::net::{TcpListener, TcpStream, UnixListener, UnixStream};
use tokio::sync::{watch, OwnedSemaphorePermit, Semaphore};

use floodgate_protocol::{decode, Body, DecodeError, ErrorBody, ErrorCode, Frame, VERSION};

use floodgate_core::engine::{Answer, Engine};
use floodgate_core::tasks::stopped;

/// Most checks one connection may have waiting on the store; past it the agent stops reading that
/// connection until answers drain (backpressure instead of unbounded memory).
pub const MAX_IN_FLIGHT: usize = 4096;

/// Longest the agent waits for a client to take its answers; a client that stops reading is
/// disconnected instead of pinning a task and its in-flight checks.
pub const WRITE_TIMEOUT: std::time::Duration = std::time::Duration::from_secs(1);

/// Binds the agent socket at `path` with file mode `mode`.
///
/// A socket file left by a crashed agent (nobody accepts on it) is replaced; a live agent's socket is
/// never taken over, and a path that is not a socket is never removed.
pub fn bind(path: &Path, mode: u32) -> io::Result<UnixListener> {
    if let Ok(meta) = std::fs::symlink_metadata(path) {
        if !meta.file_type().is_socket() {
            return Err(io::Error::new(
                io::ErrorKind::AlreadyExists,
                format!(
                    "{} exists and is not a socket; refusing to replace it",
                    path.display()
                ),
            ));
        }
        match std::os::unix::net::UnixStream::connect(path) {
            Ok(_) => {
                return Err(io::Error::new(
                    io::ErrorKind::AddrInUse,
                    format!("{} is served by a live agent", path.display()),
                ))
            }
            Err(_) => {
                tracing::info!(socket = %path.display(), "replacing a stale socket file");
                std::fs::remove_file(path)?;
            }
        }
    }
    // Bind inside a private (0700) directory next to the target, set the mode, then rename into place:
    // the socket appears at its path already with its final mode, so no peer can connect through a
    // wider umask-derived mode in between.
    let parent = path
        .parent()
        .filter(|p| !p.as_os_str().is_empty())
        .unwrap_or(Path::new("."));
    let staging = parent.join(format!(".floodgate-bind-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&staging);
    std::fs::DirBuilder::new().mode(0o700).create(&staging)?;
    let staged = staging.join("s");
    let result = (|| {
        let listener = UnixListener::bind(&staged)?;
        std::fs::set_permissions(&staged, std::fs::Permissions::from_mode(mode))?;
        std::fs::rename(&staged, path)?;
        Ok(listener)
    })();
    let _ = std::fs::remove_dir_all(&staging);
    result
}

/// Most connections one listener holds open by default (each costs a task and its buffers, about
/// 10 KiB idle; a host's services need far fewer, an accept loop gone wrong far more).
pub const DEFAULT_MAX_CONNECTIONS: usize = 4_096;

/// A listener's cap on open connections (each of the Unix socket, TCP and gRPC listeners has one).
#[derive(Debug, Clone)]
pub struct ConnectionCap {
    slots: Arc<Semaphore>,
    max: usize,
}

impl ConnectionCap {
    /// At most `max` connections at once (at least 1).
    pub fn new(max: usize) -> Self {
        let max = max.max(1);
        ConnectionCap {
            slots: Arc::new(Semaphore::new(max)),
            max,
        }
    }

    /// A slot for one more connection, held until it closes; `None` when the cap is reached.
    pub fn try_acquire(&self) -> Option<OwnedSemaphorePermit> {
        self.slots.clone().try_acquire_owned().ok()
    }

    /// The cap.
    pub fn max(&self) -> usize {
        self.max
    }
}

/// Logs a connection refused at the cap, at most once every 10 s (a client reconnecting in a loop
/// must not flood the log; `floodgate_connections_refused_total` counts them all).
pub fn warn_refused(listener: &'static str, max: usize) {
    static LAST: std::sync::atomic::AtomicU64 = std::sync::atomic::AtomicU64::new(0);
    let now = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map_or(0, |d| d.as_secs());
    let last = LAST.load(std::sync::atomic::Ordering::Relaxed);
    if now >= last + 10
        && LAST
            .compare_exchange(
                last,
                now,
                std::sync::atomic::Ordering::Relaxed,
                std::sync::atomic::Ordering::Relaxed,
            )
            .is_ok()
    {
        tracing::warn!(
            listener,
            max,
            "connection refused: the agent holds its maximum of connections (--max-connections)"
        );
    }
}

/// Where the frames protocol is served.
pub enum Listener {
    /// The Unix socket (the SDK's default).
    Unix(UnixListener),
    /// TCP (`--listen-tcp`), for clients that cannot mount the socket.
    Tcp(TcpListener),
}

enum Stream {
    Unix(UnixStream),
    Tcp(TcpStream),
}

impl Listener {
    fn name(&self) -> &'static str {
        match self {
            Listener::Unix(_) => "unix",
            Listener::Tcp(_) => "tcp",
        }
    }

    async fn accept(&self) -> io::Result<Stream> {
        Ok(match self {
            Listener::Unix(l) => Stream::Unix(l.accept().await?.0),
            Listener::Tcp(l) => {
                let (s, _) = l.accept().await?;
                // Answers are small and latency is the point: no Nagle delay.
                let _ = s.set_nodelay(true);
                Stream::Tcp(s)
            }
        })
    }
}

impl Stream {
    async fn serve(self, engine: Arc<Engine>, shutdown: watch::Receiver<bool>) {
        match self {
            Stream::Unix(s) => {
                let (rd, wr) = s.into_split();
                connection(rd, wr, engine, shutdown).await
            }
            Stream::Tcp(s) => {
                let (rd, wr) = s.into_split();
                connection(rd, wr, engine, shutdown).await
            }
        }
    }

    /// Tells a connection past the cap why it is closed: an Error frame (overloaded, request id 0).
    async fn refuse(self, max: usize) {
        let mut bytes = Vec::new();
        error(
            &mut bytes,
            0,
            ErrorCode::Overloaded,
            format!("the agent holds its maximum of {max} connections; try again later"),
        );
        let write = async {
            match self {
                Stream::Unix(mut s) => {
                    s.write_all(&bytes).await?;
                    s.shutdown().await
                }
                Stream::Tcp(mut s) => {
                    s.write_all(&bytes).await?;
                    s.shutdown().await
                }
            }
        };
        let _ = tokio::time::timeout(WRITE_TIMEOUT, write).await;
    }
}

/// Accepts connections until `shutdown` turns true, then lets open connections answer what they have
/// in flight and returns. Past the cap, a new connection gets an Error (code 7, overloaded) and is
/// closed.
pub async fn serve(
    listener: Listener,
    engine: Arc<Engine>,
    cap: ConnectionCap,
    mut shutdown: watch::Receiver<bool>,
) {
    let mut tasks = tokio::task::JoinSet::new();
    loop {
        tokio::select! {
            accepted = listener.accept() => match accepted {
                Ok(stream) => match cap.try_acquire() {
                    Some(slot) => {
                        let (engine, shutdown) = (engine.clone(), shutdown.clone());
                        tasks.spawn(async move {
                            stream.serve(engine, shutdown).await;
                            drop(slot);
                        });
                    }
                    None => {
                        floodgate_core::metrics::connection_refused(listener.name());
                        warn_refused(listener.name(), cap.max());
                        tasks.spawn(stream.refuse(cap.max()));
                    }
                },
                Err(e) => {
                    tracing::warn!(error = %e, "accept failed");
                    tokio::time::sleep(std::time::Duration::from_millis(10)).await;
                }
            },
            _ = stopped(&mut shutdown) => break,
            Some(_) = tasks.join_next(), if !tasks.is_empty() => {}
        }
    }
    // Connections see the same signal, finish their in-flight checks and close.
    let drain = async { while tasks.join_next().await.is_some() {} };
    if tokio::time::timeout(std::time::Duration::from_secs(2), drain)
        .await
        .is_err()
    {
        tracing::warn!("connections still open after 2 s of shutdown; closing them");
    }
}

/// Serves one connection: decodes frames as they arrive, answers each request id when its check
/// completes. Frame-level garbage gets an Error and the connection is closed; a refused item gets an
/// Error for its request id and the connection goes on.
pub async fn connection<R, W>(mut rd: R, mut wr: W, engine: Arc<Engine>, mut shutdown: watch::Receiver<bool>)
where
    R: AsyncRead + Unpin,
    W: AsyncWrite + Unpin,
{
    let mut inbuf: Vec<u8> = Vec::with_capacity(4 * 1024);
    let mut out: Vec<u8> = Vec::with_capacity(4 * 1024);
    let mut pending = FuturesUnordered::new();
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
                Ok(Ok(())) => out.clear(),
                _ => return,
            }
        }
        if closing && pending.is_empty() {
            let _ = wr.shutdown().await;
            return;
        }
        if inbuf.capacity() - inbuf.len() < 4096 {
            inbuf.reserve(16 * 1024);
        }
        // Polled in this order (no random start, which costs a random number per turn): answers
        // first, since they drain (at most MAX_IN_FLIGHT wait), so a client that keeps sending
        // cannot hold its own answers back.
        tokio::select! {
            biased;
            Some((id, result)) = pending.next(), if !pending.is_empty() => {
                answer(&mut out, id, result);
                // Collect whatever else is ready so one write carries many answers.
                while let Some(Some((id, result))) = futures::FutureExt::now_or_never(pending.next()) {
                    answer(&mut out, id, result);
                }
            }
            read = rd.read_buf(&mut inbuf), if !closing && pending.len() < MAX_IN_FLIGHT => {
                match read {
                    Ok(0) | Err(_) => closing = true,
                    Ok(_) => {
                        if let Err(bytes) = process(&mut inbuf, &mut out, &mut pending, &engine) {
                            fatal = Some(bytes);
                            closing = true;
                        }
                    }
                }
            }
            _ = &mut stop, if !closing => closing = true,
        }
    }
}

type Pending = FuturesUnordered<InFlight>;

/// A check waiting on the store: the engine's future with its request id and start time (no box of
/// its own around the engine's).
struct InFlight {
    id: u32,
    start: Option<std::time::Instant>,
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
        let result = std::task::ready!(self.answer.as_mut().poll(cx));
        if let Some(start) = self.start {
            floodgate_core::metrics::check(&result, start.elapsed());
        }
        std::task::Poll::Ready((self.id, result))
    }
}

/// Handles every complete frame in `inbuf`. Returns the encoded fatal Error when the stream is broken.
fn process(
    inbuf: &mut Vec<u8>,
    out: &mut Vec<u8>,
    pending: &mut Pending,
    engine: &Arc<Engine>,
) -> Result<(), Vec<u8>> {
    let mut pos = 0;
    let result = loop {
        match decode(&inbuf[pos..]) {
            Ok((frame, used)) => {
                pos += used;
                handle(frame, out, pending, engine);
            }
            Err(DecodeError::Incomplete) => break Ok(()),
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

fn handle(frame: Frame, out: &mut Vec<u8>, pending: &mut Pending, engine: &Arc<Engine>) {
    let id = frame.request_id;
    match frame.body {
        Body::Check(check) => {
            // Timed only when metrics are on (a clock read per check otherwise saved).
            let start = floodgate_core::metrics::on().then(std::time::Instant::now);
            match engine.check(check) {
                Answer::Ready(result) => {
                    if let Some(start) = start {
                        floodgate_core::metrics::check(&result, start.elapsed());
                    }
                    answer(out, id, result)
                }
                Answer::Pending(answer) => pending.push(InFlight { id, start, answer }),
            }
        }
        Body::Hello {
            min_version,
            max_version,
        } => {
            if (min_version..=max_version).contains(&VERSION) {
                encode(out, Frame::new(id, Body::HelloOk { version: VERSION }));
            } else {
                error(
                    out,
                    id,
                    ErrorCode::UnsupportedVersion,
                    format!("client speaks {min_version}..={max_version}; this agent speaks {VERSION}"),
                );
            }
        }
        Body::Ping => encode(out, Frame::new(id, Body::Pong)),
        _ => error(
            out,
            id,
            ErrorCode::UnexpectedFrame,
            "only Hello, Check and Ping go to an agent".into(),
        ),
    }
}

fn answer(out: &mut Vec<u8>, id: u32, result: Result<floodgate_protocol::Decision, ErrorBody>) {
    match result {
        Ok(d) => encode(out, Frame::new(id, Body::Decision(d))),
        Err(e) => encode(out, Frame::new(id, Body::Error(e))),
    }
}

fn error(out: &mut Vec<u8>, id: u32, code: ErrorCode, message: String) {
    encode(out, Frame::new(id, Body::Error(ErrorBody { code, message })));
}

fn encode(out: &mut Vec<u8>, frame: Frame) {
    if let Err(e) = frame.encode(out) {
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
