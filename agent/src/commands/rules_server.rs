//! `floodgate rules-server`: the rules service (the rules API over SQLite or PostgreSQL), until
//! SIGTERM or SIGINT.

use crate::config::RulesServerConfig;

/// Runs the rules service on a one-worker runtime.
pub(super) fn run(config: RulesServerConfig) -> anyhow::Result<()> {
    let _log = super::init_log(&config.log, config.log_format)?;
    super::runtime(1)?.block_on(async move {
        let shutdown = super::shutdown_on_signals()?;
        floodgate_rules_service::run(config.serve_options(), shutdown).await
    })
}
