//! `floodgate ledger check FILE…`: judges the decision ledgers of one run (one file per agent,
//! written with `--ledger`) against the accuracy contract (docs/accuracy.md), trusting only what
//! each agent said it admitted and when. Exit codes: 0 every key-window within its bound, 1 a
//! breach, 2 the ledgers cannot be judged (unreadable, or decisions dropped from them, unless
//! `--allow-incomplete`).

use std::path::PathBuf;

use anyhow::Context;
use floodgate_core::ledger::{judge, Judgement, LedgerFile, Options};

/// `floodgate ledger`'s arguments.
#[derive(clap::Args)]
pub struct LedgerCli {
    #[command(subcommand)]
    command: LedgerCommand,
}

#[derive(clap::Subcommand)]
enum LedgerCommand {
    /// Judge a run's ledgers: every key-window's admitted units against its bound. Exit code 0 all
    /// within, 1 a breach, 2 the ledgers cannot be judged.
    ///
    /// Example: floodgate ledger check agent-1.jsonl agent-2.jsonl
    Check {
        /// The ledgers, one per agent of the run.
        #[arg(required = true)]
        files: Vec<PathBuf>,
        /// What batched rules may admit over their limit in a key-window, as a fraction of it.
        #[arg(long, default_value_t = 0.01)]
        batched_allowance: f64,
        /// The batched rules' flush interval the agents ran with, ms: a batched key-window may
        /// also pass by what its agents admitted in half of it (docs/accuracy.md, "Batched").
        #[arg(long, default_value_t = 100)]
        flush_interval_ms: u64,
        /// Judge ledgers from which decisions were dropped (their agent's queue was full): a
        /// breach may then be missed.
        #[arg(long)]
        allow_incomplete: bool,
        /// Print the judgement as JSON.
        #[arg(long)]
        json: bool,
    },
}

/// What the check found.
pub enum LedgerOutcome {
    /// Every key-window within its bound.
    Held,
    /// At least one breach.
    Breached,
    /// The ledgers cannot be judged (said on stderr).
    Unusable,
}

/// Runs `floodgate ledger …`.
pub fn run(cli: LedgerCli) -> anyhow::Result<LedgerOutcome> {
    let LedgerCommand::Check {
        files,
        batched_allowance,
        flush_interval_ms,
        allow_incomplete,
        json,
    } = cli.command;
    if !(0.0..=10.0).contains(&batched_allowance) {
        anyhow::bail!("--batched-allowance {batched_allowance} is not within 0 to 10");
    }
    let mut ledgers = Vec::new();
    for path in &files {
        let text = std::fs::read_to_string(path).with_context(|| format!("reading {}", path.display()))?;
        match LedgerFile::parse(&text) {
            Ok(f) => ledgers.push(f),
            Err(e) => {
                eprintln!("error: {}: {e}", path.display());
                return Ok(LedgerOutcome::Unusable);
            }
        }
    }
    if !(1..=60_000).contains(&flush_interval_ms) {
        anyhow::bail!("--flush-interval-ms {flush_interval_ms} is not within 1 to 60000");
    }
    let options = Options {
        batched_allowance,
        flush_ms: flush_interval_ms,
        ..Options::contract()
    };
    let j = judge(&ledgers, &options);
    if json {
        println!("{}", serde_json::to_string_pretty(&j)?);
    } else {
        print!("{}", text(&j));
    }
    if j.dropped > 0 && !allow_incomplete {
        eprintln!(
            "error: {} decisions were dropped from the ledgers (an agent's queue was full): a breach may be hidden; --allow-incomplete judges them anyway",
            j.dropped
        );
        return Ok(LedgerOutcome::Unusable);
    }
    Ok(if j.breaches.is_empty() {
        LedgerOutcome::Held
    } else {
        LedgerOutcome::Breached
    })
}

/// The judgement for a reader: one line per rule, one per breach (the 20 worst), a verdict.
fn text(j: &Judgement) -> String {
    use std::fmt::Write;
    let mut out = String::new();
    let _ = writeln!(
        out,
        "ledgers: {} agents, {} records, {} decisions dropped",
        j.agents, j.records, j.dropped
    );
    if !j.unclosed.is_empty() {
        let _ = writeln!(
            out,
            "not closed (killed? their last ~50 ms may be missing): {}",
            j.unclosed.join(", ")
        );
    }
    for r in &j.rules {
        match &r.not_judged {
            Some(why) => {
                let _ = writeln!(out, "rule {}: not judged ({why})", r.rule);
            }
            None => {
                let _ = writeln!(
                    out,
                    "rule {}: {} key-windows, {} units admitted, worst {:.2}x its limit, {} past their bound",
                    r.rule, r.key_windows, r.admitted, r.worst_ratio, r.breaches
                );
            }
        }
    }
    for b in j.breaches.iter().take(20) {
        let _ = writeln!(
            out,
            "breach: rule {} key {}{} window from {} ms: {} admitted (+{} maybe) > bound {} (limit {}; {})",
            b.rule,
            b.key,
            b.agent.as_deref().map(|a| format!(" on {a}")).unwrap_or_default(),
            b.window_start_ms,
            b.admitted,
            b.maybe,
            b.bound,
            b.limit,
            b.sources.join(", ")
        );
    }
    let _ = writeln!(
        out,
        "verdict: {}",
        if j.breaches.is_empty() {
            "every key-window within its bound".to_string()
        } else {
            format!("{} key-windows past their bound", j.breaches.len())
        }
    );
    out
}
