//! The agent daemon: the store, the guard, the engine, the rules source, the listeners (socket, TCP,
//! gRPC, admin) and the background loops, run until shutdown; reloads on SIGHUP.

mod loops;
mod rules_source;

use std::sync::Arc;
use std::time::Duration;

use anyhow::Context;
use floodgate_core::engine::{Engine, EngineOptions, Store};
use floodgate_core::guard::membership::default_agent_id;
use floodgate_core::guard::{BreakerConfig, Guard, MembershipConfig};
use floodgate_core::rules::RuleSet;
use floodgate_core::store::{Layout, MemoryStore};
use floodgate_redis::{RedisConfig, RedisStore};
use tokio::sync::watch;

use self::rules_source::RulesSource;
use crate::config::{Admin, AgentConfig};
use crate::{admin, envoy, exporter, server};

/// Runs the agent until `shutdown` turns true: binds the socket, serves it and the admin API, and
/// removes the socket on the way out.
pub async fn run(config: AgentConfig, shutdown: watch::Receiver<bool>) -> anyhow::Result<()> {
    run_with_reloads(config, shutdown, None).await
}

/// A reload (SIGHUP): the configuration read again, and the keys that changed.
#[derive(Debug)]
pub struct Reload {
    /// The new configuration.
    pub config: AgentConfig,
    /// The keys (`settings::keys`) whose values differ from the running ones.
    pub changed: Vec<String>,
}

