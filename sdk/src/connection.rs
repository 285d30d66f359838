//! The background task that owns the socket: connects and says Hello, writes queued checks in
//! batches, dispatches answers by request id, asks a version-2 agent for its fail-mode list after
//! connecting and every [`FAIL_MODES_EVERY`], and reconnects with backoff.

use std::sync::atomic::Ordering;
use std::sync::Weak;
use std::time::Duration;

use floodgate_protocol::{decode, Body, DecodeError, Frame, MIN_VERSION, VERSION};
use tokio::io::{AsyncRead, AsyncReadExt, AsyncWrite, AsyncWriteExt};
use tokio::net::{TcpStream, UnixStream};
use tokio::sync::{mpsc, oneshot};

use crate::state::{Reply, Shared};

/// How often a connected client asks the agent again which rules fail closed.
pub(crate) const FAIL_MODES_EVERY: Duration = Duration::from_secs(10);

/// Runs until every `Client` clone is dropped.
pub(crate) async fn run(shared: Weak<Shared>, mut rx: mpsc::Receiver<Vec<u8>>, ready: oneshot::Sender<()>) {
    let mut ready = Some(ready);
    let mut backoff = None;
    loop {
        let Some(s) = shared.upgrade() else { return };
        let (path, config) = (s.target(), s.config.clone());
        drop(s);
        match tokio::time::timeout(config.connect_timeout, handshake(&path)).await {
            Ok(Ok((stream, leftover, version))) => {
                let up_since = std::time::Instant::now();
                let Some(s) = shared.upgrade() else { return };
                s.link_up(&path);
                s.connects.fetch_add(1, Ordering::Relaxed);
                s.version.store(version, Ordering::Relaxed);
                s.connected.store(true, Ordering::Release);
                drop(s);
                if let Some(r) = ready.take() {
                    let _ = r.send(());
                }
                let closed = serve(&shared, stream, leftover, version, &mut rx).await;
                if let Some(s) = shared.upgrade() {
                    s.connected.store(false, Ordering::Release);
                    // Dropping the senders tells every waiting call the connection is gone.
                    s.pending().clear();
                }
                if closed {
                    return;
                }
                // Back off afresh only after a connection that lasted: an agent that accepts and
                // then drops every connection must not be hammered every reconnect_min.
                if up_since.elapsed() >= Duration::from_secs(1) {
                    backoff = None;
                }
                tracing::debug!(path = %path.display(), "connection to the agent lost; reconnecting");
            }
            Ok(Err(e)) => {
                let Some(s) = shared.upgrade() else { return };
                s.link_failed(&path, e.to_string());
            }
            Err(_) => {
                let Some(s) = shared.upgrade() else { return };
                s.link_failed(
                    &path,
                    format!("no connection and Hello within {:?}", config.connect_timeout),
                );
            }
        }
        if let Some(r) = ready.take() {
            let _ = r.send(());
        }
        let delay = backoff.map_or(config.reconnect_min, |d: Duration| {
            (d * 2).min(config.reconnect_max)
        });
        backoff = Some(delay);
        let sleep = tokio::time::sleep(delay);
        tokio::pin!(sleep);
        loop {
            tokio::select! {
                _ = &mut sleep => break,
                // Checks queued while disconnected: their callers already hold a fail-policy answer
                // or will when their pending entry is gone.
                msg = rx.recv() => if msg.is_none() { return },
            }
        }
    }
}

type Reader = Box<dyn AsyncRead + Unpin + Send>;
type Writer = Box<dyn AsyncWrite + Unpin + Send>;

/// Connects to `path`: a Unix socket, or `tcp://host:port` for an agent's `--listen-tcp`.
async fn open(path: &std::path::Path) -> std::io::Result<(Reader, Writer)> {
    match path.to_str().and_then(|p| p.strip_prefix("tcp://")) {
        Some(addr) => {
            let stream = TcpStream::connect(addr).await?;
            stream.set_nodelay(true)?;
            let (rd, wr) = stream.into_split();
            Ok((Box::new(rd), Box::new(wr)))
        }
        None => {
            let (rd, wr) = UnixStream::connect(path).await?.into_split();
            Ok((Box::new(rd), Box::new(wr)))
        }
    }
}

