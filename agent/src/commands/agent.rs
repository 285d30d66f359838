//! `floodgate agent`: the per-host agent, until SIGTERM or SIGINT; SIGHUP reloads its configuration.

use crate::config::AgentConfig;

/// Runs the agent on its own runtime.
pub(super) fn run(config: AgentConfig) -> anyhow::Result<()> {
    let log = super::init_log(&config.log, config.log_format)?;
    // OpenTelemetry's variables are read once here too, so that one it cannot read stops the
    // start with its name rather than turning traces off.
    config.otlp.config().map_err(|e| anyhow::anyhow!("traces: {e}"))?;
    super::runtime(config.threads)?.block_on(async move {
        let shutdown = super::shutdown_on_signals()?;
        let reloads = crate::reload::on_sighup(std::env::args_os().collect(), log)?;
        crate::daemon::run_with_reloads(config, shutdown, Some(reloads)).await
    })
}
