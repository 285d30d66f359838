//! `floodgate rules-server`: the rules service (the rules API over SQLite or PostgreSQL), until
//! SIGTERM or SIGINT.

use crate::config::RulesServerConfig;

/// Runs the rules service on a one-worker runtime.
pub(super) fn run(config: RulesServerConfig) -> anyhow::Result<()> {
    let _log = super::init_log(&config.log, config.log_format)?;
    super::runtime(1)?.block_on(async move {
        let shutdown = super::shutdown_on_signals()?;
        let otlp = config.otlp.config().map_err(|e| anyhow::anyhow!("traces: {e}"))?;
        let exporter = crate::otel::install(&otlp).map_err(|e| anyhow::anyhow!("traces: {e}"))?;
        let traces = exporter.map(|exporter| {
            let (stop_tx, stop_rx) = tokio::sync::watch::channel(false);
            (
                stop_tx,
                tokio::spawn(crate::otel::run_exporter(exporter, stop_rx)),
            )
        });
        let mut options = config.serve_options();
        if crate::otel::enabled() {
            options.wrap = Some(crate::otel::wrap_router as fn(axum::Router) -> axum::Router);
        }
        let served = floodgate_rules_service::run(options, shutdown).await;
        if let Some((stop, task)) = traces {
            let _ = stop.send(true);
            let _ = tokio::time::timeout(crate::daemon::TRACES, task).await;
        }
        served
    })
}
