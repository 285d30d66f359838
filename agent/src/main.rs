//! `floodgate`: one binary, several roles. `floodgate agent` runs the per-host agent,
//! `floodgate rules-server` the rules service, `floodgate rules …` is the operators' CLI.

use clap::{Parser, Subcommand};
use tokio::signal::unix::{signal, SignalKind};
use tokio::sync::watch;

use floodgate_agent::cli::RulesCli;
use floodgate_agent::config::{AgentConfig, RulesServerConfig};

#[derive(Parser)]
#[command(
    name = "floodgate",
    version,
    about = "Fleet-wide rate limiting: agent and tools"
)]
struct Cli {
    #[command(subcommand)]
    command: Command,
}

#[derive(Subcommand)]
enum Command {
    /// Run the per-host agent (embedded store unless --redis is given).
    Agent(Box<AgentConfig>),
    /// Run the rules service: the rules API over SQLite or PostgreSQL.
    RulesServer(RulesServerConfig),
    /// Operate on rules through the rules API.
    Rules(RulesCli),
}

fn runtime(threads: usize) -> anyhow::Result<tokio::runtime::Runtime> {
    let mut builder = tokio::runtime::Builder::new_multi_thread();
    if threads > 0 {
        builder.worker_threads(threads);
    }
    Ok(builder.enable_all().build()?)
}

/// A shutdown signal that turns true on SIGTERM or SIGINT.
fn shutdown_on_signals() -> anyhow::Result<watch::Receiver<bool>> {
    let (tx, rx) = watch::channel(false);
    let mut term = signal(SignalKind::terminate())?;
    let mut int = signal(SignalKind::interrupt())?;
    tokio::spawn(async move {
        tokio::select! {
            _ = term.recv() => tracing::info!("SIGTERM: shutting down"),
            _ = int.recv() => tracing::info!("SIGINT: shutting down"),
        }
        let _ = tx.send(true);
    });
    Ok(rx)
}

fn init_log(filter: &str) -> anyhow::Result<()> {
    tracing_subscriber::fmt()
        .with_env_filter(tracing_subscriber::EnvFilter::try_new(filter)?)
        .with_writer(std::io::stderr)
        .init();
    Ok(())
}

fn main() -> anyhow::Result<()> {
    let cli = Cli::parse();
    match cli.command {
        Command::Agent(config) => {
            init_log(&config.log)?;
            runtime(config.threads)?.block_on(async move {
                let rx = shutdown_on_signals()?;
                floodgate_agent::run(*config, rx).await
            })
        }
        Command::RulesServer(config) => {
            init_log(&config.log)?;
            runtime(1)?.block_on(async move {
                let rx = shutdown_on_signals()?;
                floodgate_agent::run_rules_server(config, rx).await
            })
        }
        Command::Rules(cli) => {
            // An operator's command: a one-line error and exit code 1, no backtrace.
            if let Err(e) = runtime(1)?.block_on(floodgate_agent::cli::run(cli)) {
                eprintln!("error: {e:#}");
                std::process::exit(1);
            }
            Ok(())
        }
    }
}
