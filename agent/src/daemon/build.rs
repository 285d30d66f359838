//! Building the agent: every part made and every listener bound, before anything runs. A build that
//! fails (a socket in use, a rules store that cannot open, a bad Redis URL) fails here, with nothing
//! started and nothing to undo.

use std::path::PathBuf;
use std::sync::Arc;
use std::time::Duration;

use anyhow::Context;
use floodgate_core::engine::{Engine, EngineOptions, Store};
use floodgate_core::events::Events;
use floodgate_core::guard::membership::default_agent_id;
use floodgate_core::guard::{BreakerConfig, Guard, MembershipConfig};
use floodgate_core::store::{Layout, MemoryStore};
use floodgate_redis::events::StreamConfig;
use floodgate_redis::shards::Shards;
use floodgate_redis::{RedisConfig, RedisStore};
use metrics_exporter_prometheus::PrometheusHandle;
use tokio::net::{TcpListener, UnixListener};

use super::rules_source::RulesSource;
use crate::config::{Admin, AgentConfig};
use crate::server;

/// The agent, built: what [`Built::spawn`](super::Built) starts.
pub(crate) struct Built {
    pub(super) config: AgentConfig,
    pub(super) engine: Arc<Engine>,
    pub(super) store: Store,
    pub(super) guard: Option<Arc<Guard>>,
    pub(super) source: RulesSource,
    /// The Prometheus recorder, when `--metrics` is on.
    pub(super) metrics: Option<PrometheusHandle>,
    /// The rejection events' queue and where they go, when `--events` is on (Redis only).
    pub(super) events: Option<(
        tokio::sync::mpsc::Receiver<floodgate_core::events::Event>,
        Shards,
        StreamConfig,
    )>,
    pub(super) listeners: Listeners,
    /// Whether the store was warmed up before serving (scripts loaded, connections open).
    pub(super) warmed: bool,
}

/// Every listener the agent serves, bound.
pub(super) struct Listeners {
    /// The frames socket and its path (removed on the way out).
    pub(super) socket: (PathBuf, UnixListener),
    /// `--listen-tcp`.
    pub(super) tcp: Option<TcpListener>,
    /// `--grpc` over TCP.
    pub(super) grpc_tcp: Option<TcpListener>,
    /// `--grpc-socket`, and its path.
    pub(super) grpc_unix: Option<(PathBuf, UnixListener)>,
    /// `--grpc-tls-cert`: TLS on `grpc_tcp`, read before anything runs.
    pub(super) grpc_tls: Option<std::sync::Arc<crate::envoy::GrpcTls>>,
    /// `--admin`.
    pub(super) admin: Option<TcpListener>,
}

