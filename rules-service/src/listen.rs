//! Serving an axum router over TCP (or TLS) with a connection cap, a per-peer share of it, and
//! header, idle and whole-request timeouts: the rules service, and the agent's admin and embedded
//! rules APIs, all serve through [`serve`].
//!
//! Without these, 1,100 half-sent requests kept authenticated operators out of `rules-server` for
//! over a minute, and the agent's HTTP listeners could take every file descriptor the agent has.

use std::future::Future;
use std::sync::Arc;
use std::time::Duration;

use axum::extract::Request;
use axum::http::{header, StatusCode};
use axum::middleware::Next;
use axum::response::{IntoResponse, Response};
use axum::Router;
use floodgate_core::admission::{warn_refused, ConnectionCap, Peer};
use floodgate_core::tasks::stopped;
use tokio::io::{AsyncRead, AsyncWrite};
use tokio::net::TcpListener;
use tokio::sync::watch;

use crate::service::MAX_WATCH_SECONDS;

/// The agent's admin and embedded rules APIs hold at most this many connections each by default.
/// Their clients are few (Prometheus, probes, `floodgate status`, the CLI: one or two connections
/// each); 256 leaves room for a burst of scripts while bounding what a leaky or hostile client can
/// take from the agent's file descriptors (`--max-connections` is 4,096 per frames listener).
pub const AGENT_MAX_CONNECTIONS: usize = 256;

/// `floodgate rules-server` holds at most this many connections by default. Each following agent
/// keeps one open (its watch, and its pulls on the same connection), so this is the fleet one
/// service serves: 4,096 agents, 1,024 behind any one address (a NAT). Each connection is a file
/// descriptor: raise the process's limit (`LimitNOFILE`) with the cap.
pub const SERVICE_MAX_CONNECTIONS: usize = 4_096;

/// How long a client has to send a request's head (request line and headers) by default. A head
/// is one or two packets (hyper refuses heads past ~400 KiB), sent in milliseconds by any real
/// client, also across regions; 5 s leaves room for a slow link and a loaded peer while a half-sent
/// request holds its slot 6x less long than hyper's default of 30 s.
pub const DEFAULT_HEADER_TIMEOUT_MS: u64 = 5_000;

/// The longest one request may take, from its head read to its answer ready (the body read and the
/// handler; a watch gets its 55 s on top). The CLI waits 10 s and a rule write takes milliseconds,
/// so nothing a client still waits for is cut off, while a body trickled a byte at a time is.
pub const REQUEST_TIMEOUT: Duration = Duration::from_secs(30);

/// How long a TLS client has to finish its handshake (a few round trips).
const TLS_HANDSHAKE_TIMEOUT: Duration = Duration::from_secs(10);

/// How long open connections get to finish what they are answering once shutdown begins.
const DRAIN: Duration = Duration::from_secs(2);

/// How a listener bounds its connections.
#[derive(Debug, Clone, Copy)]
pub struct Limits {
    /// Most connections open at once (at least 1); past it a new one is closed at once.
    pub max_connections: usize,
    /// How long a client has to send a request's head, and how long a kept-alive connection may
    /// wait idle for its next request (hyper starts this timer as soon as a connection waits for a
    /// request, so it is both).
    pub header_timeout: Duration,
    /// The longest one request may take ([`REQUEST_TIMEOUT`]).
    pub request_timeout: Duration,
}

impl Limits {
    /// `max_connections` (at least 1) with the default header and request timeouts.
    pub fn new(max_connections: usize) -> Self {
        Limits {
            max_connections: max_connections.max(1),
            header_timeout: Duration::from_millis(DEFAULT_HEADER_TIMEOUT_MS),
            request_timeout: REQUEST_TIMEOUT,
        }
    }

    /// The same with another header timeout.
    pub fn header_timeout(mut self, timeout: Duration) -> Self {
        self.header_timeout = timeout;
        self
    }

    /// Most connections one peer address may hold: a quarter of the cap, at least 1.
    pub fn per_peer(&self) -> usize {
        ConnectionCap::default_share(self.max_connections)
    }

    /// The cap and the peers' shares of it.
    ///
    /// What the share protects depends on where the listener is. The rules service and an admin
    /// API bound beyond loopback (a container's `0.0.0.0:9790`) see each host at its own address:
    /// one host cannot lock the others (operators, the kubelet's probes, Prometheus) out. On
    /// loopback every local client is `127.0.0.1`, one peer: there the share only keeps a quarter
    /// of the cap for clients that connect from another loopback address, and what protects the
    /// agent is the cap (its file descriptors) and the header timeout (a half-sent request frees
    /// its slot in 5 s).
    fn cap(&self) -> ConnectionCap {
        ConnectionCap::new(self.max_connections, self.per_peer())
    }
}

