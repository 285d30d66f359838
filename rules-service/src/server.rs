//! `floodgate rules-server`: the rules API served until shutdown, over plain HTTP or TLS.

use std::net::SocketAddr;
use std::path::PathBuf;
use std::sync::Arc;
use std::time::Duration;

use anyhow::Context;
use floodgate_core::tasks::stopped;
use tokio::sync::watch;

use crate::http;
use crate::service::{self, ServiceState};
use crate::store::RulesStore;

/// How the rules service runs (the binary's `floodgate rules-server` flags fill it).
#[derive(Debug, Clone)]
pub struct ServeOptions {
    /// Address of the rules API.
    pub listen: SocketAddr,
    /// The store: `sqlite://path` or `postgres://user@host/db`.
    pub db: String,
    /// Operator tokens, `name:secret` (or a bare secret); none: loopback only.
    pub tokens: Vec<String>,
    /// The TLS certificate chain and key (PEM), both or neither.
    pub tls: Option<(PathBuf, PathBuf)>,
}

/// Runs the rules service until `shutdown` turns true (`floodgate rules-server`).
pub async fn run(config: ServeOptions, mut shutdown: watch::Receiver<bool>) -> anyhow::Result<()> {
    if config.tokens.is_empty() {
        anyhow::ensure!(
            config.listen.ip().is_loopback(),
            "no --token configured: the rules API would be open to anyone, so it listens on loopback only, not {}",
            config.listen
        );
        tracing::warn!("no --token configured: the rules API listens on loopback only and asks for no token");
    }
    let store = RulesStore::open(&config.db)
        .await
        .with_context(|| format!("cannot open the rules store {}", config.db))?;
    let state = ServiceState::new(store, &config.tokens).await?;
    let listener = tokio::net::TcpListener::bind(config.listen)
        .await
        .with_context(|| format!("cannot serve the rules API on {}", config.listen))?;
    tracing::info!(addr = %listener.local_addr()?, store = %state.store.describe(), tokens = config.tokens.len(), "rules service listening");
    tokio::spawn(service::poll_version(state.clone(), shutdown.clone()));
    let app = service::app(state.clone());
    if let Some((cert, key)) = &config.tls {
        let tls = http::server_tls(cert, key).map_err(|e| anyhow::anyhow!("rules service TLS: {e}"))?;
        tracing::info!(cert = %cert.display(), "rules service over TLS (https)");
        serve_tls(listener, app, tls, shutdown, state).await;
        tracing::info!("rules service stopped");
        return Ok(());
    }
    axum::serve(listener, app)
        .with_graceful_shutdown(async move {
            stopped(&mut shutdown).await;
            // Held watches answer now rather than hold the shutdown for up to a minute.
            state.close();
        })
        .await?;
    tracing::info!("rules service stopped");
    Ok(())
}

/// Serves `app` over TLS until `shutdown`: then held watches answer, and open connections get 2 s.
async fn serve_tls(
    listener: tokio::net::TcpListener,
    app: axum::Router,
    tls: Arc<rustls::ServerConfig>,
    mut shutdown: watch::Receiver<bool>,
    state: Arc<ServiceState>,
) {
    let acceptor = tokio_rustls::TlsAcceptor::from(tls);
    let mut tasks = tokio::task::JoinSet::new();
    loop {
        tokio::select! {
            accepted = listener.accept() => {
                let Ok((tcp, _)) = accepted else {
                    tokio::time::sleep(Duration::from_millis(10)).await;
                    continue;
                };
                let (acceptor, app) = (acceptor.clone(), app.clone());
                tasks.spawn(async move {
                    // A peer that never finishes its handshake is dropped after 10 s.
                    let Ok(Ok(stream)) = tokio::time::timeout(Duration::from_secs(10), acceptor.accept(tcp)).await else {
                        return;
                    };
                    let service = hyper_util::service::TowerToHyperService::new(app);
                    let _ = hyper_util::server::conn::auto::Builder::new(hyper_util::rt::TokioExecutor::new())
                        .serve_connection(hyper_util::rt::TokioIo::new(stream), service)
                        .await;
                });
            }
            _ = stopped(&mut shutdown) => break,
            Some(_) = tasks.join_next(), if !tasks.is_empty() => {}
        }
    }
    state.close();
    let drain = async { while tasks.join_next().await.is_some() {} };
    if tokio::time::timeout(Duration::from_secs(2), drain).await.is_err() {
        tasks.abort_all();
    }
}
