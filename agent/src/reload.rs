//! The agent's configuration file and its reload: the file's keys applied as the flags' defaults
//! (flags and environment variables still win), and on SIGHUP the command line, environment and file
//! read again, the log filter set, and what changed applied to the running agent (the default flush
//! interval and the rules file at run time; any other key is logged as needing a restart).

use std::sync::Arc;

use clap::{Args, FromArgMatches};
use floodgate_core::engine::Engine;
use floodgate_core::rules::RuleSet;
use tokio::signal::unix::{signal, SignalKind};
use tokio::sync::mpsc;

use crate::commands::{agent_matches, LogHandle};
use crate::config::AgentConfig;

/// A reload (SIGHUP): the configuration read again, and the keys that changed.
#[derive(Debug)]
pub struct Reload {
    /// The new configuration.
    pub config: AgentConfig,
    /// The keys (`settings::keys`) whose values differ from the running ones.
    pub changed: Vec<String>,
}

/// `cmd` with `floodgate agent`'s config file (`--config`, `FLOODGATE_CONFIG`) applied as its flags'
/// defaults, when `args` run the agent and name one.
pub fn command_with_file(cmd: clap::Command, args: &[std::ffi::OsString]) -> anyhow::Result<clap::Command> {
    let agent = args
        .iter()
        .skip(1)
        .find(|a| !a.to_string_lossy().starts_with('-'));
    if agent.is_none_or(|a| a != "agent") {
        return Ok(cmd);
    }
    let Some(path) = crate::settings::config_path(args) else {
        return Ok(cmd);
    };
    let text = std::fs::read_to_string(&path)
        .map_err(|e| anyhow::anyhow!("cannot read config file {}: {e}", path.display()))?;
    let mut failure = None;
    let cmd = cmd.mut_subcommand("agent", |sc| {
        crate::settings::apply_file(sc.clone(), &text).unwrap_or_else(|e| {
            failure = Some(format!("{}: {e}", path.display()));
            sc
        })
    });
    match failure {
        Some(e) => anyhow::bail!(e),
        None => Ok(cmd),
    }
}

/// On SIGHUP: reads `args`, the environment and the config file again, sets the new log filter,
/// and sends the new configuration and what changed (an invalid configuration changes nothing).
pub(crate) fn on_sighup(
    args: Vec<std::ffi::OsString>,
    log: LogHandle,
) -> anyhow::Result<mpsc::UnboundedReceiver<Reload>> {
    let (tx, rx) = mpsc::unbounded_channel();
    let mut hup = signal(SignalKind::hangup())?;
    let mut current = agent_matches(&args)?;
    tokio::spawn(async move {
        while hup.recv().await.is_some() {
            let next = match agent_matches(&args) {
                Ok(m) => m,
                Err(e) => {
                    tracing::warn!(error = %e, "reload (SIGHUP) refused: the configuration is invalid; nothing changed");
                    continue;
                }
            };
            let Ok(config) = AgentConfig::from_arg_matches(&next) else {
                continue;
            };
            let agent = AgentConfig::augment_args(clap::Command::new("agent"));
            let changed = crate::settings::changed(&agent, &current, &next);
            if changed.iter().any(|k| k == "log") {
                match tracing_subscriber::EnvFilter::try_new(&config.log) {
                    Ok(f) => {
                        let _ = log.reload(f);
                    }
                    Err(e) => tracing::warn!(error = %e, "reload: the log filter is invalid; it stays"),
                }
            }
            current = next;
            if tx.send(Reload { config, changed }).is_err() {
                return;
            }
        }
    });
    Ok(rx)
}

/// Applies reloads to the running agent until the sender is gone (`rules_file`: its rules come from
/// a file, which is read again on every reload).
pub(crate) async fn apply(
    engine: Arc<Engine>,
    rules_file: bool,
    grpc_tls: Option<Arc<crate::envoy::GrpcTls>>,
    mut rx: mpsc::UnboundedReceiver<Reload>,
) {
    while let Some(r) = rx.recv().await {
        let mut applied = Vec::new();
        // Certificate files are read again on every reload (a renewal keeps their paths).
        if let Some(tls) = &grpc_tls {
            match tls.reload() {
                Ok(()) => applied.push("grpc TLS files (read again)".to_string()),
                Err(e) => tracing::warn!(
                    error = %format!("{e:#}"),
                    "reload: the gRPC TLS files are refused; the running certificate stays"
                ),
            }
        }
        let mut restart = Vec::new();
        for key in &r.changed {
            match key.as_str() {
                "flush_interval_ms" => {
                    engine.batcher().set_flush_ms(None, r.config.flush_interval_ms);
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
