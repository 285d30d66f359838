//! The Floodgate agent: a per-host daemon that answers "may this request pass?" over a Unix socket,
//! deciding with atomic Redis scripts (fleet-wide limits) or its embedded in-memory store.
//!
//! # Layout
//! - [`config`]: the agent's flags and environment variables.
//! - [`server`]: the socket (safe binding, pipelined connections).
//! - [`engine`]: resolves rules, asks the store, applies fail modes, combines verdicts.
//! - [`store`]: the in-memory store and the Redis store behind one interface.
//! - [`algo`]: sliding window and token bucket as pure functions of (state, now).
//! - [`rules`]: the rule model, rules files, attribute matching.
//! - [`admin`]: the admin HTTP router.
//!
//! # Example
//! ```
//! use std::sync::Arc;
//! use floodgate_agent::{engine::{Answer, Engine}, rules::RuleSet, store::{MemoryStore, Store}};
//! use floodgate_protocol::{Check, Item};
//!
//! let rules = RuleSet::parse(r#"{"rules":[{"id":"api","dimension":"user","limit":2,"windowSeconds":60}]}"#).unwrap();
//! let engine = Engine::new(rules, Store::Memory(Arc::new(MemoryStore::default())));
//! let check = || Check::Items(vec![Item::new("user:1", "api", 1)]);
//! for expected in [true, true, false] {
//!     let Answer::Ready(Ok(d)) = engine.check(check()) else { panic!("the embedded store answers at once") };
//!     assert_eq!(d.combined.allowed, expected);
//! }
//! ```

pub mod admin;
pub mod algo;
pub mod config;
pub mod engine;
pub mod rules;
pub mod server;
pub mod store;

use std::sync::Arc;
use std::time::Duration;

use anyhow::Context;
use tokio::sync::watch;

use crate::config::{Admin, AgentConfig};
use crate::engine::Engine;
use crate::rules::RuleSet;
use crate::store::{MemoryStore, RedisConfig, RedisStore, Store};

/// Runs the agent until `shutdown` turns true: binds the socket, serves it and the admin API, and
/// removes the socket on the way out.
pub async fn run(config: AgentConfig, shutdown: watch::Receiver<bool>) -> anyhow::Result<()> {
    let (rules, rules_from) = match &config.rules {
        Some(path) => (RuleSet::load(path)?, path.display().to_string()),
        None => (
            RuleSet::parse(rules::EXAMPLE_RULES)?,
            "the built-in example".to_string(),
        ),
    };
    let store = match &config.redis {
        Some(url) => Store::Redis(Arc::new(RedisStore::new(&RedisConfig {
            url: url.clone(),
            timeout: Duration::from_millis(config.redis_timeout_ms.max(1)),
        })?)),
        None => Store::Memory(Arc::new(MemoryStore::default())),
    };
    let listener = server::bind(&config.socket, config.socket_mode)
        .with_context(|| format!("cannot serve socket {}", config.socket.display()))?;
    tracing::info!(socket = %config.socket.display(), mode = format!("{:04o}", config.socket_mode), "floodgate agent listening");
    tracing::info!(store = %store.describe(), timeout_ms = config.redis_timeout_ms, "counter store");
    let ids: Vec<&str> = rules.iter().map(|r| r.id.as_str()).collect();
    tracing::info!(count = rules.len(), from = %rules_from, rules = %ids.join(", "), "rules loaded");

    let engine = Engine::new(rules, store.clone());
    if let Store::Memory(m) = &store {
        let m = m.clone();
        let mut stop = shutdown.clone();
        tokio::spawn(async move {
            let mut tick = tokio::time::interval(Duration::from_secs(5));
            loop {
                tokio::select! {
                    _ = tick.tick() => { m.sweep(); }
                    _ = server::stopped(&mut stop) => break,
                }
            }
        });
    }
    if let Admin::At(addr) = config.admin {
        let listener = tokio::net::TcpListener::bind(addr)
            .await
            .with_context(|| format!("cannot serve admin HTTP on {addr}"))?;
        tracing::info!(addr = %listener.local_addr()?, "admin HTTP listening");
        let app = admin::app(engine.clone());
        let mut stop = shutdown.clone();
        tokio::spawn(async move {
            let graceful = async move {
                server::stopped(&mut stop).await;
            };
            if let Err(e) = axum::serve(listener, app).with_graceful_shutdown(graceful).await {
                tracing::error!(error = %e, "admin HTTP failed");
            }
        });
    }

    server::serve(listener, engine, shutdown).await;
    let _ = std::fs::remove_file(&config.socket);
    tracing::info!("floodgate agent stopped");
    Ok(())
}