/// Connects and says Hello: the streams, what was read past the HelloOk, and the version agreed.
async fn handshake(path: &std::path::Path) -> std::io::Result<((Reader, Writer), Vec<u8>, u8)> {
    let (mut rd, mut wr) = open(path).await?;
    let hello = Frame::new(
        0,
        Body::Hello {
            min_version: MIN_VERSION,
            max_version: VERSION,
        },
    );
    let bytes = hello.to_bytes().map_err(std::io::Error::other)?;
    wr.write_all(&bytes).await?;
    let mut buf = Vec::with_capacity(256);
    loop {
        if rd.read_buf(&mut buf).await? == 0 {
            return Err(std::io::Error::new(
                std::io::ErrorKind::UnexpectedEof,
                "agent closed during Hello",
            ));
        }
        match decode(&buf) {
            Ok((
                Frame {
                    body: Body::HelloOk { version },
                    ..
                },
                used,
            )) => {
                if !(MIN_VERSION..=VERSION).contains(&version) {
                    return Err(std::io::Error::other(format!(
                        "agent chose version {version}; this SDK speaks {MIN_VERSION} to {VERSION}"
                    )));
                }
                buf.drain(..used);
                return Ok(((rd, wr), buf, version));
            }
            Ok((
                Frame {
                    body: Body::Error(e), ..
                },
                _,
            )) => {
                return Err(std::io::Error::other(format!(
                    "agent refused Hello: {}: {}",
                    e.code, e.message
                )))
            }
            Ok(_) => return Err(std::io::Error::other("unexpected answer to Hello")),
            Err(DecodeError::Incomplete) => continue,
            Err(e) => return Err(std::io::Error::other(e.to_string())),
        }
    }
}

/// Serves one connection; returns true when every client handle is gone (stop), false when the
/// connection broke (reconnect).
async fn serve(
    shared: &Weak<Shared>,
    (rd, mut wr): (Reader, Writer),
    leftover: Vec<u8>,
    version: u8,
    rx: &mut mpsc::Receiver<Vec<u8>>,
) -> bool {
    let mut reader = tokio::spawn(read_loop(shared.clone(), rd, leftover));
    let mut batch = Vec::with_capacity(16 * 1024);
    // Asked at once, then every FAIL_MODES_EVERY; a version-1 agent has no list and is never asked.
    let mut ask = (version >= 2).then(|| {
        let mut i = tokio::time::interval(FAIL_MODES_EVERY);
        i.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
        i
    });
    let closed = loop {
        tokio::select! {
            () = tick(&mut ask) => {
                let Some(s) = shared.upgrade() else { break true };
                let id = s.next_id();
                drop(s);
                let bytes = Frame::new(id, Body::FailModes).to_bytes().expect("an empty body encodes");
                if wr.write_all(&bytes).await.is_err() {
                    break false;
                }
            }
            msg = rx.recv() => {
                let Some(first) = msg else { break true };
                batch.clear();
                batch.extend_from_slice(&first);
                // Coalesce whatever else is queued into one write.
                while batch.len() < 64 * 1024 {
                    match rx.try_recv() {
                        Ok(more) => batch.extend_from_slice(&more),
                        Err(_) => break,
                    }
                }
                if wr.write_all(&batch).await.is_err() {
                    break false;
                }
            }
            _ = &mut reader => break false,
        }
    };
    reader.abort();
    closed
}

/// The next tick of `ask`; never, without one.
async fn tick(ask: &mut Option<tokio::time::Interval>) {
    match ask {
        Some(i) => {
            i.tick().await;
        }
        None => std::future::pending().await,
    }
}

async fn read_loop(shared: Weak<Shared>, mut rd: Reader, mut buf: Vec<u8>) {
    loop {
        let mut pos = 0;
        loop {
            match decode(&buf[pos..]) {
                Ok((frame, used)) => {
                    pos += used;
                    let Some(s) = shared.upgrade() else { return };
                    let reply = match frame.body {
                        Body::Decision(d) => Reply::Decision(d),
                        Body::Error(e) => Reply::Error(e),
                        Body::FailModeList(list) => {
                            s.learn_fail_modes(list);
                            continue;
                        }
                        _ => continue,
                    };
                    let waiter = s.pending().remove(&frame.request_id);
                    if let Some(w) = waiter {
                        let _ = w.send(reply);
                    }
                }
                Err(DecodeError::Incomplete) => break,
                Err(DecodeError::Rejected {
                    frame_len,
                    request_id,
                    ..
                }) => {
                    // An answer this SDK cannot read (bad text): its call answers by its fail policy
                    // now instead of waiting out its timeout.
                    pos += frame_len;
                    if let Some(s) = shared.upgrade() {
                        s.pending().remove(&request_id);
                    }
                }
                Err(e) => {
                    tracing::warn!(error = %e, "agent sent a broken frame; reconnecting");
                    return;
                }
            }
        }
        buf.drain(..pos);
        if buf.capacity() - buf.len() < 4096 {
            buf.reserve(16 * 1024);
        }
        match rd.read_buf(&mut buf).await {
            Ok(0) | Err(_) => return,
            Ok(_) => {}
        }
    }
}