/// Builds the agent from its configuration.
pub(crate) async fn build(config: AgentConfig) -> anyhow::Result<Built> {
    floodgate_rules_service::http::configure(config.rules_ca.as_deref())
        .map_err(|e| anyhow::anyhow!("--rules-ca: {e}"))?;
    let source = RulesSource::open(&config).await?;
    let (rules, rules_from, refused_rules) = source.initial().await?;
    let access = floodgate_redis::shards::RedisAccess::load(
        config.redis_ca.as_deref(),
        config.redis_password_file.as_deref(),
    )?;
    let store = match &config.redis {
        Some(_) => Store::Shared(Arc::new(RedisStore::new(&RedisConfig {
            urls: config.redis_urls(),
            cluster: config.redis_cluster,
            timeout: Duration::from_millis(config.redis_timeout_ms),
            layout: Layout::new(config.redis_buckets, config.redis_tags),
            coalesce: config.coalesce,
            access: access.clone(),
        })?)),
        None => Store::Memory(Arc::new(MemoryStore::default())),
    };
    let guard = match &store {
        Store::Shared(r) => Some(Arc::new(guard(&config, r.shard_count()))),
        Store::Memory(_) => None,
    };
    let warmed = match (&store, &guard) {
        (Store::Shared(r), Some(g)) => warm_up(r.as_ref(), g).await,
        _ => false,
    };
    let socket = bind_socket(&config)?;
    // A build that fails from here on leaves no socket file behind (the next start would replace
    // it as stale, but a client would meanwhile find a socket nobody answers).
    let mut bound = SocketFiles(vec![socket.0.clone()]);
    tracing::info!(store = %store.describe(), timeout_ms = config.redis_timeout_ms, "counter store");
    let ids: Vec<&str> = rules.iter().map(|r| r.id.as_str()).collect();
    tracing::info!(count = rules.len(), from = %rules_from, rules = %ids.join(", "), "rules loaded");
    let listeners = bind(&config, socket).await?;
    if let Some((path, _)) = &listeners.grpc_unix {
        bound.0.push(path.clone());
    }

    let metrics = if config.metrics {
        Some(crate::exporter::install()?)
    } else {
        None
    };
    let mut options = EngineOptions {
        cache_cap: config.rejection_cache,
        flush_ms: config.flush_interval_ms,
        max_batched_keys: config.batch_max_keys,
        max_reservations: config.max_reservations,
        hot_key_rate: config.hot_key_rate,
        accuracy: config.accuracy,
        events: None,
        ledger: None,
        clock: floodgate_core::store::Clock::System,
    };
    if let Some(path) = &config.ledger {
        let agent = guard
            .as_ref()
            .map(|g| g.membership.config().id.clone())
            .unwrap_or_else(default_agent_id);
        let shared = matches!(store, Store::Shared(_));
        let ledger = floodgate_core::ledger::Ledger::create(path, &agent, shared)
            .with_context(|| format!("--ledger {}", path.display()))?;
        tracing::warn!(path = %path.display(), "decision ledger on: every decision is written to the file");
        options.ledger = Some(Arc::new(ledger));
    }
    let mut events = None;
    if let (Store::Shared(_), true) = (&store, config.events) {
        let (queue, rx) = Events::new(config.events_queue);
        let shards = Shards::new(
            &config.redis_urls(),
            config.redis_cluster,
            config.redis_buckets,
            &access,
        )?;
        let stream = StreamConfig {
            stream: config.events_stream.clone(),
            maxlen: config.events_maxlen,
            agent: guard
                .as_ref()
                .map(|g| g.membership.config().id.clone())
                .unwrap_or_else(default_agent_id),
        };
        tracing::info!(stream = %stream.stream, maxlen = stream.maxlen, queue = config.events_queue, "rejection events to a Redis stream");
        options.events = Some(Arc::new(queue));
        events = Some((rx, shards, stream));
    }
    let engine = Engine::with_guard(rules, store.clone(), guard.clone(), options);
    if let Some(refused) = refused_rules {
        engine.refuse_rules(refused);
    }
    bound.0.clear();
    Ok(Built {
        config,
        engine,
        store,
        guard,
        source,
        metrics,
        events,
        listeners,
        warmed,
    })
}

