//! `floodgate check`: one decision from the local agent (its cost is consumed), printed; exit code
//! 0 allowed, 1 denied, 2 the agent could not answer.

use std::time::Duration;

use anyhow::bail;
use floodgate_protocol::Source;
use floodgate_sdk::{Attributes, Client, ClientConfig, Decision, Item, Origin};
use serde_json::Value;

/// `floodgate check`: a real check (its cost is consumed), printed.
#[derive(Debug, clap::Args)]
#[command(group(clap::ArgGroup::new("attributes").multiple(true).args(["endpoint", "tier", "user", "api_key", "ip"])))]
pub struct CheckCli {
    /// The client key (`user:123`); with RULE, an item check.
    #[arg(requires = "rule", conflicts_with = "attributes")]
    pub key: Option<String>,
    /// The rule to check KEY against.
    pub rule: Option<String>,
    /// Units the check consumes.
    #[arg(long, default_value_t = 1)]
    pub cost: u32,
    /// An attribute check: the endpoint (the agent picks every rule that matches).
    #[arg(long)]
    pub endpoint: Option<String>,
    /// An attribute check: the client tier.
    #[arg(long)]
    pub tier: Option<String>,
    /// An attribute check: the user id.
    #[arg(long)]
    pub user: Option<String>,
    /// An attribute check: the API key.
    #[arg(long)]
    pub api_key: Option<String>,
    /// An attribute check: the client IP.
    #[arg(long)]
    pub ip: Option<String>,
    /// The agent's socket (or `tcp://host:port`); default: where every SDK looks
    /// (`/run/floodgate/floodgate.sock`, else `$XDG_RUNTIME_DIR/floodgate/floodgate.sock`).
    #[arg(long, env = "FLOODGATE_SOCKET")]
    pub socket: Option<std::path::PathBuf>,
    /// Longest to wait for the agent, in ms (at least 1).
    #[arg(long, default_value_t = 2_000, value_parser = clap::value_parser!(u64).range(1..))]
    pub timeout_ms: u64,
    /// Print JSON.
    #[arg(long)]
    pub json: bool,
}

/// What `floodgate check` exits with.
pub enum CheckOutcome {
    /// Allowed (exit 0).
    Allowed,
    /// Denied (exit 1).
    Denied,
}

/// Runs `floodgate check`; an error (exit 2) when the agent refused or could not answer.
pub async fn check(cli: CheckCli) -> anyhow::Result<CheckOutcome> {
    let config = ClientConfig {
        timeout: Duration::from_millis(cli.timeout_ms),
        connect_timeout: Duration::from_millis(cli.timeout_ms),
        ..Default::default()
    };
    let socket = cli
        .socket
        .clone()
        .unwrap_or_else(floodgate_sdk::default_socket_path);
    let client = Client::with_config(&socket, config).await;
    let decision = match (&cli.key, &cli.rule) {
        (Some(key), Some(rule)) => {
            client
                .check(vec![Item::new(key.as_str(), rule.as_str(), cli.cost)])
                .await
        }
        _ => {
            if cli.endpoint.is_none()
                && cli.tier.is_none()
                && cli.user.is_none()
                && cli.api_key.is_none()
                && cli.ip.is_none()
            {
                bail!(
                    "name KEY and RULE, or request attributes (--endpoint, --tier, --user, --api-key, --ip)"
                );
            }
            let a = Attributes {
                endpoint: cli.endpoint.clone(),
                tier: cli.tier.clone(),
                user: cli.user.clone(),
                api_key: cli.api_key.clone(),
                ip: cli.ip.clone(),
                cost: cli.cost,
                mode: Default::default(),
                lease: None,
            };
            client.check_request(a).await
        }
    }
    .map_err(|e| anyhow::anyhow!("the agent refused the check: {e}"))?;
    if !decision.from_agent_answer() {
        bail!(
            "the agent at {} did not answer ({:?}); nothing was decided",
            socket.display(),
            decision.origin
        );
    }
    // The agent has answered: with the client gone nothing more is written to its socket, and a
    // stdout whose reader left may end the command as it ends every printing command.
    drop(client);
    super::die_of_a_closed_pipe();
    if cli.json {
        println!("{}", decision_json(&decision));
    } else {
        print!(
            "{}",
            decision_text(&decision, floodgate_core::store::Clock::System.now_ms())
        );
    }
    Ok(if decision.allowed {
        CheckOutcome::Allowed
    } else {
        CheckOutcome::Denied
    })
}

fn source(s: Source) -> &'static str {
    s.as_str()
}

fn decision_json(d: &Decision) -> Value {
    let items: Vec<Value> = d
        .items
        .iter()
        .map(|i| {
            let v = &i.verdict;
            serde_json::json!({
                "ruleId": i.rule_id,
                "allowed": v.allowed,
                "logOnly": v.log_only,
                "source": source(v.source),
                "limit": v.limit,
                "remaining": v.remaining,
                "resetAtMs": v.reset_at_ms,
                "retryAfterMs": v.retry_after_ms,
            })
        })
        .collect();
    serde_json::json!({
        "allowed": d.allowed,
        "limit": d.limit,
        "remaining": d.remaining,
        "resetAtMs": d.reset_at_ms,
        "retryAfterMs": d.retry_after_ms,
        "source": match d.origin { Origin::Agent(s) => source(s), _ => "sdk" },
        "items": items,
    })
}

fn decision_text(d: &Decision, now: u64) -> String {
    let secs = |at: u64| at.saturating_sub(now).div_ceil(1_000);
    let mut out = String::new();
    if d.items.is_empty() {
        out.push_str("allowed: no rule applies\n");
        return out;
    }
    out.push_str(&format!(
        "{}: limit {} remaining {} resets in {} s",
        if d.allowed { "allowed" } else { "denied" },
        d.limit,
        d.remaining,
        secs(d.reset_at_ms)
    ));
    if let Some(r) = d.retry_after_ms {
        out.push_str(&format!(
            ", retry after {} s",
            floodgate_protocol::http::retry_after_seconds(r)
        ));
    }
    out.push('\n');
    for i in &d.items {
        let v = &i.verdict;
        out.push_str(&format!(
            "  {:<24} {:<8} {:<8} limit {:>10} remaining {:>10} resets in {:>6} s{}\n",
            i.rule_id,
            match (v.allowed, v.log_only) {
                (true, _) => "allowed",
                (false, true) => "logged",
                (false, false) => "denied",
            },
            source(v.source),
            v.limit,
            v.remaining,
            secs(v.reset_at_ms),
            if v.log_only { " (log mode)" } else { "" }
        ));
    }
    out
}