/// Serves `app` on `listener` (over TLS with `tls`) until `shutdown` completes; then stops
/// accepting, lets open connections finish the request they are answering for up to 2 s, and
/// closes the rest. `name` labels refused connections in `floodgate_connections_refused_total`
/// (`admin`, `rules`), counted where metrics are recorded (the agent).
///
/// Connections speak HTTP/1.1 only: the header timeout is HTTP/1's, and an HTTP/2 connection (or
/// hyper's protocol sniffing, which waits for bytes with no timeout) would hold its slot without a
/// request. Every client of these APIs (reqwest without http2, curl, Prometheus) speaks HTTP/1.1.
pub async fn serve(
    listener: TcpListener,
    app: Router,
    tls: Option<Arc<rustls::ServerConfig>>,
    limits: Limits,
    name: &'static str,
    shutdown: impl Future<Output = ()>,
) {
    let timeout = limits.request_timeout;
    let app = app.layer(axum::middleware::from_fn(move |req, next| {
        within_deadline(req, next, timeout)
    }));
    let cap = limits.cap();
    let acceptor = tls.map(tokio_rustls::TlsAcceptor::from);
    let (stop, stopping) = watch::channel(false);
    let mut tasks = tokio::task::JoinSet::new();
    tokio::pin!(shutdown);
    loop {
        tokio::select! {
            accepted = listener.accept() => {
                let (tcp, peer) = match accepted {
                    Ok(a) => a,
                    Err(e) => {
                        // Out of file descriptors, say: the listener stays, the next accept retries.
                        tracing::warn!(listener = name, error = %e, "accept failed");
                        tokio::time::sleep(Duration::from_millis(10)).await;
                        continue;
                    }
                };
                let slot = match cap.try_acquire(Peer::Ip(peer.ip())) {
                    Ok(slot) => slot,
                    Err(why) => {
                        floodgate_core::metrics::connection_refused(name);
                        warn_refused(name, &format!("{} (--http-max-connections)", cap.refusal_message(why)));
                        drop(tcp);
                        continue;
                    }
                };
                let (app, acceptor, stopping) = (app.clone(), acceptor.clone(), stopping.clone());
                let header_timeout = limits.header_timeout;
                tasks.spawn(async move {
                    match acceptor {
                        Some(acceptor) => {
                            let handshake = tokio::time::timeout(TLS_HANDSHAKE_TIMEOUT, acceptor.accept(tcp));
                            if let Ok(Ok(stream)) = handshake.await {
                                connection(stream, app, header_timeout, stopping).await;
                            }
                        }
                        None => connection(tcp, app, header_timeout, stopping).await,
                    }
                    drop(slot);
                });
            }
            _ = &mut shutdown => break,
            Some(_) = tasks.join_next(), if !tasks.is_empty() => {}
        }
    }
    drop(listener);
    let _ = stop.send(true);
    let drain = async { while tasks.join_next().await.is_some() {} };
    if tokio::time::timeout(DRAIN, drain).await.is_err() {
        tasks.abort_all();
    }
}

/// Serves one connection until it closes, or until shutdown lets it finish its request.
async fn connection<I>(io: I, app: Router, header_timeout: Duration, mut stopping: watch::Receiver<bool>)
where
    I: AsyncRead + AsyncWrite + Unpin + Send + 'static,
{
    let mut http = hyper::server::conn::http1::Builder::new();
    http.timer(hyper_util::rt::TokioTimer::new())
        .header_read_timeout(header_timeout)
        .keep_alive(true);
    let service = hyper_util::service::TowerToHyperService::new(app);
    let conn = http.serve_connection(hyper_util::rt::TokioIo::new(io), service);
    tokio::pin!(conn);
    tokio::select! {
        _ = conn.as_mut() => return,
        _ = stopped(&mut stopping) => conn.as_mut().graceful_shutdown(),
    }
    let _ = conn.await;
}

/// Answers 503 (and closes the connection) when a request takes longer than `timeout`; a watch
/// (`?watch=S` on the rules API) gets its 55 s on top.
async fn within_deadline(req: Request, next: Next, timeout: Duration) -> Response {
    let watch = req
        .uri()
        .query()
        .is_some_and(|q| q.split('&').any(|kv| kv.starts_with("watch=")));
    let limit = if watch {
        timeout + Duration::from_secs(MAX_WATCH_SECONDS)
    } else {
        timeout
    };
    match tokio::time::timeout(limit, next.run(req)).await {
        Ok(r) => r,
        Err(_) => (
            StatusCode::SERVICE_UNAVAILABLE,
            [(header::CONNECTION, "close")],
            axum::Json(serde_json::json!({
                "error": format!("the request took longer than {} s", limit.as_secs())
            })),
        )
            .into_response(),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_tiny_cap_still_admits_one_per_peer() {
        let limits = Limits::new(0);
        assert_eq!((limits.max_connections, limits.per_peer()), (1, 1));
    }
}
