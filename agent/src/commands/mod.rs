//! The `floodgate` binary's commands, one file each: `agent` runs the per-host agent, `rules-server`
//! the rules service, `rules …` is the operators' CLI for rules, `check` and `status` look at a
//! running agent, `completions`, `man` and `config-table` print what the command line is.

mod agent;
mod check;
mod docs;
mod ledger;
mod rules;
mod rules_server;
mod status;

use clap::{CommandFactory, FromArgMatches, Parser, Subcommand};
use tokio::signal::unix::{signal, SignalKind};
use tokio::sync::watch;

use crate::config::{AgentConfig, LogFormat, RulesServerConfig};
pub use check::{CheckCli, CheckOutcome};
pub use rules::{RulesCli, RulesCommand};
pub use status::StatusCli;

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

/// `floodgate agent --help`'s examples (each is run by `tests/tests/operator.rs`'s help test, up to
/// its flags' parsing).
pub const AGENT_EXAMPLES: &str = "Examples:
  floodgate agent
      the embedded store (exact limits on this host), the built-in example rules in its
      rules API on 127.0.0.1:9791
  floodgate agent --redis redis://127.0.0.1:6379 --rules rules.toml
      limits shared by every agent on that Redis
  floodgate agent --redis redis://redis:6379 --grpc 0.0.0.0:8081 --rules config.yaml
      also Envoy's RateLimitService, with envoyproxy/ratelimit's YAML
  floodgate agent --config /etc/floodgate/agent.toml
      every setting from a file (keys: these flags in snake case)";

