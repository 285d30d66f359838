//! The gRPC listeners over a TCP address or a Unix socket, served by the agent's own HTTP/2 (`h2`) or
//! by tonic, each connection holding a slot of its listener's connection cap (past it a connection is
//! closed at once: HTTP/2 has no place for the frames protocol's Error, so the refusal is logged and
//! counted instead).

use std::io;
use std::pin::Pin;
use std::sync::Arc;
use std::task::{Context, Poll};

use tokio::io::{AsyncRead, AsyncWrite, ReadBuf};
use tokio::net::{TcpListener, UnixListener};
use tokio::sync::watch;
use tonic::transport::server::Connected;

use super::penalty::Penalties;
use super::proto::RateLimitServiceServer;
use super::EnvoyService;
use crate::server::{ConnectionCap, Peer};
use floodgate_core::tasks::stopped;

/// A connection and its slot under the cap (freed when tonic drops the connection).
struct Capped<IO> {
    io: IO,
    _slot: crate::server::Slot,
}

impl<IO: AsyncRead + Unpin> AsyncRead for Capped<IO> {
    fn poll_read(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &mut ReadBuf<'_>,
    ) -> Poll<io::Result<()>> {
        Pin::new(&mut self.io).poll_read(cx, buf)
    }
}

impl<IO: AsyncWrite + Unpin> AsyncWrite for Capped<IO> {
    fn poll_write(mut self: Pin<&mut Self>, cx: &mut Context<'_>, buf: &[u8]) -> Poll<io::Result<usize>> {
        Pin::new(&mut self.io).poll_write(cx, buf)
    }
    fn poll_flush(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        Pin::new(&mut self.io).poll_flush(cx)
    }
    fn poll_shutdown(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        Pin::new(&mut self.io).poll_shutdown(cx)
    }
    fn poll_write_vectored(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        bufs: &[io::IoSlice<'_>],
    ) -> Poll<io::Result<usize>> {
        Pin::new(&mut self.io).poll_write_vectored(cx, bufs)
    }
    fn is_write_vectored(&self) -> bool {
        self.io.is_write_vectored()
    }
}

impl<IO: Connected> Connected for Capped<IO> {
    type ConnectInfo = IO::ConnectInfo;
    fn connect_info(&self) -> Self::ConnectInfo {
        self.io.connect_info()
    }
}

/// Accepted connections under the cap, as the stream tonic serves; a peer serving a penalty is
/// closed at once.
fn incoming<L, IO, F, Fut>(
    listener: L,
    cap: ConnectionCap,
    penalties: Arc<Penalties>,
    accept: F,
) -> impl futures::Stream<Item = Result<Capped<IO>, io::Error>>
where
    F: Fn(Arc<L>) -> Fut + Copy,
    Fut: std::future::Future<Output = io::Result<(IO, Peer)>>,
{
    let listener = Arc::new(listener);
    futures::stream::unfold((listener, cap), move |(listener, cap)| {
        let penalties = penalties.clone();
        async move {
            loop {
                match accept(listener.clone()).await {
                    Ok((_, peer)) if penalties.refused(peer, std::time::Instant::now()).is_some() => {
                        floodgate_core::metrics::connection_refused("grpc");
                        let left = penalties
                            .refused(peer, std::time::Instant::now())
                            .unwrap_or_default();
                        crate::server::warn_refused(
                            "grpc",
                            &format!("{peer} spent a connection's budget; refused for {left:?} more"),
                        );
                    }
                    Ok((io, peer)) => match cap.try_acquire(peer) {
                        Ok(slot) => return Some((Ok(Capped { io, _slot: slot }), (listener, cap))),
                        Err(why) => {
                            floodgate_core::metrics::connection_refused("grpc");
                            crate::server::warn_refused("grpc", &cap.refusal_message(why));
                        }
                    },
                    Err(e) => {
                        // A failed accept (out of descriptors, say) must not end the server.
                        tracing::warn!(error = %e, "gRPC accept failed");
                        tokio::time::sleep(std::time::Duration::from_millis(10)).await;
                    }
                }
            }
        }
    })
}

/// GOAWAY's code for a peer that spent a budget (RFC 9113 §7).
const ENHANCE_YOUR_CALM: u32 = 0xb;

/// Which server speaks gRPC.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, clap::ValueEnum)]
pub enum GrpcServer {
    /// Floodgate's own HTTP/2 server (`floodgate-h2`): every stream answered in its connection's task.
    #[default]
    Native,
    /// tonic on hyper: a task per stream.
    Tonic,
    /// The `h2` crate used directly: every stream answered in its connection's task.
    H2,
}

/// How a gRPC listener serves.
#[derive(Clone)]
pub struct GrpcServing {
    /// Which server.
    pub server: GrpcServer,
    /// A frame, or a request's frames, started and not completed within this are dropped (native).
    pub frame_timeout: std::time::Duration,
    /// A connection with no call for this long is closed (native; `--idle-timeout-ms`).
    pub idle_timeout: std::time::Duration,
    /// TLS on this listener (native; `--grpc-tls-cert`).
    pub tls: Option<Arc<super::GrpcTls>>,
}

/// Serves ShouldRateLimit on `listener` until `shutdown`.
pub async fn serve_tcp(
    listener: TcpListener,
    service: Arc<EnvoyService>,
    cap: ConnectionCap,
    serving: GrpcServing,
    shutdown: watch::Receiver<bool>,
) -> Result<(), tonic::transport::Error> {
    let penalties = Arc::new(Penalties::default());
    let stream = incoming(
        listener,
        cap,
        penalties.clone(),
        |l: Arc<TcpListener>| async move {
            let (s, addr) = l.accept().await?;
            let _ = s.set_nodelay(true);
            Ok((s, Peer::Ip(addr.ip())))
        },
    );
    match serving.server {
        GrpcServer::Native | GrpcServer::H2 => {
            native(stream, service, serving, penalties, shutdown).await;
            Ok(())
        }
        GrpcServer::Tonic => run(stream, service, shutdown).await,
    }
}

/// Serves ShouldRateLimit on a Unix socket until `shutdown`.
pub async fn serve_unix(
    listener: UnixListener,
    service: Arc<EnvoyService>,
    cap: ConnectionCap,
    serving: GrpcServing,
    shutdown: watch::Receiver<bool>,
) -> Result<(), tonic::transport::Error> {
    let penalties = Arc::new(Penalties::default());
    let stream = incoming(
        listener,
        cap,
        penalties.clone(),
        |l: Arc<UnixListener>| async move {
            let s = l.accept().await?.0;
            let peer = s.peer_cred().map_or(Peer::Unknown, crate::server::local_peer);
            Ok((s, peer))
        },
    );
    match serving.server {
        GrpcServer::Native | GrpcServer::H2 => {
            native(stream, service, serving, penalties, shutdown).await;
            Ok(())
        }
        GrpcServer::Tonic => run(stream, service, shutdown).await,
    }
}

/// The native server: a task per connection; on `shutdown`, no more accepts, and each connection
/// sends GOAWAY, answers what it has and closes before this returns.
async fn native<IO>(
    stream: impl futures::Stream<Item = Result<Capped<IO>, io::Error>> + Send + 'static,
    service: Arc<EnvoyService>,
    serving: GrpcServing,
    penalties: Arc<Penalties>,
    mut shutdown: watch::Receiver<bool>,
) where
    IO: AsyncRead + AsyncWrite + Unpin + Send + 'static,
{
    use futures::StreamExt;
    let mut stream = std::pin::pin!(stream);
    let mut conns = tokio::task::JoinSet::new();
    let stop = shutdown.clone();
    let calls = Arc::new(super::native::Calls(service.clone()));
    let config = super::native::config(serving.frame_timeout, serving.idle_timeout);
    loop {
        tokio::select! {
            next = stream.next() => match next {
                Some(Ok(io)) => match serving.server {
                    GrpcServer::H2 => {
                        conns.spawn(super::h2_crate::serve(io, service.clone(), serving.frame_timeout, stop.clone()));
                    }
                    GrpcServer::Native | GrpcServer::Tonic => {
                        let (calls, config, stop) = (calls.clone(), config.clone(), stop.clone());
                        let (peer, penalties) = (io._slot.peer(), penalties.clone());
                        match serving.tls.as_ref().map(|t| t.acceptor()) {
                            Some(acceptor) => {
                                let handshake = serving.frame_timeout;
                                conns.spawn(async move {
                                    match tokio::time::timeout(handshake, acceptor.accept(io)).await {
                                        Ok(Ok(tls)) => serve_native(tls, calls, config, stop, peer, penalties).await,
                                        _ => floodgate_core::metrics::connection_closed("grpc_tls"),
                                    }
                                });
                            }
                            None => {
                                conns.spawn(serve_native(io, calls, config, stop, peer, penalties));
                            }
                        }
                    }
                },
                Some(Err(_)) | None => break,
            },
            // Finished connections' results, so the set does not grow.
            Some(_) = conns.join_next(), if !conns.is_empty() => {}
            _ = stopped(&mut shutdown) => break,
        }
    }
    while conns.join_next().await.is_some() {}
}

/// One connection on Floodgate's server; a spent budget is penalized as soon as it is decided.
async fn serve_native<IO>(
    io: IO,
    calls: Arc<super::native::Calls>,
    config: Arc<floodgate_h2::Config>,
    stop: watch::Receiver<bool>,
    peer: Peer,
    penalties: Arc<Penalties>,
) where
    IO: AsyncRead + AsyncWrite + Unpin,
{
    floodgate_h2::serve_reporting(io, calls, config, stop, |ended| match ended {
        floodgate_h2::Ended::Error { code, why } => {
            tracing::debug!(code, why, "closed a gRPC connection");
            if *code == ENHANCE_YOUR_CALM {
                floodgate_core::metrics::connection_closed("grpc_calm");
                penalties.punish(peer, std::time::Instant::now());
            }
        }
        floodgate_h2::Ended::Idle => floodgate_core::metrics::connection_closed("grpc_idle"),
        floodgate_h2::Ended::Closed => {}
    })
    .await;
}

async fn run<IO>(
    stream: impl futures::Stream<Item = Result<Capped<IO>, io::Error>> + Send + 'static,
    service: Arc<EnvoyService>,
    mut shutdown: watch::Receiver<bool>,
) -> Result<(), tonic::transport::Error>
where
    IO: AsyncRead + AsyncWrite + Connected + Unpin + Send + 'static,
{
    // grpc.health.v1, as the native server answers it (tonic-health also serves Watch).
    let (health, health_service) = tonic_health::server::health_reporter();
    health.set_serving::<RateLimitServiceServer<EnvoyService>>().await;
    tonic::transport::Server::builder()
        // A peer that vanished without closing (its node gone) is found and its slot freed.
        .http2_keepalive_interval(Some(std::time::Duration::from_secs(30)))
        .http2_keepalive_timeout(Some(std::time::Duration::from_secs(10)))
        // The native server's budgets where hyper has a knob for them (docs/envoy.md): streams at
        // once, a header list, streams reset before they were served (h2's default, 20), and a
        // stream's answer bytes buffered; hyper has no deadline for an answer held by flow control.
        .max_concurrent_streams(Some(floodgate_h2::MAX_STREAMS as u32))
        .http2_max_header_list_size(Some(floodgate_h2::MAX_HEADER_BLOCK as u32))
        .http2_max_pending_accept_reset_streams(Some(20))
        .initial_connection_window_size(Some(floodgate_h2::CONN_WINDOW as u32))
        .add_service(health_service)
        .add_service(RateLimitServiceServer::from_arc(service))
        .serve_with_incoming_shutdown(stream, async move { stopped(&mut shutdown).await })
        .await
}
