//! `floodgate`: one binary, several roles. `floodgate agent` runs the per-host agent,
//! `floodgate rules-server` the rules service, `floodgate rules …` is the operators' CLI for rules,
//! `floodgate check` and `floodgate status` look at a running agent, and `floodgate completions` /
//! `floodgate man` print shell completions and the man page.

use clap::{CommandFactory, Parser, Subcommand};
use tokio::signal::unix::{signal, SignalKind};
use tokio::sync::watch;

use floodgate_agent::cli::RulesCli;
use floodgate_agent::config::{AgentConfig, LogFormat, RulesServerConfig};
use floodgate_agent::ops::{CheckCli, CheckOutcome, StatusCli};

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
    /// Ask the local agent for one decision (the cost is consumed): exit code 0 allowed, 1 denied,
    /// 2 the agent could not answer.
    Check(CheckCli),
    /// The local agent's state: breakers, fallback, live agents, rules version, batching.
    Status(StatusCli),
    /// Print shell completions (bash, zsh, fish, elvish, powershell).
    Completions {
        /// The shell.
        shell: clap_complete::Shell,
    },
    /// Print the man page (roff).
    Man,
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

fn init_log(filter: &str, format: LogFormat) -> anyhow::Result<()> {
    let builder = tracing_subscriber::fmt()
        .with_env_filter(tracing_subscriber::EnvFilter::try_new(filter)?)
        .with_writer(std::io::stderr);
    match format {
        LogFormat::Text => builder.init(),
        LogFormat::Json => builder.json().flatten_event(true).init(),
    }
    Ok(())
}

/// An operator's command: a one-line error and `code`, no backtrace.
fn operator<T>(code: i32, f: impl std::future::Future<Output = anyhow::Result<T>>) -> anyhow::Result<T> {
    match runtime(1)?.block_on(f) {
        Ok(v) => Ok(v),
        Err(e) => {
            eprintln!("error: {e:#}");
            std::process::exit(code);
        }
    }
}

/// Writes to stdout; a reader that stops early (`| head`) is not an error.
fn print_all(bytes: &[u8]) -> anyhow::Result<()> {
    use std::io::Write;
    match std::io::stdout().write_all(bytes) {
        Err(e) if e.kind() == std::io::ErrorKind::BrokenPipe => Ok(()),
        other => Ok(other?),
    }
}

fn main() -> anyhow::Result<()> {
    let cli = Cli::parse();
    match cli.command {
        Command::Agent(config) => {
            init_log(&config.log, config.log_format)?;
            runtime(config.threads)?.block_on(async move {
                let rx = shutdown_on_signals()?;
                floodgate_agent::run(*config, rx).await
            })
        }
        Command::RulesServer(config) => {
            init_log(&config.log, config.log_format)?;
            runtime(1)?.block_on(async move {
                let rx = shutdown_on_signals()?;
                floodgate_agent::run_rules_server(config, rx).await
            })
        }
        Command::Rules(cli) => operator(1, floodgate_agent::cli::run(cli)),
        Command::Check(cli) => match operator(2, floodgate_agent::ops::check(cli))? {
            CheckOutcome::Allowed => Ok(()),
            CheckOutcome::Denied => std::process::exit(1),
        },
        Command::Status(cli) => operator(1, floodgate_agent::ops::status(cli)),
        Command::Completions { shell } => {
            let mut out = Vec::new();
            clap_complete::generate(shell, &mut Cli::command(), "floodgate", &mut out);
            print_all(&out)
        }
        Command::Man => {
            let mut out = Vec::new();
            clap_mangen::Man::new(Cli::command()).render(&mut out)?;
            print_all(&out)
        }
    }
}
