//! The agent daemon, in three named steps (linkerd2-proxy's shape):
//! - `build.rs`: every part made (rules source, store, guard, engine, exporter, events queue) and
//!   every listener bound; a failure here starts nothing;
//! - [`Built::spawn`] (here): the listeners served and the background loops started;
//! - `drain.rs`: after shutdown, a numbered sequence of bounded steps.
//!
//! `rules_source.rs` is where the rules come from (a file, a followed service, the embedded API);
//! `loops.rs` the flush and guard loops. Reloads (SIGHUP) are `crate::reload`'s.

mod build;
mod drain;
pub use drain::TRACES;
mod loops;
mod rules_source;

use std::sync::Arc;
use std::time::Duration;

use floodgate_core::engine::Store;
use tokio::sync::{mpsc, watch};

pub(crate) use build::{build, Built};
use drain::Running;

use crate::reload::Reload;
use crate::{admin, envoy, exporter, server};

/// Runs the agent until `shutdown` turns true: builds it, serves it, and drains it.
pub async fn run(config: crate::config::AgentConfig, shutdown: watch::Receiver<bool>) -> anyhow::Result<()> {
    run_with_reloads(config, shutdown, None).await
}

/// [`run`], applying each [`Reload`] that arrives (`crate::reload::apply`).
pub async fn run_with_reloads(
    config: crate::config::AgentConfig,
    shutdown: watch::Receiver<bool>,
    reloads: Option<mpsc::UnboundedReceiver<Reload>>,
) -> anyhow::Result<()> {
    let running = build(config).await?.spawn(shutdown, reloads);
    running.drain().await;
    Ok(())
}

impl Built {
    /// Starts everything built: the rules source, the reloads, the guard and flush loops, the
    /// in-memory store's sweep, the exporter, the events writer, and every listener.
    pub(crate) fn spawn(
        self,
        shutdown: watch::Receiver<bool>,
        reloads: Option<mpsc::UnboundedReceiver<Reload>>,
    ) -> Running {
        let Built {
            config,
            engine,
            store,
            guard,
            source,
            metrics,
            events,
            listeners,
            warmed,
        } = self;
        if let Some(handle) = &metrics {
            tokio::spawn(exporter::upkeep(handle.clone(), shutdown.clone()));
        }
        // The writer stops after the listeners (which answer in-flight checks after shutdown), so
        // it sees every event: drain step 6.
        let events = events.map(|(rx, shards, stream)| {
            let (stop_tx, stop_rx) = watch::channel(false);
            let task = tokio::spawn(floodgate_redis::events::write_loop(shards, rx, stream, stop_rx));
            (stop_tx, task)
        });
        // Traces' exporter, stopped last (drain step 7), so it sends every check's span.
        // Read when the agent started (`commands::agent`), so an error here is a variable changed
        // since: traces stay off, and the log says why.
        let otlp = config
            .otlp
            .config()
            .inspect_err(
                |e| tracing::error!(error = %e, "traces off: an OpenTelemetry variable cannot be read"),
            )
            .ok();
        let exporter = otlp.as_ref().and_then(|c| {
            crate::otel::install(c)
                .inspect_err(|e| tracing::error!(error = %e, "traces off"))
                .ok()
                .flatten()
        });
        let traces = exporter.map(|exporter| {
            let otlp = otlp.as_ref().expect("installed from it");
            tracing::info!(
                endpoint = otlp.endpoint.as_deref().unwrap_or_default(),
                sample_ratio = otlp.sample_ratio,
                headers = otlp.headers.len(),
                encoding = ?otlp.encoding,
                "exporting traces (OTLP)"
            );
            let (stop_tx, stop_rx) = watch::channel(false);
            (
                stop_tx,
                tokio::spawn(crate::otel::run_exporter(exporter, stop_rx)),
            )
        });
        let rules_file = matches!(source, rules_source::RulesSource::File(_));
        source.start(&engine, &config, shutdown.clone());
        if let Some(rx) = reloads {
            tokio::spawn(crate::reload::apply(
                engine.clone(),
                rules_file,
                listeners.grpc_tls.clone(),
                rx,
            ));
        }
        let guard = match (&store, guard) {
            (Store::Shared(r), Some(g)) => Some(tokio::spawn(loops::guard_loop(
                g,
                r.clone(),
                engine.clone(),
                warmed,
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
        {
            // Reservations past their time, settled as their rules say, every second (late is
            // strict: an expired reservation's units stay counted until then).
            let engine = engine.clone();
            tokio::spawn(floodgate_core::tasks::every(
                Duration::from_secs(1),
                shutdown.clone(),
                move || {
                    engine.expire_reservations();
                    std::future::ready(())
                },
            ));
        }
        if let Some(listener) = listeners.admin {
            let app = admin::app(engine.clone()).layer(axum::Extension(metrics.clone()));
            // No token: on loopback only loopback Hosts (DNS rebinding); anywhere, no cross-site
            // writes. Bodies may be sent as curl sends them: a form cannot PUT.
            let loopback = listener.local_addr().is_ok_and(|a| a.ip().is_loopback());
            let guard = floodgate_rules_service::browser::BrowserGuard {
                loopback_host: loopback,
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
            Store::Shared(r) => Some((
                tokio::spawn(loops::flush_loop(engine.clone(), r.clone(), shutdown.clone())),
                r.clone(),
            )),
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
        let mut tasks = Vec::new();
        if let Some(tcp) = listeners.tcp {
            tasks.push(tokio::spawn(server::serve(
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
        let grpc_serving = envoy::GrpcServing {
            server: config.grpc_server,
            frame_timeout: Duration::from_millis(config.frame_timeout_ms.get()),
            idle_timeout: Duration::from_millis(config.idle_timeout_ms.get()),
            tls: listeners.grpc_tls.clone(),
        };
        if let Some(tcp) = listeners.grpc_tcp {
            let (grpc, cap, stop, serving) = (grpc.clone(), cap(), shutdown.clone(), grpc_serving.clone());
            tasks.push(tokio::spawn(async move {
                if let Err(e) = envoy::serve_tcp(tcp, grpc, cap, serving, stop).await {
                    tracing::error!(error = %e, "gRPC server failed");
                }
            }));
        }
        let (socket_path, socket) = listeners.socket;
        let mut socket_files = vec![socket_path];
        if let Some((path, unix)) = listeners.grpc_unix {
            socket_files.push(path);
            // A local socket: no TLS.
            let serving = envoy::GrpcServing {
                tls: None,
                ..grpc_serving.clone()
            };
            let (grpc, cap, stop) = (grpc.clone(), cap(), shutdown.clone());
            tasks.push(tokio::spawn(async move {
                if let Err(e) = envoy::serve_unix(unix, grpc, cap, serving, stop).await {
                    tracing::error!(error = %e, "gRPC server failed");
                }
            }));
        }
        let socket_server = tokio::spawn(server::serve(
            server::Listener::Unix(socket),
            engine.clone(),
            serving,
            shutdown,
        ));
        Running {
            engine,
            socket_server,
            listeners: tasks,
            socket_files,
            flusher,
            guard,
            events,
            traces,
        }
    }
}