#[derive(Subcommand)]
enum Command {
    /// Run the per-host agent (embedded store unless --redis is given).
    #[command(after_help = AGENT_EXAMPLES)]
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
    /// Judge decision ledgers (`agent --ledger`) against the accuracy contract: exit code 0 held,
    /// 1 a breach, 2 the ledgers cannot be judged.
    Ledger(ledger::LedgerCli),
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

impl Command {
    /// Whether the command ends by SIGPIPE when its stdout's reader goes away, as Unix tools do
    /// (`die_of_a_closed_pipe`). Every printing command does; the daemons never (a peer hanging up
    /// is theirs to handle, and the agent's log may go to a pipe); `check` only once the agent has
    /// answered (its SDK client writes to a Unix socket, where SIGPIPE would cost its exit code 2).
    fn dies_of_a_closed_pipe(&self) -> bool {
        match self {
            Command::Agent(_) | Command::RulesServer(_) | Command::Check(_) => false,
            Command::Rules(_)
            | Command::Status(_)
            | Command::Ledger(_)
            | Command::Completions { .. }
            | Command::Man
            | Command::ConfigTable => true,
        }
    }
}

/// Parses the command line (with `floodgate agent`'s config file applied) and runs its command.
pub fn main() -> anyhow::Result<()> {
    let args: Vec<std::ffi::OsString> = std::env::args_os().collect();
    let cmd = match crate::reload::command_with_file(Cli::command(), &args) {
        Ok(cmd) => cmd,
        Err(e) => {
            eprintln!("error: {e:#}");
            std::process::exit(2);
        }
    };
    let matches = cmd.get_matches_from(args);
    let cli = Cli::from_arg_matches(&matches).unwrap_or_else(|e| e.exit());
    if cli.command.dies_of_a_closed_pipe() {
        die_of_a_closed_pipe();
    }
    match cli.command {
        Command::Agent(config) => agent::run(*config),
        Command::RulesServer(config) => rules_server::run(config),
        Command::Rules(cli) => operator(1, rules::run(cli)),
        Command::Check(cli) => match operator(2, check::check(cli))? {
            CheckOutcome::Allowed => Ok(()),
            CheckOutcome::Denied => std::process::exit(1),
        },
        Command::Status(cli) => operator(1, status::status(cli)),
        Command::Ledger(cli) => match ledger::run(cli) {
            Ok(ledger::LedgerOutcome::Held) => Ok(()),
            Ok(ledger::LedgerOutcome::Breached) => std::process::exit(1),
            Ok(ledger::LedgerOutcome::Unusable) => std::process::exit(2),
            Err(e) => {
                eprintln!("error: {e:#}");
                std::process::exit(2);
            }
        },
        Command::Completions { shell } => docs::completions(&mut Cli::command(), shell),
        Command::Man => docs::man(Cli::command()),
        Command::ConfigTable => docs::config_table(),
    }
}

/// The `agent` subcommand's matches from `args`, its config file applied.
pub(crate) fn agent_matches(args: &[std::ffi::OsString]) -> anyhow::Result<clap::ArgMatches> {
    let matches = crate::reload::command_with_file(Cli::command(), args)?.try_get_matches_from(args)?;
    match matches.subcommand() {
        Some(("agent", m)) => Ok(m.clone()),
        _ => anyhow::bail!("not the agent command"),
    }
}

/// A tokio runtime of `threads` workers (0: one per core).
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
pub(crate) type LogHandle =
    tracing_subscriber::reload::Handle<tracing_subscriber::EnvFilter, tracing_subscriber::Registry>;

fn init_log(filter: &str, format: LogFormat) -> anyhow::Result<LogHandle> {
    use tracing_subscriber::layer::SubscriberExt;
    use tracing_subscriber::util::SubscriberInitExt;
    let (filter, handle) =
        tracing_subscriber::reload::Layer::new(tracing_subscriber::EnvFilter::try_new(filter)?);
    let ansi = log_colours(
        std::io::IsTerminal::is_terminal(&std::io::stderr()),
        std::env::var_os("NO_COLOR"),
    );
    let fmt = tracing_subscriber::fmt::layer()
        .with_writer(std::io::stderr)
        .with_ansi(ansi);
    let registry = tracing_subscriber::registry().with(filter);
    match format {
        LogFormat::Text => registry.with(fmt).init(),
        LogFormat::Json => registry.with(fmt.json().flatten_event(true)).init(),
    }
    Ok(handle)
}

/// Whether log lines carry ANSI colours: only when stderr is a terminal, and never while `NO_COLOR`
/// is set and not empty (no-color.org). Under systemd (the journal), in a container or into a file,
/// stderr is no terminal: the lines are plain text that grep and log shippers read as written.
fn log_colours(stderr_is_terminal: bool, no_color: Option<std::ffi::OsString>) -> bool {
    stderr_is_terminal && no_color.is_none_or(|v| v.is_empty())
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

/// Writes to stdout (a reader that stops early ends the process first: `die_of_a_closed_pipe`).
fn print_all(bytes: &[u8]) -> anyhow::Result<()> {
    use std::io::Write;
    Ok(std::io::stdout().write_all(bytes)?)
}

/// From here, a write to a pipe or socket with no reader left kills the process by SIGPIPE, quietly,
/// as it does `yes | head -1`: Rust starts programs with SIGPIPE ignored, which makes such a write
/// an EPIPE error and `println!` panic ("failed printing to stdout", exit 101). TCP writes are not
/// concerned (std sends with MSG_NOSIGNAL); Unix-socket writes are. `sigpipe` holds the one unsafe
/// call (`signal(SIGPIPE, SIG_DFL)`) this crate forbids itself.
fn die_of_a_closed_pipe() {
    sigpipe::reset();
}

#[cfg(test)]
mod tests {
    use super::log_colours;

    #[test]
    fn logs_are_coloured_only_on_a_terminal_without_no_color() {
        assert!(log_colours(true, None));
        assert!(log_colours(true, Some("".into())), "an empty NO_COLOR is unset");
        assert!(!log_colours(true, Some("1".into())));
        assert!(!log_colours(false, None), "a file, a pipe or the journal");
        assert!(!log_colours(false, Some("1".into())));
    }
}
