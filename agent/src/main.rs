//! `floodgate`: one binary, several roles. `floodgate agent` runs the per-host agent,
//! `floodgate rules-server` the rules service, `floodgate rules …` is the operators' CLI for rules,
//! `floodgate check` and `floodgate status` look at a running agent, and `floodgate completions` /
//! `floodgate man` print shell completions and the man page.

use clap::{Args, CommandFactory, FromArgMatches, Parser, Subcommand};
use tokio::signal::unix::{signal, SignalKind};
use tokio::sync::watch;

use floodgate_agent::cli::RulesCli;
use floodgate_agent::config::{AgentConfig, LogFormat, RulesServerConfig};
use floodgate_agent::ops::{CheckCli, CheckOutcome, StatusCli};

/// mimalloc instead of glibc's malloc: a check on the Redis path makes ~15 allocations, which cost
/// ~190 instructions each in glibc (malloc + free, its per-thread cache included) and ~85 in
/// mimalloc's per-thread free lists (BENCHMARKS.md, issue 14).
#[global_allocator]
static ALLOCATOR: mimalloc::MiMalloc = mimalloc::MiMalloc;

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
    /// Print the Markdown table of the agent's settings (docs/configuration.md's table is this output).
    #[command(hide = true)]
    ConfigTable,
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

/// Changes the log filter of a running process.
type LogHandle =
    tracing_subscriber::reload::Handle<tracing_subscriber::EnvFilter, tracing_subscriber::Registry>;

fn init_log(filter: &str, format: LogFormat) -> anyhow::Result<LogHandle> {
    use tracing_subscriber::layer::SubscriberExt;
    use tracing_subscriber::util::SubscriberInitExt;
    let (filter, handle) =
        tracing_subscriber::reload::Layer::new(tracing_subscriber::EnvFilter::try_new(filter)?);
    let fmt = tracing_subscriber::fmt::layer().with_writer(std::io::stderr);
    let registry = tracing_subscriber::registry().with(filter);
    match format {
        LogFormat::Text => registry.with(fmt).init(),
        LogFormat::Json => registry.with(fmt.json().flatten_event(true)).init(),
    }
    Ok(handle)
}

/// On SIGHUP: reads the command line, environment and config file again, sets the new log filter,
/// and hands the new configuration and what changed to the agent.
fn reload_on_sighup(
    args: Vec<std::ffi::OsString>,
    log: LogHandle,
) -> anyhow::Result<tokio::sync::mpsc::UnboundedReceiver<floodgate_agent::Reload>> {
    let (tx, rx) = tokio::sync::mpsc::unbounded_channel();
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
            let changed = floodgate_agent::settings::changed(&agent, &current, &next);
            if changed.iter().any(|k| k == "log") {
                match tracing_subscriber::EnvFilter::try_new(&config.log) {
                    Ok(f) => {
                        let _ = log.reload(f);
                    }
                    Err(e) => tracing::warn!(error = %e, "reload: the log filter is invalid; it stays"),
                }
            }
            current = next;
            if tx.send(floodgate_agent::Reload { config, changed }).is_err() {
                return;
            }
        }
    });
    Ok(rx)
}

/// The `agent` subcommand's matches, config file applied.
fn agent_matches(args: &[std::ffi::OsString]) -> anyhow::Result<clap::ArgMatches> {
    let matches = command(args)?.try_get_matches_from(args)?;
    match matches.subcommand() {
        Some(("agent", m)) => Ok(m.clone()),
        _ => anyhow::bail!("not the agent command"),
    }
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

/// The command line with `floodgate agent`'s config file (`--config`, `FLOODGATE_CONFIG`) applied as
/// its flags' defaults: flags and environment variables override the file.
fn command(args: &[std::ffi::OsString]) -> anyhow::Result<clap::Command> {
    let cmd = Cli::command();
    let agent = args
        .iter()
        .skip(1)
        .find(|a| !a.to_string_lossy().starts_with('-'));
    if agent.is_none_or(|a| a != "agent") {
        return Ok(cmd);
    }
    let Some(path) = floodgate_agent::settings::config_path(args) else {
        return Ok(cmd);
    };
    let text = std::fs::read_to_string(&path)
        .map_err(|e| anyhow::anyhow!("cannot read config file {}: {e}", path.display()))?;
    let mut failure = None;
    let cmd = cmd.mut_subcommand("agent", |sc| {
        floodgate_agent::settings::apply_file(sc.clone(), &text).unwrap_or_else(|e| {
            failure = Some(format!("{}: {e}", path.display()));
            sc
        })
    });
    match failure {
        Some(e) => anyhow::bail!(e),
        None => Ok(cmd),
    }
}

fn parse() -> Cli {
    let args: Vec<std::ffi::OsString> = std::env::args_os().collect();
    let cmd = match command(&args) {
        Ok(cmd) => cmd,
        Err(e) => {
            eprintln!("error: {e:#}");
            std::process::exit(2);
        }
    };
    let matches = cmd.get_matches_from(args);
    Cli::from_arg_matches(&matches).unwrap_or_else(|e| e.exit())
}

fn main() -> anyhow::Result<()> {
    let cli = parse();
    match cli.command {
        Command::Agent(config) => {
            let log = init_log(&config.log, config.log_format)?;
            runtime(config.threads)?.block_on(async move {
                let rx = shutdown_on_signals()?;
                let reloads = reload_on_sighup(std::env::args_os().collect(), log)?;
                floodgate_agent::run_with_reloads(*config, rx, Some(reloads)).await
            })
        }
        Command::RulesServer(config) => {
            let _log = init_log(&config.log, config.log_format)?;
            runtime(1)?.block_on(async move {
                let rx = shutdown_on_signals()?;
                floodgate_rules_service::run(config.serve_options(), rx).await
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
        Command::ConfigTable => {
            let agent = AgentConfig::augment_args(clap::Command::new("agent"));
            print_all(floodgate_agent::settings::table(&agent).as_bytes())
        }
        Command::Man => {
            let mut out = Vec::new();
            clap_mangen::Man::new(Cli::command()).render(&mut out)?;
            print_all(&out)
        }
    }
}