/// [`run`], applying each [`Reload`] that arrives: the default flush interval and the rules file
/// (read again on every reload) change at run time; the log filter is the caller's to change; any
/// other changed key is logged as needing a restart.
pub async fn run_with_reloads(
    config: AgentConfig,
    shutdown: watch::Receiver<bool>,
    reloads: Option<tokio::sync::mpsc::UnboundedReceiver<Reload>>,
) -> anyhow::Result<()> {
    floodgate_rules_service::http::configure(config.rules_ca.as_deref())
        .map_err(|e| anyhow::anyhow!("--rules-ca: {e}"))?;
    let source = RulesSource::open(&config).await?;
    let (rules, rules_from, refused_rules) = source.initial().await?;
    let access = floodgate_redis::shards::RedisAccess::load(
        config.redis_ca.as_deref(),
        config.redis_password_file.as_deref(),
    )?;
    let store = match &config.redis {
        Some(_) => Store::Redis(Arc::new(RedisStore::new(&RedisConfig {
            urls: config.redis_urls(),
            cluster: config.redis_cluster,
            timeout: Duration::from_millis(config.redis_timeout_ms.max(1)),
            layout: Layout::new(config.redis_buckets, config.redis_tags),
            coalesce: config.coalesce,
            access: access.clone(),
        })?)),
        None => Store::Memory(Arc::new(MemoryStore::default())),
    };
    let socket = config.serve_socket()?;
    let listener = server::bind(&socket, config.socket_mode)
        .with_context(|| format!("cannot serve socket {}", socket.display()))?;
    tracing::info!(socket = %socket.display(), mode = format!("{:04o}", config.socket_mode), "floodgate agent listening");
    tracing::info!(store = %store.describe(), timeout_ms = config.redis_timeout_ms, "counter store");
    let ids: Vec<&str> = rules.iter().map(|r| r.id.as_str()).collect();
    tracing::info!(count = rules.len(), from = %rules_from, rules = %ids.join(", "), "rules loaded");

    let guard = match &store {
        Store::Redis(r) => {
            let membership = MembershipConfig {
                id: config.agent_id.clone().unwrap_or_else(default_agent_id),
                interval: Duration::from_millis(config.heartbeat_ms.max(10)),
                ttl: Duration::from_millis(config.heartbeat_ms.max(10) * 5),
                fixed: config.agents.filter(|n| *n > 0),
            };
            let breaker = BreakerConfig {
                failures: config.breaker_failures.max(1),
                cooldown: Duration::from_millis(config.breaker_cooldown_ms),
                min_streak: Duration::from_millis(config.breaker_min_streak_ms),
            };
            tracing::info!(
                agent_id = %membership.id,
                breaker_failures = breaker.failures,
                cooldown_ms = config.breaker_cooldown_ms,
                fixed_agents = ?membership.fixed,
                "guard: circuit breaker, limit/N fallback, heartbeats"
            );
            Some(Arc::new(Guard::new(breaker, membership, r.shard_count())))
        }
        Store::Memory(_) => None,
    };
    let options = EngineOptions {
        cache_cap: config.rejection_cache,
        flush_ms: config.flush_interval_ms.max(1),
        max_batched_keys: config.batch_max_keys,
        hot_key_rate: config.hot_key_rate,
        accuracy: config.accuracy,
        events: None,
    };
    let metrics = if config.metrics {
        let handle = exporter::install()?;
        tokio::spawn(exporter::upkeep(handle.clone(), shutdown.clone()));
        Some(handle)
    } else {
        None
    };
    let mut options = options;
    let mut events_task = None;
    if let (Store::Redis(_), true) = (&store, config.events) {
        let (events, rx) = floodgate_core::events::Events::new(config.events_queue);
        let shards = floodgate_redis::shards::Shards::new(
            &config.redis_urls(),
            config.redis_cluster,
            config.redis_buckets,
            &access,
        )?;
        let stream = floodgate_redis::events::StreamConfig {
            stream: config.events_stream.clone(),
            maxlen: config.events_maxlen,
            agent: guard
                .as_ref()
                .map(|g| g.membership.config().id.clone())
                .unwrap_or_else(default_agent_id),
        };
        tracing::info!(stream = %stream.stream, maxlen = stream.maxlen, queue = config.events_queue, "rejection events to a Redis stream");
        // The writer stops after the socket server (which answers in-flight checks after shutdown),
        // so it sees every event.
        let (stop_tx, stop_rx) = watch::channel(false);
        events_task = Some((
            stop_tx,
            tokio::spawn(floodgate_redis::events::write_loop(shards, rx, stream, stop_rx)),
        ));
        options.events = Some(Arc::new(events));
    }
    let engine = Engine::with_guard(rules, store.clone(), guard.clone(), options);
    if let Some(refused) = refused_rules {
        engine.refuse_rules(refused);
    }
    source.start(&engine, &config, shutdown.clone()).await?;
    if let Some(rx) = reloads {
        let file = matches!(source, RulesSource::File(_));
        tokio::spawn(apply_reloads(engine.clone(), file, rx));
    }
    let guard_task = match (&store, guard) {
        (Store::Redis(r), Some(g)) => Some(tokio::spawn(loops::guard_loop(
            g,
            r.clone(),
            engine.clone(),
            shutdown.clone(),
        ))),
        _ => None,
    };
    if let Store::Memory(m) = &store {
        let m = m.clone();
        tokio::spawn(floodgate_core::tasks::every(
            Duration::from_secs(5),
            shutdown.clone(),
            move || {
                m.sweep();
                std::future::ready(())
            },
        ));
    }
    if let Admin::At(addr) = config.admin {
        let listener = tokio::net::TcpListener::bind(addr)
            .await
            .with_context(|| format!("cannot serve admin HTTP on {addr}"))?;
        tracing::info!(addr = %listener.local_addr()?, max_connections = config.http_max_connections, "admin HTTP listening");
        let app = admin::app(engine.clone()).layer(axum::Extension(metrics.clone()));
        // No token: on loopback only loopback Hosts (DNS rebinding); anywhere, no cross-site
        // writes. Bodies may be sent as curl sends them: a form cannot PUT.
        let guard = floodgate_rules_service::browser::BrowserGuard {
            loopback_host: addr.ip().is_loopback(),
            json_bodies: false,
        };
        let app = guard.layer(app);
        let mut stop = shutdown.clone();
        let limits = config.http_limits();
        tokio::spawn(async move {
            let stop = async move { floodgate_core::tasks::stopped(&mut stop).await };
            floodgate_rules_service::listen::serve(listener, app, None, limits, "admin", stop).await;
        });
    }

    let flusher = match &store {
        Store::Redis(r) => Some(tokio::spawn(loops::flush_loop(
            engine.clone(),
            r.clone(),
            shutdown.clone(),
        ))),
        Store::Memory(_) => None,
    };

    // Each listener has a cap of its own, so clients of one (pods over TCP, say) cannot take the
    // slots of another (the host's services on the socket, Envoy over gRPC).
    let per_peer = config
        .max_connections_per_peer
        .map(std::num::NonZeroUsize::get)
        .unwrap_or_else(|| server::ConnectionCap::default_share(config.max_connections.get()));
    let cap = || server::ConnectionCap::new(config.max_connections.get(), per_peer);
    // The frames listeners' connections: their timeouts, and one read-buffer budget for both.
    let serving = server::Serving {
        cap: cap(),
        limits: server::Limits {
            idle: Duration::from_millis(config.idle_timeout_ms.get()),
            frame: Duration::from_millis(config.frame_timeout_ms.get()),
        },
        budget: server::BufferBudget::default(),
    };
    let mut listeners = Vec::new();
    if let Some(addr) = config.listen_tcp {
        let tcp = tokio::net::TcpListener::bind(addr)
            .await
            .with_context(|| format!("cannot listen on TCP {addr}"))?;
        tracing::info!(addr = %tcp.local_addr()?, "frames protocol on TCP");
        listeners.push(tokio::spawn(server::serve(
            server::Listener::Tcp(tcp),
            engine.clone(),
            server::Serving {
                cap: cap(),
                ..serving.clone()
            },
            shutdown.clone(),
        )));
    }
    let grpc = Arc::new(envoy::EnvoyService::new(engine.clone(), config.grpc_headers));
    if let Some(addr) = config.grpc {
        let tcp = tokio::net::TcpListener::bind(addr)
            .await
            .with_context(|| format!("cannot serve gRPC on {addr}"))?;
        tracing::info!(addr = %tcp.local_addr()?, "Envoy RateLimitService (gRPC) listening");
        let (grpc, cap, stop) = (grpc.clone(), cap(), shutdown.clone());
        listeners.push(tokio::spawn(async move {
            if let Err(e) = envoy::serve_tcp(tcp, grpc, cap, stop).await {
                tracing::error!(error = %e, "gRPC server failed");
            }
        }));
    }
    if let Some(path) = &config.grpc_socket {
        let unix = server::bind(path, config.socket_mode)
            .with_context(|| format!("cannot serve gRPC on socket {}", path.display()))?;
        tracing::info!(socket = %path.display(), "Envoy RateLimitService (gRPC) on a Unix socket");
        let (grpc, cap, stop) = (grpc.clone(), cap(), shutdown.clone());
        listeners.push(tokio::spawn(async move {
            if let Err(e) = envoy::serve_unix(unix, grpc, cap, stop).await {
                tracing::error!(error = %e, "gRPC server failed");
            }
        }));
    }
    server::serve(
        server::Listener::Unix(listener),
        engine.clone(),
        serving,
        shutdown,
    )
    .await;
    // The other listeners drained in parallel with the socket; whatever is still open after one
    // more deadline (a peer that never lets its HTTP/2 connection go) is stopped, before the last
    // flush below.
    let aborts: Vec<_> = listeners.iter().map(|l| l.abort_handle()).collect();
    if tokio::time::timeout(Duration::from_secs(2), futures::future::join_all(listeners))
        .await
        .is_err()
    {
        tracing::warn!("listeners still open 2 s after shutdown; stopping them");
        aborts.iter().for_each(|a| a.abort());
    }
    let _ = std::fs::remove_file(&socket);
    if let Some(path) = &config.grpc_socket {
        let _ = std::fs::remove_file(path);
    }
    if let (Some(task), Store::Redis(r)) = (flusher, &store) {
        // In-flight checks are answered; what batched rules admitted since the last flush goes now.
        let _ = tokio::time::timeout(Duration::from_secs(2), task).await;
        let sent = loops::flush(&engine, r.as_ref(), true).await;
        tracing::info!(entries = sent, "flushed batched counts on the way out");
    }
    if let Some(task) = guard_task {
        // It leaves the heartbeat set and writes back what it still holds; bounded by its timeouts.
        let _ = tokio::time::timeout(Duration::from_secs(2), task).await;
    }
    if let Some((stop, task)) = events_task {
        // Every check is answered: the writer writes out what is queued (each write bounded by its
        // 2 s timeout; the queue holds at most --events-queue events).
        let _ = stop.send(true);
        let _ = tokio::time::timeout(Duration::from_secs(5), task).await;
    }
    tracing::info!("floodgate agent stopped");
    Ok(())
}