/// The guard of a Redis store: its breakers (one per shard), the limit / N fallback, heartbeats.
fn guard(config: &AgentConfig, shards: usize) -> Guard {
    let membership = MembershipConfig {
        id: config.agent_id.clone().unwrap_or_else(default_agent_id),
        interval: Duration::from_millis(config.heartbeat_ms),
        ttl: Duration::from_millis(config.heartbeat_ms * 5),
        fixed: config.agents.filter(|n| *n > 0),
    };
    let breaker = BreakerConfig {
        failures: config.breaker_failures,
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
    Guard::new(breaker, membership, shards)
}

/// Longest a start waits for Redis before it serves.
const WARM_UP: Duration = Duration::from_secs(1);

/// Before the agent serves: the scripts loaded, the check path's connections open and the first
/// heartbeat answered (N learned), at most [`WARM_UP`]. Otherwise a cold agent's first checks pay
/// the connect and the load within their store timeout, and those that outlast it are answered by
/// the fallback counting this agent alone: a concurrency rule of limit 2 held 4 with two cold
/// agents (issue 33). Until the socket is bound, SDKs answer by their fail policy at once; a Redis
/// that does not answer in time leaves the rest to the guard's loop, and the fail modes decide.
/// Answers whether the store was ready.
async fn warm_up(redis: &dyn floodgate_core::shared_store::SharedStore, guard: &Guard) -> bool {
    let started = std::time::Instant::now();
    let config = guard.membership.config();
    let warm = async {
        redis.warm_up(WARM_UP).await?;
        redis.heartbeat(&config.id, config.ttl, false).await
    };
    match tokio::time::timeout(WARM_UP, warm).await {
        Ok(Ok(n)) => {
            guard.membership.observe(n);
            tracing::info!(
                live_agents = n,
                ms = started.elapsed().as_millis() as u64,
                "store ready: scripts loaded, connections open"
            );
            true
        }
        Ok(Err(e)) => {
            tracing::warn!(error = %e, "store not ready at start; serving anyway (rules' fail modes decide until it answers)");
            false
        }
        Err(_) => {
            tracing::warn!(
                wait_ms = WARM_UP.as_millis() as u64,
                "store did not answer at start; serving anyway (rules' fail modes decide until it answers)"
            );
            false
        }
    }
}

/// Binds the frames socket, and says so first.
fn bind_socket(config: &AgentConfig) -> anyhow::Result<(PathBuf, UnixListener)> {
    let path = config.serve_socket()?;
    let socket = server::bind(&path, config.socket_mode)
        .with_context(|| format!("cannot serve socket {}", path.display()))?;
    tracing::info!(socket = %path.display(), mode = format!("{:04o}", config.socket_mode), "floodgate agent listening");
    Ok((path, socket))
}

/// Binds every other listener the configuration asks for, beside the `socket` already bound.
async fn bind(config: &AgentConfig, socket: (PathBuf, UnixListener)) -> anyhow::Result<Listeners> {
    let tcp = match config.listen_tcp {
        Some(addr) => {
            let tcp = TcpListener::bind(addr)
                .await
                .with_context(|| format!("cannot listen on TCP {addr}"))?;
            tracing::info!(addr = %tcp.local_addr()?, "frames protocol on TCP");
            Some(tcp)
        }
        None => None,
    };
    let grpc_tcp = match config.grpc {
        Some(addr) => {
            let tcp = TcpListener::bind(addr)
                .await
                .with_context(|| format!("cannot serve gRPC on {addr}"))?;
            tracing::info!(addr = %tcp.local_addr()?, "Envoy RateLimitService (gRPC) listening");
            Some(tcp)
        }
        None => None,
    };
    let grpc_unix = match &config.grpc_socket {
        Some(path) => {
            let unix = server::bind(path, config.socket_mode)
                .with_context(|| format!("cannot serve gRPC on socket {}", path.display()))?;
            tracing::info!(socket = %path.display(), "Envoy RateLimitService (gRPC) on a Unix socket");
            Some((path.clone(), unix))
        }
        None => None,
    };
    let grpc_tls = match config.grpc_tls_files() {
        Some(files) => {
            anyhow::ensure!(
                config.grpc.is_some(),
                "--grpc-tls-cert: TLS is for the gRPC TCP listener, and --grpc is not given"
            );
            anyhow::ensure!(
                config.grpc_server == crate::envoy::GrpcServer::Native,
                "--grpc-tls-cert: TLS on the gRPC listener is served by --grpc-server native only"
            );
            let tls = crate::envoy::GrpcTls::load(files).context("--grpc-tls-cert")?;
            tracing::info!(
                client_certificates = config.grpc_tls_client_ca.is_some(),
                "gRPC listener serves TLS"
            );
            Some(std::sync::Arc::new(tls))
        }
        None => None,
    };
    let admin = match config.admin {
        Admin::At(addr) => {
            let listener = TcpListener::bind(addr)
                .await
                .with_context(|| format!("cannot serve admin HTTP on {addr}"))?;
            tracing::info!(addr = %listener.local_addr()?, max_connections = config.http_max_connections, "admin HTTP listening");
            Some(listener)
        }
        Admin::Off => None,
    };
    Ok(Listeners {
        socket,
        tcp,
        grpc_tcp,
        grpc_unix,
        grpc_tls,
        admin,
    })
}

/// Socket files bound by a build, removed if it fails (dropped before being cleared).
struct SocketFiles(Vec<PathBuf>);

impl Drop for SocketFiles {
    fn drop(&mut self) {
        for path in &self.0 {
            let _ = std::fs::remove_file(path);
        }
    }
}
