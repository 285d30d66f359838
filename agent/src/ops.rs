//! Operator commands: `floodgate check` (one decision from the local agent, exit code 0 allowed,
//! 1 denied, 2 the agent could not answer) and `floodgate status` (the agent's breaker, fallback,
//! N, rules version and batch state from its admin API).

use std::time::Duration;

use anyhow::{bail, Context};
use floodgate_protocol::Source;
use floodgate_sdk::{Attributes, Client, ClientConfig, Decision, Item, Origin};
use serde_json::Value;

use floodgate_rules_service::http;

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
    /// Longest to wait for the agent, in ms.
    #[arg(long, default_value_t = 2_000)]
    pub timeout_ms: u64,
    /// Print JSON.
    #[arg(long)]
    pub json: bool,
}

/// `floodgate status`.
#[derive(Debug, clap::Args)]
pub struct StatusCli {
    /// The agent's admin address.
    #[arg(long, env = "FLOODGATE_ADMIN", default_value = "127.0.0.1:9790")]
    pub admin: String,
    /// Print the admin API's JSON (`{"status": …, "batch": …}`).
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
        timeout: Duration::from_millis(cli.timeout_ms.max(1)),
        connect_timeout: Duration::from_millis(cli.timeout_ms.max(1)),
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
    match s {
        Source::Redis => "redis",
        Source::Local => "local",
        Source::Cache => "cache",
        Source::Fallback => "fallback",
    }
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

/// Runs `floodgate status`.
pub async fn status(cli: StatusCli) -> anyhow::Result<()> {
    let base = if cli.admin.starts_with("http://") {
        cli.admin.clone()
    } else {
        format!("http://{}", cli.admin)
    };
    let get = |path: &'static str| {
        let base = base.clone();
        async move {
            let r = http::request(&base, "GET", path, None, &[], None, Duration::from_secs(5))
                .await
                .map_err(|e| anyhow::anyhow!("cannot reach the agent's admin API at {base}: {e}"))?;
            if r.status != 200 {
                bail!("{base}{path} answered {}", r.status);
            }
            serde_json::from_slice::<Value>(&r.body).with_context(|| format!("{base}{path} is not JSON"))
        }
    };
    let status = get("/v1/status").await?;
    let batch = get("/v1/batch").await?;
    if cli.json {
        println!("{}", serde_json::json!({ "status": status, "batch": batch }));
    } else {
        print!("{}", status_text(&status, &batch));
    }
    Ok(())
}

fn status_text(s: &Value, b: &Value) -> String {
    let mut out = String::new();
    let rules = s["rules"].as_array().map_or(0, Vec::len);
    out.push_str(&format!("store         {}\n", s["store"].as_str().unwrap_or("?")));
    out.push_str(&format!(
        "rules         {rules} (version {})\n",
        s["rulesVersion"]
    ));
    if let Some(r) = s["rulesRefused"].as_object() {
        out.push_str(&format!(
            "REFUSED       rule set version {}: {}\n",
            r["version"],
            r["error"].as_str().unwrap_or("?")
        ));
    }
    if let Some(breakers) = s["breakers"].as_array() {
        let states: Vec<String> = breakers
            .iter()
            .map(|b| format!("{}:{}", b["shard"], b["state"].as_str().unwrap_or("?")))
            .collect();
        out.push_str(&format!("breakers      {}\n", states.join(" ")));
        let f = &s["fallback"];
        out.push_str(&format!(
            "fallback      {} (decided {}, pending write-back {}, written back {} units)\n",
            if f["active"].as_bool() == Some(true) {
                "ACTIVE"
            } else {
                "inactive"
            },
            f["decided"],
            f["pendingWriteBack"],
            f["writtenBackUnits"]
        ));
        out.push_str(&format!(
            "live agents   {} (this one: {})\n",
            s["liveAgents"],
            s["agentId"].as_str().unwrap_or("?")
        ));
    } else {
        out.push_str("breakers      none (embedded store)\n");
    }
    let c = &s["rejectionCache"];
    out.push_str(&format!(
        "rejection cache {} entries, {} hits\n",
        c["entries"], c["hits"]
    ));
    out.push_str(&format!("store errors  {}\n", s["storeErrors"]));
    if let Some(rows) = b["rules"].as_array() {
        let batched: Vec<&Value> = rows
            .iter()
            .filter(|r| r["effective"].as_str() == Some("batched"))
            .collect();
        out.push_str(&format!("batched rules {} of {}\n", batched.len(), rows.len()));
        for r in batched {
            out.push_str(&format!(
                "  {:<24} flush {} ms, {} keys, {} units pending\n",
                r["id"].as_str().unwrap_or("?"),
                r["flushIntervalMs"],
                r["trackedKeys"],
                r["pendingUnits"]
            ));
        }
        let st = &b["stats"];
        out.push_str(&format!(
            "flushes       {} ({} entries, {} errors), default interval {} ms\n",
            st["flushes"], st["entries"], st["errors"], b["defaultFlushIntervalMs"]
        ));
    }
    out
}