/// Applies reloads until the sender is gone.
async fn apply_reloads(
    engine: Arc<Engine>,
    rules_file: bool,
    mut rx: tokio::sync::mpsc::UnboundedReceiver<Reload>,
) {
    while let Some(r) = rx.recv().await {
        let mut applied = Vec::new();
        let mut restart = Vec::new();
        for key in &r.changed {
            match key.as_str() {
                "flush_interval_ms" => {
                    engine
                        .batcher()
                        .set_flush_ms(None, r.config.flush_interval_ms.max(1));
                    applied.push(format!("flush_interval_ms={}", r.config.flush_interval_ms));
                }
                "log" => applied.push(format!("log={}", r.config.log)),
                "rules" if rules_file => {}
                // The config file is where the new values came from, not a setting.
                "config" => {}
                other => restart.push(other.to_string()),
            }
        }
        match (&r.config.rules, rules_file) {
            (Some(path), true) => match RuleSet::load(path) {
                Ok(set) => {
                    let n = set.len();
                    engine.swap_rules(set);
                    applied.push(format!("rules={} ({n} rules)", path.display()));
                }
                Err(e) => {
                    tracing::warn!(error = %e, "reload: the rules file is refused; the running rules stay")
                }
            },
            _ if r.changed.iter().any(|k| k == "rules") => restart.push("rules".into()),
            _ => {}
        }
        tracing::info!(applied = %applied.join(", "), "reload (SIGHUP)");
        if !restart.is_empty() {
            tracing::warn!(keys = %restart.join(", "), "reload: these changed and take effect only after a restart");
        }
    }
}
