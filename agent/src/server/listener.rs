//! The frames listeners' accept loop: each connection is taken under the listener's cap and its
//! peer's share (else told why with an Error 7 and closed), then served until it ends or shutdown.

use std::io;
use std::sync::Arc;

use tokio::io::AsyncWriteExt;
use tokio::net::{TcpListener, TcpStream, UnixListener, UnixStream};
use tokio::sync::watch;

use floodgate_core::engine::Engine;
use floodgate_core::tasks::stopped;
use floodgate_protocol::ErrorCode;

use super::cap::BufferBudget;
use super::connection::{connection, Limits, WRITE_TIMEOUT};
use super::frames::error;
use floodgate_core::admission::{warn_refused, ConnectionCap, Peer};

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

    async fn accept(&self) -> io::Result<(Stream, Peer)> {
        Ok(match self {
            Listener::Unix(l) => {
                let s = l.accept().await?.0;
                let peer = s.peer_cred().map_or(Peer::Unknown, crate::server::local_peer);
                (Stream::Unix(s), peer)
            }
            Listener::Tcp(l) => {
                let (s, addr) = l.accept().await?;
                // Answers are small and latency is the point: no Nagle delay.
                let _ = s.set_nodelay(true);
                (Stream::Tcp(s), Peer::Ip(addr.ip()))
            }
        })
    }
}

impl Stream {
    async fn serve(
        self,
        engine: Arc<Engine>,
        limits: Limits,
        budget: BufferBudget,
        shutdown: watch::Receiver<bool>,
    ) {
        match self {
            Stream::Unix(s) => {
                let (rd, wr) = s.into_split();
                connection(rd, wr, engine, limits, budget, shutdown).await
            }
            Stream::Tcp(s) => {
                let (rd, wr) = s.into_split();
                connection(rd, wr, engine, limits, budget, shutdown).await
            }
        }
    }

    /// Tells a refused connection why it is closed: an Error frame (overloaded, request id 0).
    async fn refuse(self, message: String) {
        let mut bytes = Vec::new();
        error(&mut bytes, 0, ErrorCode::Overloaded, message);
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

/// What one listener serves under: its cap (with the per-peer share), the connections' timeouts,
/// and the read-buffer budget the agent's frames listeners share.
#[derive(Debug, Clone)]
pub struct Serving {
    /// Open connections: the cap and each peer's share.
    pub cap: ConnectionCap,
    /// Idle and frame timeouts.
    pub limits: Limits,
    /// Read-buffer bytes past the base, shared with the other frames listener.
    pub budget: BufferBudget,
}

/// Accepts connections until `shutdown` turns true, then lets open connections answer what they have
/// in flight and returns. A connection past the cap, or past its peer's share of it, gets an Error
/// (code 7, overloaded) saying which, and is closed.
pub async fn serve(
    listener: Listener,
    engine: Arc<Engine>,
    serving: Serving,
    mut shutdown: watch::Receiver<bool>,
) {
    let Serving { cap, limits, budget } = serving;
    let mut tasks = tokio::task::JoinSet::new();
    loop {
        tokio::select! {
            accepted = listener.accept() => match accepted {
                Ok((stream, peer)) => match cap.try_acquire(peer) {
                    Ok(slot) => {
                        let (engine, shutdown, budget) = (engine.clone(), shutdown.clone(), budget.clone());
                        tasks.spawn(async move {
                            stream.serve(engine, limits, budget, shutdown).await;
                            drop(slot);
                        });
                    }
                    Err(why) => {
                        let message = cap.refusal_message(why);
                        floodgate_core::metrics::connection_refused(listener.name());
                        warn_refused(listener.name(), &message);
                        tasks.spawn(stream.refuse(message));
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
