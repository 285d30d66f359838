//! The Floodgate agent: a per-host daemon that answers "may this request pass?" over a Unix socket,
//! deciding with atomic Redis scripts (fleet-wide limits) or its embedded in-memory store.
//!
//! # Layout
//! - [`config`]: the agent's flags and environment variables.
//! - [`settings`]: the config file (TOML keys onto the flags), its generated table, reloads.
//! - [`server`]: the socket and TCP listeners (safe binding, pipelined connections, connection cap).
//! - [`envoy`]: Envoy's RateLimitService over gRPC, answered by the engine.
//! - [`engine`]: resolves rules, asks the store, applies fail modes, combines verdicts.
//! - [`store`]: the in-memory store and the Redis store behind one interface.
//! - [`guard`]: circuit breaker, limit/N fallback with its write-back ledger, heartbeats (N).
//! - [`batch`]: batched execution (local counters, flushes, hot keys).
//! - [`cache`]: the rejection cache (a rejected key answered locally until it could pass).
//! - [`algo`]: sliding window and token bucket as pure functions of (state, now).
//! - [`rules`]: the rule model, rules files, attribute matching.
//! - [`admin`]: the admin HTTP router.
//! - [`dryrun`]: log mode's would-be rejections, counted, logged and reported.
//! - [`cli`]: `floodgate rules …`, the operators' command line for the rules API.
//! - [`ops`]: `floodgate check` and `floodgate status`, the operators' look at a running agent.
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
pub mod batch;
pub mod cache;
pub mod cli;
pub mod config;
pub mod dryrun;
pub mod engine;
pub mod envoy;
pub mod events;
pub mod guard;
pub mod metrics;
pub mod ops;
pub mod rules;
pub mod server;
pub mod settings;
pub mod store;

use std::sync::Arc;
use std::time::Duration;

use anyhow::Context;
use tokio::sync::watch;

