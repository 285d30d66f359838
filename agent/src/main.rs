//! `floodgate`: one binary, several roles. `floodgate agent` runs the per-host agent.

use clap::{Parser, Subcommand};
use tokio::signal::unix::{signal, SignalKind};
use tokio::sync::watch;

use floodgate_agent::config::AgentConfig;

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
    Agent(AgentConfig),
}

fn main() -> anyhow::Result<()> {
    let cli = Cli::parse();
    match cli.command {
        Command::Agent(config) => {
            tracing_subscriber::fmt()
                .with_env_filter(tracing_subscriber::EnvFilter::try_new(&config.log)?)
                .with_writer(std::io::stderr)
                .init();
            let mut builder = tokio::runtime::Builder::new_multi_thread();
            if config.threads > 0 {
                builder.worker_threads(config.threads);
            }
            let runtime = builder.enable_all().build()?;
            runtime.block_on(async move {
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
                floodgate_agent::run(config, rx).await
            })
        }
    }
}
