//! `floodgate rules-server`: the rules API served until shutdown, over plain HTTP or TLS, through
//! [`listen::serve`] (its connection cap and timeouts).

use std::net::SocketAddr;
use std::path::PathBuf;

use anyhow::Context;
use floodgate_core::tasks::stopped;
use tokio::sync::watch;

use crate::service::{self, ServiceState};
use crate::store::RulesStore;
use crate::tokens::{self, Scope, Token, TokenError};
use crate::{http, listen};

/// How the rules service runs (the binary's `floodgate rules-server` flags fill it).
#[derive(Debug, Clone)]
pub struct ServeOptions {
    /// Address of the rules API.
    pub listen: SocketAddr,
    /// The store: `sqlite://path` or `postgres://user@host/db`.
    pub db: String,
    /// Write tokens, `name:secret` (or a bare secret); with no token at all: loopback only.
    pub tokens: Vec<String>,
    /// Read tokens, `name:secret` (or a bare secret): the rules, watches and dry runs only.
    pub read_tokens: Vec<String>,
    /// A file of `write name:secret` and `read name:secret` lines, readable by its owner only.
    pub token_file: Option<PathBuf>,
    /// The TLS certificate chain and key (PEM), both or neither.
    pub tls: Option<(PathBuf, PathBuf)>,
    /// The connection cap and timeouts of its listener.
    pub limits: listen::Limits,
    /// Wraps the API's router (the agent's request spans), if set.
    pub wrap: Option<fn(axum::Router) -> axum::Router>,
}

impl ServeOptions {
    /// Every token: `--token` (write), `--read-token`, then the token file's.
    pub fn tokens(&self) -> Result<Vec<Token>, TokenError> {
        let mut all = Vec::new();
        for t in &self.tokens {
            all.push(tokens::from_flag(t, Scope::Write)?);
        }
        for t in &self.read_tokens {
            all.push(tokens::from_flag(t, Scope::Read)?);
        }
        if let Some(path) = &self.token_file {
            all.extend(tokens::from_file(path)?);
        }
        tokens::check(&all)?;
        Ok(all)
    }
}

/// Runs the rules service until `shutdown` turns true (`floodgate rules-server`).
pub async fn run(config: ServeOptions, mut shutdown: watch::Receiver<bool>) -> anyhow::Result<()> {
    let tokens = config.tokens()?;
    if tokens.is_empty() {
        anyhow::ensure!(
            config.listen.ip().is_loopback(),
            "no --token configured: the rules API would be open to anyone, so it listens on loopback only, not {}",
            config.listen
        );
        tracing::warn!("no --token configured: the rules API listens on loopback only and asks for no token");
    }
    let (write, read) = (
        tokens.iter().filter(|t| t.scope == Scope::Write).count(),
        tokens.iter().filter(|t| t.scope == Scope::Read).count(),
    );
    let store = RulesStore::open(&config.db)
        .await
        .with_context(|| format!("cannot open the rules store {}", config.db))?;
    let state = ServiceState::new(store, tokens).await?;
    let listener = tokio::net::TcpListener::bind(config.listen)
        .await
        .with_context(|| format!("cannot serve the rules API on {}", config.listen))?;
    tracing::info!(addr = %listener.local_addr()?, store = %state.store.describe(), tokens = write, read_tokens = read, max_connections = config.limits.max_connections, "rules service listening");
    tokio::spawn(service::poll_version(state.clone(), shutdown.clone()));
    let mut app = service::app(state.clone());
    if !state.authenticated() {
        // No token: anyone who reaches loopback may write, so web pages must not.
        app = crate::browser::BrowserGuard {
            loopback_host: true,
            json_bodies: true,
        }
        .layer(app);
    }
    if let Some(wrap) = config.wrap {
        app = wrap(app);
    }
    let tls = match &config.tls {
        Some((cert, key)) => {
            let tls = http::server_tls(cert, key).map_err(|e| anyhow::anyhow!("rules service TLS: {e}"))?;
            tracing::info!(cert = %cert.display(), "rules service over TLS (https)");
            Some(tls)
        }
        None => None,
    };
    let closing = state.clone();
    let stop = async move {
        stopped(&mut shutdown).await;
        // Held watches answer now rather than hold the shutdown for up to a minute.
        closing.close();
    };
    listen::serve(listener, app, tls, config.limits, "rules", stop).await;
    tracing::info!("rules service stopped");
    Ok(())
}