use crate::config::{Admin, AgentConfig};
use crate::engine::{Engine, EngineOptions};
use crate::guard::membership::default_agent_id;
use crate::guard::{BreakerConfig, BreakerState, Guard, MembershipConfig, Permit, Transition};
use crate::rules::RuleSet;
use crate::store::{Adjust, Layout, MemoryStore, RedisConfig, RedisStore, Store};

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
    rules::http::configure(config.rules_ca.as_deref()).map_err(|e| anyhow::anyhow!("--rules-ca: {e}"))?;
    let source = RulesSource::open(&config).await?;
    let (rules, rules_from) = source.initial().await?;
    let access =
        store::shards::RedisAccess::load(config.redis_ca.as_deref(), config.redis_password_file.as_deref())?;
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
    let listener = server::bind(&config.socket, config.socket_mode)
        .with_context(|| format!("cannot serve socket {}", config.socket.display()))?;
    tracing::info!(socket = %config.socket.display(), mode = format!("{:04o}", config.socket_mode), "floodgate agent listening");
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
        let handle = metrics::install()?;
        tokio::spawn(metrics::upkeep(handle.clone(), shutdown.clone()));
        Some(handle)
    } else {
        None
    };
    let mut options = options;
    let mut events_task = None;
    if let (Store::Redis(_), true) = (&store, config.events) {
        let (events, rx) = events::Events::new(config.events_queue);
        let shards = store::shards::Shards::new(
            &config.redis_urls(),
            config.redis_cluster,
            config.redis_buckets,
            &access,
        )?;
        let stream = events::StreamConfig {
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
            tokio::spawn(events::write_loop(shards, rx, stream, stop_rx)),
        ));
        options.events = Some(Arc::new(events));
    }
    let engine = Engine::with_guard(rules, store.clone(), guard.clone(), options);
    source.start(&engine, &config, shutdown.clone()).await?;
    if let Some(rx) = reloads {
        let file = matches!(source, RulesSource::File(_));
        tokio::spawn(apply_reloads(engine.clone(), file, rx));
    }
    let guard_task = match (&store, guard) {
        (Store::Redis(r), Some(g)) => Some(tokio::spawn(guard_loop(
            g,
            r.clone(),
            engine.clone(),
            shutdown.clone(),
        ))),
        _ => None,
    };
    if let Store::Memory(m) = &store {
        let m = m.clone();
        tokio::spawn(server::every(
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
        tracing::info!(addr = %listener.local_addr()?, "admin HTTP listening");
        let app = admin::app(engine.clone()).layer(axum::Extension(metrics.clone()));
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

    let flusher = match &store {
        Store::Redis(r) => Some(tokio::spawn(flush_loop(
            engine.clone(),
            r.clone(),
            shutdown.clone(),
        ))),
        Store::Memory(_) => None,
    };

    // Each listener has a cap of its own, so clients of one (pods over TCP, say) cannot take the
    // slots of another (the host's services on the socket, Envoy over gRPC).
    let cap = || server::ConnectionCap::new(config.max_connections);
    let mut listeners = Vec::new();
    if let Some(addr) = config.listen_tcp {
        let tcp = tokio::net::TcpListener::bind(addr)
            .await
            .with_context(|| format!("cannot listen on TCP {addr}"))?;
        tracing::info!(addr = %tcp.local_addr()?, "frames protocol on TCP");
        listeners.push(tokio::spawn(server::serve(
            server::Listener::Tcp(tcp),
            engine.clone(),
            cap(),
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
    server::serve(server::Listener::Unix(listener), engine.clone(), cap(), shutdown).await;
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
    let _ = std::fs::remove_file(&config.socket);
    if let Some(path) = &config.grpc_socket {
        let _ = std::fs::remove_file(path);
    }
    if let (Some(task), Store::Redis(r)) = (flusher, &store) {
        // In-flight checks are answered; what batched rules admitted since the last flush goes now.
        let _ = tokio::time::timeout(Duration::from_secs(2), task).await;
        let sent = flush(&engine, r, true).await;
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

/// How often the flusher looks for rules whose flush is due (the shortest useful interval).
const FLUSH_TICK: Duration = Duration::from_millis(5);

/// Flushes batched rules' counts when due, until shutdown.
async fn flush_loop(engine: Arc<Engine>, redis: Arc<RedisStore>, mut shutdown: watch::Receiver<bool>) {
    let mut tick = tokio::time::interval(FLUSH_TICK);
    tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
    loop {
        tokio::select! {
            _ = tick.tick() => { flush(&engine, &redis, false).await; }
            _ = server::stopped(&mut shutdown) => break,
        }
    }
}

/// One flush: the entries of every due rule (all when `force`), sent per shard, the replies applied.
/// Returns the number of entries sent.
async fn flush(engine: &Engine, redis: &RedisStore, force: bool) -> usize {
    let batcher = engine.batcher();
    if batcher.keys() == 0 {
        return 0;
    }
    let rules: Vec<Arc<rules::Rule>> = engine.rules().iter().cloned().collect();
    let entries = batcher.take_due(&rules, engine.live_agents(), force);
    let sent = entries.len();
    if sent == 0 {
        return 0;
    }
    for (chunk, reply) in redis.flush(entries).await {
        match reply {
            Ok(r) => {
                batcher.learn_clock(r.now_ms, r.sent_ms, r.answered_ms);
                batcher.apply(&chunk, Ok(&r.learned));
            }
            Err(e) => {
                tracing::debug!(error = %e, entries = chunk.len(), "flush failed");
                let surely = !matches!(e, crate::store::StoreError::Timeout(_));
                batcher.apply(&chunk, Err(surely));
            }
        }
    }
    sent
}

/// The guard's background work for a Redis store: the heartbeat (learning N), the write-back of what
/// the fallback admitted once the breaker is closed again, and the fallback's expiry sweep.
async fn guard_loop(
    guard: Arc<Guard>,
    redis: Arc<RedisStore>,
    engine: Arc<Engine>,
    mut shutdown: watch::Receiver<bool>,
) {
    let interval = guard.membership.config().interval;
    let mut beat = tokio::time::interval(interval);
    beat.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
    let mut tick = tokio::time::interval(Duration::from_millis(100));
    let mut sweep = tokio::time::interval(Duration::from_secs(5));
    let id = guard.membership.config().id.clone();
    let ttl = guard.membership.config().ttl;
    if let Err(e) = redis.preload().await {
        tracing::warn!(error = %e, "could not load the check script yet; checks will load it on NOSCRIPT");
    }
    loop {
        tokio::select! {
            _ = beat.tick() => match redis.heartbeat(&id, ttl, false).await {
                Ok(n) => {
                    let before = guard.membership.live();
                    guard.membership.observe(n);
                    if n != before {
                        tracing::info!(live_agents = n, "live agents changed");
                    }
                }
                Err(e) => tracing::debug!(error = %e, "heartbeat failed; keeping the last known agent count"),
            },
            _ = tick.tick() => {
                for shard in 0..guard.breakers.len() {
                    if guard.breaker(shard).snapshot().state != BreakerState::Closed {
                        probe(&guard, &redis, shard).await;
                    }
                }
                if guard.fallback.pending() > 0 {
                    write_back(&guard, &redis).await;
                }
            }
            _ = sweep.tick() => {
                guard.fallback.sweep();
                engine.cache().sweep(crate::store::Clock::System.now_ms());
            }
            _ = server::stopped(&mut shutdown) => break,
        }
    }
    write_back(&guard, &redis).await;
    let _ = redis.heartbeat(&id, ttl, true).await;
}

/// Once the cool-down is over, one background call decides whether the store is back: it loads the
/// check script (a restarted Redis has an empty cache) with a timeout no check could afford, so a
/// slow reconnection does not keep the breaker open, and no caller waits on it.
async fn probe(guard: &Guard, redis: &RedisStore, shard: usize) {
    let breaker = guard.breaker(shard);
    let permit = breaker.permit(std::time::Instant::now());
    if permit != Permit::Probe {
        return;
    }
    let ok = redis.probe(shard).await.is_ok();
    if breaker.record(permit, ok, std::time::Instant::now()) == Some(Transition::Closed) {
        tracing::info!(shard, "store answers again: circuit breaker closed");
    }
}

/// Most ledger entries one write-back pass takes: bounded work per pass on the agent's thread.
const WRITE_BACK_BATCH: usize = 10_000;

/// Writes back what the fallback admitted, for the shards whose breaker is closed (the rest waits).
async fn write_back(guard: &Guard, redis: &RedisStore) {
    let entries = guard.fallback.drain(WRITE_BACK_BATCH);
    if entries.is_empty() {
        return;
    }
    let (ready, waiting): (Vec<_>, Vec<_>) = entries
        .into_iter()
        .partition(|e| guard.breaker(redis.route(&e.key).shard).snapshot().state == BreakerState::Closed);
    guard.fallback.restore(waiting);
    if ready.is_empty() {
        return;
    }
    let keys = ready.len();
    let done = redis.adjust(ready, Adjust::Add).await;
    guard
        .fallback
        .written_back
        .fetch_add(done.units, std::sync::atomic::Ordering::Relaxed);
    match done.error {
        None => tracing::info!(
            keys,
            units = done.units,
            over_limit = done.over,
            "wrote back what the fallback admitted while Redis was away"
        ),
        Some(e) => {
            // A timed-out call may have been applied: it is dropped rather than risk counting twice.
            tracing::warn!(error = %e, keys, units = done.units, over_limit = done.over, retry = done.retry.len(), unknown_units = done.unknown, "write-back failed part-way; retrying the rest");
            guard.fallback.restore(done.retry);
        }
    }
}

/// Where the agent's rules come from.
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

enum RulesSource {
    /// A file read at start.
    File(std::path::PathBuf),
    /// A rules service the agent follows.
    Service(rules::follow::FollowConfig),
    /// The embedded default: the agent serves the rules API itself over a SQLite file.
    Embedded(Arc<rules::service::ServiceState>),
}

impl RulesSource {
    async fn open(config: &AgentConfig) -> anyhow::Result<Self> {
        if let Some(path) = &config.rules {
            return Ok(RulesSource::File(path.clone()));
        }
        if let Some(url) = &config.rules_url {
            let cache = config.rules_cache();
            return Ok(RulesSource::Service(rules::follow::FollowConfig {
                url: url.clone(),
                token: config.rules_token.clone(),
                poll: Duration::from_millis(config.rules_poll_ms.max(100)),
                watch: Duration::from_secs(config.rules_watch_s.min(rules::service::MAX_WATCH_SECONDS)),
                cache: Some(cache),
            }));
        }
        let db = config.rules_db();
        let store = rules::store::RulesStore::open(&db).await.with_context(|| {
            format!("cannot open the rules store {db}; name a writable file with --rules-db")
        })?;
        let state = rules::service::ServiceState::new(store, &[]).await?;
        let example: Vec<rules::Rule> = RuleSet::parse(rules::EXAMPLE_RULES)?
            .iter()
            .map(|r| (**r).clone())
            .collect();
        state.seed(&example).await?;
        Ok(RulesSource::Embedded(state))
    }

    /// The rule set to start with, and where it came from (for the log).
    async fn initial(&self) -> anyhow::Result<(RuleSet, String)> {
        Ok(match self {
            RulesSource::File(path) => (RuleSet::load(path)?, path.display().to_string()),
            RulesSource::Service(f) => match f.cache.as_deref().and_then(rules::follow::load_cache) {
                Some(set) => {
                    let from = format!("the cache of {} (version {})", f.url, set.version());
                    (set, from)
                }
                None => {
                    tracing::warn!(url = %f.url, "no cached rule set: no rule is known until the rules service answers");
                    (RuleSet::default(), format!("{} (not reached yet)", f.url))
                }
            },
            RulesSource::Embedded(state) => {
                let (version, rules) = state.store.snapshot().await?;
                let set = RuleSet::new(rules)?.with_version(version);
                (
                    set,
                    format!(
                        "the embedded rules store {} (version {version})",
                        state.store.describe()
                    ),
                )
            }
        })
    }

    /// Starts following the source (service or embedded store); serves the embedded API.
    async fn start(
        &self,
        engine: &Arc<Engine>,
        config: &AgentConfig,
        shutdown: watch::Receiver<bool>,
    ) -> anyhow::Result<()> {
        match self {
            RulesSource::File(_) => {
                // No service to report the dry run to: its tally starts over every 5 s, as a
                // reported one does, so each key's next would-be rejection is news (an event) again.
                let engine = engine.clone();
                tokio::spawn(server::every(Duration::from_secs(5), shutdown, move || {
                    drop(engine.dry_run().take());
                    std::future::ready(())
                }));
            }
            RulesSource::Service(f) => {
                tracing::info!(url = %f.url, poll_ms = f.poll.as_millis() as u64, watch_s = f.watch.as_secs(), "following the rules service");
                tokio::spawn(rules::follow::follow(engine.clone(), f.clone(), shutdown.clone()));
                // Log mode's would-be rejections go to the service every 5 s.
                let (engine, f) = (engine.clone(), f.clone());
                tokio::spawn(server::every(Duration::from_secs(5), shutdown, move || {
                    let (engine, f) = (engine.clone(), f.clone());
                    async move {
                        for (rule, tally) in engine.dry_run().take() {
                            let body = serde_json::to_vec(&tally).unwrap_or_default();
                            let path = format!("/v1/rules/{rule}/dry-run");
                            let sent = rules::http::request(
                                &f.url,
                                "POST",
                                &path,
                                f.token.as_deref(),
                                &[],
                                Some(&body),
                                Duration::from_secs(5),
                            )
                            .await;
                            match sent {
                                Ok(r) if r.status < 300 => {}
                                // The rule is gone or moved on: its report has nowhere to go.
                                Ok(r) if r.status == 404 || r.status == 409 => {}
                                Ok(r) => {
                                    tracing::debug!(
                                        status = r.status,
                                        rule,
                                        "the dry-run report was refused; it goes with the next one"
                                    );
                                    engine.dry_run().give_back(&rule, tally);
                                }
                                Err(e) => {
                                    tracing::debug!(error = %e, rule, "could not report the dry run; it goes with the next one");
                                    engine.dry_run().give_back(&rule, tally);
                                }
                            }
                        }
                    }
                }));
            }
            RulesSource::Embedded(state) => {
                if let Admin::At(addr) = config.rules_listen {
                    anyhow::ensure!(
                        addr.ip().is_loopback(),
                        "the embedded rules API has no token, so it listens on loopback only, not {addr}; run `floodgate rules-server --token …` to serve it further"
                    );
                    let listener = tokio::net::TcpListener::bind(addr)
                        .await
                        .with_context(|| {
                            format!("cannot serve the rules API on {addr} (another agent on this host? give this one --rules-listen off or another address, and its own --rules-db)")
                        })?;
                    tracing::info!(addr = %listener.local_addr()?, store = %state.store.describe(), "rules API listening (embedded, loopback only, no token)");
                    let app = rules::service::app(state.clone());
                    let (mut stop, closing) = (shutdown.clone(), state.clone());
                    tokio::spawn(async move {
                        let graceful = async move {
                            server::stopped(&mut stop).await;
                            closing.close();
                        };
                        if let Err(e) = axum::serve(listener, app).with_graceful_shutdown(graceful).await {
                            tracing::error!(error = %e, "rules API failed");
                        }
                    });
                }
                // Log mode's would-be rejections go to the embedded service every second.
                let (e, s) = (engine.clone(), state.clone());
                tokio::spawn(server::every(
                    Duration::from_secs(1),
                    shutdown.clone(),
                    move || {
                        for (rule, tally) in e.dry_run().take() {
                            s.dry_run.add(&rule, tally, store::Clock::System.now_ms());
                        }
                        std::future::ready(())
                    },
                ));
                // Follow the embedded store: every write announces its version.
                let (engine, state) = (engine.clone(), state.clone());
                let mut changes = state.subscribe();
                let mut stop = shutdown;
                tokio::spawn(async move {
                    loop {
                        tokio::select! {
                            changed = changes.changed() => if changed.is_err() { break },
                            _ = server::stopped(&mut stop) => break,
                        }
                        match state.store.snapshot().await {
                            Ok((version, rules)) => {
                                rules::follow::apply(
                                    &engine,
                                    rules::follow::Snapshot { version, rules },
                                    None,
                                );
                            }
                            Err(e) => {
                                tracing::warn!(error = %e, "could not read the rules store; keeping the rule set in force")
                            }
                        }
                    }
                });
            }
        }
        Ok(())
    }
}

/// Runs the rules service until `shutdown` turns true (`floodgate rules-server`).
pub async fn run_rules_server(
    config: crate::config::RulesServerConfig,
    mut shutdown: watch::Receiver<bool>,
) -> anyhow::Result<()> {
    if config.tokens.is_empty() {
        anyhow::ensure!(
            config.listen.ip().is_loopback(),
            "no --token configured: the rules API would be open to anyone, so it listens on loopback only, not {}",
            config.listen
        );
        tracing::warn!("no --token configured: the rules API listens on loopback only and asks for no token");
    }
    let store = rules::store::RulesStore::open(&config.db)
        .await
        .with_context(|| format!("cannot open the rules store {}", config.db))?;
    let state = rules::service::ServiceState::new(store, &config.tokens).await?;
    let listener = tokio::net::TcpListener::bind(config.listen)
        .await
        .with_context(|| format!("cannot serve the rules API on {}", config.listen))?;
    tracing::info!(addr = %listener.local_addr()?, store = %state.store.describe(), tokens = config.tokens.len(), "rules service listening");
    tokio::spawn(rules::service::poll_version(state.clone(), shutdown.clone()));
    let app = rules::service::app(state.clone());
    if let (Some(cert), Some(key)) = (&config.tls_cert, &config.tls_key) {
        let tls =
            rules::http::server_tls(cert, key).map_err(|e| anyhow::anyhow!("rules service TLS: {e}"))?;
        tracing::info!(cert = %cert.display(), "rules service over TLS (https)");
        serve_tls(listener, app, tls, shutdown, state).await;
        tracing::info!("rules service stopped");
        return Ok(());
    }
    axum::serve(listener, app)
        .with_graceful_shutdown(async move {
            server::stopped(&mut shutdown).await;
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
    state: Arc<rules::service::ServiceState>,
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
            _ = server::stopped(&mut shutdown) => break,
            Some(_) = tasks.join_next(), if !tasks.is_empty() => {}
        }
    }
    state.close();
    let drain = async { while tasks.join_next().await.is_some() {} };
    if tokio::time::timeout(Duration::from_secs(2), drain).await.is_err() {
        tasks.abort_all();
    }
}
