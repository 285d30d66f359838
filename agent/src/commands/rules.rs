//! `floodgate rules …`: the operators' command line for the rules API. Readable output by default,
//! `--json` for scripts; exit code 0 on success, 1 on a refused or failed request.

use std::time::Duration;

use anyhow::{bail, Context};
use serde_json::Value;

use floodgate_rules_service::http;

/// The CLI's arguments.
#[derive(Debug, clap::Args)]
pub struct RulesCli {
    /// The rules API, `http://host:port` or `https://host:port`.
    #[arg(long, env = "FLOODGATE_RULES_SERVER", default_value = "http://127.0.0.1:9791")]
    pub server: String,
    /// Bearer token (visible in `ps` as a flag: prefer `--token-file`).
    #[arg(long, env = "FLOODGATE_RULES_TOKEN")]
    pub token: Option<String>,
    /// A file holding the bearer token (trimmed).
    #[arg(long, env = "FLOODGATE_RULES_TOKEN_FILE", conflicts_with = "token")]
    pub token_file: Option<std::path::PathBuf>,
    /// PEM certificates to trust for an `https://` server (a private CA), besides the system's.
    #[arg(long, env = "FLOODGATE_RULES_CA")]
    pub ca: Option<std::path::PathBuf>,
    /// Print the API's JSON instead of text.
    #[arg(long, global = true)]
    pub json: bool,
    /// What to do.
    #[command(subcommand)]
    pub command: RulesCommand,
}

/// One operation.
#[derive(Debug, clap::Subcommand)]
pub enum RulesCommand {
    /// Every rule, and the global version.
    List,
    /// One rule.
    Get {
        /// Rule id.
        id: String,
    },
    /// Create or replace a rule from a JSON body (a file, or `-` for standard input).
    Put {
        /// Rule id.
        id: String,
        /// The rule as JSON: {dimension, match?, limit, windowSeconds, …}.
        #[arg(long)]
        file: std::path::PathBuf,
        /// Only if the rule is at this version (0: only if it does not exist yet).
        #[arg(long)]
        if_match: Option<u64>,
    },
    /// Delete a rule.
    Delete {
        /// Rule id.
        id: String,
        /// Only if the rule is at this version.
        #[arg(long)]
        if_match: Option<u64>,
    },
    /// What a rule in log mode would have rejected since its current version: count and top keys.
    DryRun {
        /// Rule id.
        id: String,
    },
    /// Turn envoyproxy/ratelimit YAML files into rules and PUT them (one `descriptor` rule per
    /// descriptor with a rate_limit), deleting the service's rules of the files' domains that the
    /// files no longer have. A file that cannot be mapped writes nothing; a write refused half-way
    /// leaves what was written before it (run it again once fixed).
    ImportEnvoy {
        /// The configuration files (one domain each).
        files: Vec<std::path::PathBuf>,
        /// Print the rules as JSON instead of writing them.
        #[arg(long)]
        dry_run: bool,
    },
    /// Check rules files offline, as the rules API would (every error with its file, rule and
    /// field); exit 1 if any is refused. TOML, JSON or envoyproxy/ratelimit YAML.
    Validate {
        /// The rules files.
        files: Vec<std::path::PathBuf>,
    },
    /// What `apply` would change on the server: `+` created, `~` changed (the fields), `-` deleted
    /// with `--prune`, `?` only on the server.
    Diff {
        /// The rules files.
        files: Vec<std::path::PathBuf>,
        /// Show the server's rules the files lack as deletions.
        #[arg(long)]
        prune: bool,
        /// Exit 2 when there is something to change (for CI).
        #[arg(long)]
        exit_code: bool,
    },
    /// Make the server's rules what the files say: only what differs is written, each write
    /// conditional on the version the comparison saw (a rule changed meanwhile is refused, not
    /// overwritten); a second apply writes nothing. `--prune` deletes the server's rules the files
    /// lack.
    Apply {
        /// The rules files.
        files: Vec<std::path::PathBuf>,
        /// Delete the server's rules the files do not have.
        #[arg(long)]
        prune: bool,
    },
    /// A client key's own limit under one rule (per-client overrides).
    #[command(subcommand)]
    Override(OverrideCommand),
    /// A temporary penalty on a client key over every rule: its limits scaled, or blocked.
    #[command(subcommand)]
    Penalty(PenaltyCommand),
    /// The audit: who changed what, newest first.
    Audit {
        /// At most this many records.
        #[arg(long, default_value_t = 20)]
        limit: u32,
    },
}

/// What to do with an override.
#[derive(Debug, clap::Subcommand)]
pub enum OverrideCommand {
    /// Give a client key its own limit under a rule (replacing its override if it has one).
    Set {
        /// Rule id.
        rule: String,
        /// The client key, as checks build it (`apikey:abc`, `user:42`).
        key: String,
        /// The key's limit (per the rule's window, period, or in flight).
        #[arg(long)]
        limit: u64,
        /// Its own window in seconds (sliding window, token bucket); the rule's otherwise.
        #[arg(long)]
        window_seconds: Option<f64>,
        /// Its own bucket capacity (token bucket).
        #[arg(long)]
        burst: Option<u64>,
        /// It ends after this many seconds (none: until deleted).
        #[arg(long)]
        expires_in: Option<u64>,
        /// Why (recorded in the audit).
        #[arg(long)]
        reason: String,
        /// Only if the override is at this version (0: only if there is none).
        #[arg(long)]
        if_match: Option<u64>,
    },
    /// One override.
    Get {
        /// Rule id.
        rule: String,
        /// The client key.
        key: String,
    },
    /// Remove an override: the key is back to the rule's limit.
    Delete {
        /// Rule id.
        rule: String,
        /// The client key.
        key: String,
        /// Only if the override is at this version.
        #[arg(long)]
        if_match: Option<u64>,
    },
    /// A rule's overrides, a page at a time in client-key order.
    List {
        /// Rule id.
        rule: String,
        /// Start after this client key (the `next` of the page before).
        #[arg(long, default_value = "")]
        after: String,
        /// At most this many.
        #[arg(long, default_value_t = 100)]
        limit: u32,
    },
    /// The overrides' audit: who changed which, newest first.
    Audit {
        /// At most this many records.
        #[arg(long, default_value_t = 20)]
        limit: u32,
    },
}

/// What to do with a penalty.
#[derive(Debug, clap::Subcommand)]
pub enum PenaltyCommand {
    /// Penalize a client key until a time: `--factor 0.1` (its limits at 10 %) or `--block`.
    Set {
        /// The client key, as checks build it (`apikey:abc`).
        key: String,
        /// Its limits times this (above 0, below 1).
        #[arg(long, conflicts_with = "block", required_unless_present = "block")]
        factor: Option<f64>,
        /// Refuse every check of the key.
        #[arg(long)]
        block: bool,
        /// It ends after this many seconds (at most 90 days).
        #[arg(long = "for")]
        for_seconds: u64,
        /// Why (recorded in the audit).
        #[arg(long)]
        reason: String,
    },
    /// One key's penalty.
    Get {
        /// The client key.
        key: String,
    },
    /// Lift a penalty before it ends.
    Delete {
        /// The client key.
        key: String,
    },
    /// The penalties that have not ended.
    List {
        /// Start after this client key.
        #[arg(long, default_value = "")]
        after: String,
        /// At most this many.
        #[arg(long, default_value_t = 100)]
        limit: u32,
    },
}

/// A penalty as a word: `blocked`, or `factor 0.1`.
fn penalty_text(p: &Value) -> String {
    if p["block"].as_bool() == Some(true) {
        "blocked".into()
    } else {
        format!("factor {}", p["factor"])
    }
}

/// A path segment or query value with everything but unreserved characters percent-encoded.
fn encode(s: &str) -> String {
    let mut out = String::with_capacity(s.len());
    for b in s.bytes() {
        if b.is_ascii_alphanumeric() || matches!(b, b'-' | b'_' | b'.' | b'~' | b':') {
            out.push(b as char);
        } else {
            out.push_str(&format!("%{b:02X}"));
        }
    }
    out
}

/// Runs one CLI command; prints its result.
pub async fn run(cli: RulesCli) -> anyhow::Result<()> {
    http::configure(cli.ca.as_deref()).map_err(|e| anyhow::anyhow!("--ca: {e}"))?;
    let token = match &cli.token_file {
        Some(path) => Some(
            floodgate_rules_service::tokens::secret_from_file(path)
                .map_err(|e| anyhow::anyhow!("--token-file: {e}"))?,
        ),
        None => cli.token.clone(),
    };
    let token = token.as_deref();
    let call =
        |method: &'static str, path: String, extra: Vec<(&'static str, String)>, body: Option<Vec<u8>>| {
            let server = cli.server.clone();
            async move {
                http::request(
                    &server,
                    method,
                    &path,
                    token,
                    &extra,
                    body.as_deref(),
                    Duration::from_secs(10),
                )
                .await
                .map_err(|e| anyhow::anyhow!(e))
            }
        };
    let if_match = |v: Option<u64>| {
        v.map(|v| vec![("If-Match", format!("\"{v}\""))])
            .unwrap_or_default()
    };
    match &cli.command {
        RulesCommand::Validate { files } => {
            return match super::rules_code::load(files) {
                Ok(rules) => {
                    println!("{} rules valid", rules.len());
                    Ok(())
                }
                Err(problems) => {
                    super::rules_code::report(&problems);
                    bail!("rules refused")
                }
            };
        }
        RulesCommand::Diff { files, prune, .. } | RulesCommand::Apply { files, prune } => {
            let apply = matches!(cli.command, RulesCommand::Apply { .. });
            let exit_code = matches!(cli.command, RulesCommand::Diff { exit_code: true, .. });
            let rules = super::rules_code::load(files).map_err(|p| {
                super::rules_code::report(&p);
                anyhow::anyhow!("rules refused")
            })?;
            let r = call("GET", "/v1/rules".into(), vec![], None).await?;
            if r.status != 200 {
                bail!(
                    "{} from GET /v1/rules: {}",
                    r.status,
                    String::from_utf8_lossy(&r.body)
                );
            }
            let plan = super::rules_code::plan(rules, super::rules_code::server_rules(&r.body)?);
            super::rules_code::print(&plan, *prune);
            let changes = plan.create.len() + plan.change.len() + if *prune { plan.extra.len() } else { 0 };
            if !apply {
                if exit_code && changes > 0 {
                    std::process::exit(2);
                }
                return Ok(());
            }
            let writes = plan
                .create
                .iter()
                .map(|r| (r, 0))
                .chain(plan.change.iter().map(|(r, v, _)| (r, *v)));
            for (rule, version) in writes {
                let body = super::rules_code::body(rule)?;
                let r = call(
                    "PUT",
                    format!("/v1/rules/{}", rule.id),
                    if_match(Some(version)),
                    Some(body),
                )
                .await?;
                if !(200..300).contains(&r.status) {
                    bail!(
                        "{} writing rule {}: {}",
                        r.status,
                        rule.id,
                        String::from_utf8_lossy(&r.body)
                    );
                }
            }
            if *prune {
                for (id, version) in &plan.extra {
                    let r = call(
                        "DELETE",
                        format!("/v1/rules/{id}"),
                        if_match(Some(*version)),
                        None,
                    )
                    .await?;
                    if !(200..300).contains(&r.status) {
                        bail!(
                            "{} deleting rule {id}: {}",
                            r.status,
                            String::from_utf8_lossy(&r.body)
                        );
                    }
                }
            }
            println!("{changes} changes applied");
            return Ok(());
        }
        _ => {}
    }
    if let RulesCommand::ImportEnvoy { files, dry_run } = &cli.command {
        let rules = envoy_rules(files)?;
        if *dry_run {
            println!(
                "{}",
                serde_json::to_string_pretty(&serde_json::json!({ "rules": rules }))?
            );
            return Ok(());
        }
        // The import makes each domain what the files say: a rule the service holds for one of
        // their domains and the files no longer have is deleted (first, so that a descriptor that
        // moved to another id does not meet its old rule); a rule id the files want that the
        // service holds for something else than Envoy is not overwritten.
        let r = call("GET", "/v1/rules".into(), vec![], None).await?;
        if r.status != 200 {
            bail!(
                "{} from GET /v1/rules: {}",
                r.status,
                String::from_utf8_lossy(&r.body)
            );
        }
        let held: Vec<floodgate_core::rules::Rule> =
            serde_json::from_value(serde_json::from_slice::<Value>(&r.body)?["rules"].clone())
                .context("the rules service answered rules this CLI cannot read")?;
        let domains: std::collections::HashSet<&str> = rules
            .iter()
            .filter_map(|r| r.envoy.as_ref())
            .map(|e| e.domain.as_str())
            .collect();
        for h in &held {
            if h.envoy.is_none() && rules.iter().any(|r| r.id == h.id) {
                bail!("rule {} exists and is not an Envoy rule; refusing to overwrite it (name the descriptor with rate_limit.name)", h.id);
            }
        }
        let mut deleted = 0;
        for h in &held {
            let stale = h
                .envoy
                .as_ref()
                .is_some_and(|e| domains.contains(e.domain.as_str()))
                && !rules.iter().any(|r| r.id == h.id);
            if !stale {
                continue;
            }
            let r = call("DELETE", format!("/v1/rules/{}", h.id), vec![], None).await?;
            if !(200..300).contains(&r.status) && r.status != 404 {
                bail!(
                    "{} deleting stale rule {}: {}",
                    r.status,
                    h.id,
                    String::from_utf8_lossy(&r.body)
                );
            }
            deleted += 1;
            if !cli.json {
                println!("rule {} deleted (no longer in the files)", h.id);
            }
        }
        for rule in &rules {
            let mut body = serde_json::to_value(rule)?;
            if let Some(o) = body.as_object_mut() {
                o.remove("id");
            }
            let r = call(
                "PUT",
                format!("/v1/rules/{}", rule.id),
                vec![],
                Some(body.to_string().into_bytes()),
            )
            .await?;
            if !(200..300).contains(&r.status) {
                bail!(
                    "{} refused rule {} ({}): {}",
                    r.status,
                    rule.id,
                    rule.envoy.as_ref().map(|e| e.path()).unwrap_or_default(),
                    String::from_utf8_lossy(&r.body)
                );
            }
            if !cli.json {
                let path = rule.envoy.as_ref().map(|e| e.path()).unwrap_or_default();
                println!("rule {} written for descriptor {path}", rule.id);
            }
        }
        if cli.json {
            println!(
                "{}",
                serde_json::json!({ "written": rules.len(), "deleted": deleted })
            );
        } else {
            println!("{} rules imported, {deleted} deleted", rules.len());
        }
        return Ok(());
    }
    let r = match &cli.command {
        RulesCommand::ImportEnvoy { .. }
        | RulesCommand::Validate { .. }
        | RulesCommand::Diff { .. }
        | RulesCommand::Apply { .. } => return Ok(()),
        RulesCommand::List => call("GET", "/v1/rules".into(), vec![], None).await?,
        RulesCommand::Get { id } => call("GET", format!("/v1/rules/{id}"), vec![], None).await?,
        RulesCommand::Put {
            id,
            file,
            if_match: v,
        } => {
            let body = if file.as_os_str() == "-" {
                let mut s = Vec::new();
                std::io::Read::read_to_end(&mut std::io::stdin(), &mut s)?;
                s
            } else {
                std::fs::read(file).with_context(|| format!("cannot read {}", file.display()))?
            };
            call("PUT", format!("/v1/rules/{id}"), if_match(*v), Some(body)).await?
        }
        RulesCommand::Delete { id, if_match: v } => {
            call("DELETE", format!("/v1/rules/{id}"), if_match(*v), None).await?
        }
        RulesCommand::Audit { limit } => {
            call("GET", format!("/v1/audit?limit={limit}"), vec![], None).await?
        }
        RulesCommand::DryRun { id } => call("GET", format!("/v1/rules/{id}/dry-run"), vec![], None).await?,
        RulesCommand::Override(o) => match o {
            OverrideCommand::Set {
                rule,
                key,
                limit,
                window_seconds,
                burst,
                expires_in,
                reason,
                if_match: v,
            } => {
                let mut body = serde_json::json!({ "limit": limit, "reason": reason });
                if let Some(w) = window_seconds {
                    body["windowSeconds"] = serde_json::json!(w);
                }
                if let Some(b) = burst {
                    body["burst"] = serde_json::json!(b);
                }
                if let Some(s) = expires_in {
                    let at = floodgate_core::store::Clock::System.now_ms() + s.saturating_mul(1000);
                    body["expiresAt"] = serde_json::json!(at);
                }
                let path = format!("/v1/rules/{rule}/overrides/{}", encode(key));
                call("PUT", path, if_match(*v), Some(body.to_string().into_bytes())).await?
            }
            OverrideCommand::Get { rule, key } => {
                call(
                    "GET",
                    format!("/v1/rules/{rule}/overrides/{}", encode(key)),
                    vec![],
                    None,
                )
                .await?
            }
            OverrideCommand::Delete {
                rule,
                key,
                if_match: v,
            } => {
                let path = format!("/v1/rules/{rule}/overrides/{}", encode(key));
                call("DELETE", path, if_match(*v), None).await?
            }
            OverrideCommand::List { rule, after, limit } => {
                let path = format!("/v1/rules/{rule}/overrides?after={}&limit={limit}", encode(after));
                call("GET", path, vec![], None).await?
            }
            OverrideCommand::Audit { limit } => {
                call("GET", format!("/v1/overrides/audit?limit={limit}"), vec![], None).await?
            }
        },
        RulesCommand::Penalty(p) => match p {
            PenaltyCommand::Set {
                key,
                factor,
                block,
                for_seconds,
                reason,
            } => {
                let until = floodgate_core::store::Clock::System.now_ms() + for_seconds.saturating_mul(1000);
                let mut body = serde_json::json!({ "until": until, "reason": reason });
                match factor {
                    Some(f) => body["factor"] = serde_json::json!(f),
                    None => body["block"] = serde_json::json!(block),
                }
                let path = format!("/v1/penalties/{}", encode(key));
                call("PUT", path, vec![], Some(body.to_string().into_bytes())).await?
            }
            PenaltyCommand::Get { key } => {
                call("GET", format!("/v1/penalties/{}", encode(key)), vec![], None).await?
            }
            PenaltyCommand::Delete { key } => {
                call("DELETE", format!("/v1/penalties/{}", encode(key)), vec![], None).await?
            }
            PenaltyCommand::List { after, limit } => {
                let path = format!("/v1/penalties?after={}&limit={limit}", encode(after));
                call("GET", path, vec![], None).await?
            }
        },
    };
    let json: Value = if r.body.is_empty() {
        Value::Null
    } else {
        serde_json::from_slice(&r.body)
            .unwrap_or_else(|_| Value::String(String::from_utf8_lossy(&r.body).into()))
    };
    if !(200..300).contains(&r.status) {
        if cli.json {
            println!("{json}");
        }
        let mut msg = format!(
            "{} {}",
            r.status,
            json["error"].as_str().unwrap_or("request refused")
        );
        if let Some(fields) = json["fields"].as_object() {
            for (k, v) in fields {
                msg.push_str(&format!("\n  {k}: {}", v.as_str().unwrap_or_default()));
            }
        }
        bail!(msg);
    }
    if cli.json {
        println!(
            "{}",
            if json.is_null() {
                "{}".to_string()
            } else {
                json.to_string()
            }
        );
        return Ok(());
    }
    match &cli.command {
        RulesCommand::List => {
            println!("version {}", json["version"]);
            println!(
                "{:<24} {:>4} {:>12} {:>9}  {:<14} {:<7} {:<8} match",
                "id", "ver", "limit", "window", "algorithm", "mode", "exec"
            );
            for r in json["rules"].as_array().into_iter().flatten() {
                println!("{}", line(r));
            }
        }
        RulesCommand::Get { .. } => println!("{}", serde_json::to_string_pretty(&json)?),
        RulesCommand::Put { id, .. } => println!("rule {id} written: version {}", json["version"]),
        RulesCommand::Delete { id, .. } => println!("rule {id} deleted"),
        RulesCommand::DryRun { id } => {
            println!(
                "rule {id} (version {}, mode {}): would have rejected {} checks since {}",
                json["version"],
                json["mode"].as_str().unwrap_or("?"),
                json["wouldReject"],
                json["since"]
            );
            for k in json["topKeys"].as_array().into_iter().flatten() {
                println!(
                    "  {:>10}  {}",
                    k["count"].to_string(),
                    k["key"].as_str().unwrap_or("")
                );
            }
        }
        RulesCommand::ImportEnvoy { .. }
        | RulesCommand::Validate { .. }
        | RulesCommand::Diff { .. }
        | RulesCommand::Apply { .. } => {}
        RulesCommand::Override(o) => match o {
            OverrideCommand::Set { rule, key, .. } => println!(
                "override of {key} in rule {rule} written: limit {}, version {}",
                json["limit"], json["version"]
            ),
            OverrideCommand::Get { .. } => println!("{}", serde_json::to_string_pretty(&json)?),
            OverrideCommand::Delete { rule, key, .. } => {
                println!("override of {key} in rule {rule} deleted")
            }
            OverrideCommand::List { .. } => {
                println!(
                    "{:<40} {:>12} {:>14} {:>6}  reason",
                    "client key", "limit", "expires at", "ver"
                );
                for o in json["overrides"].as_array().into_iter().flatten() {
                    println!(
                        "{:<40} {:>12} {:>14} {:>6}  {}",
                        o["clientKey"].as_str().unwrap_or(""),
                        o["limit"].to_string(),
                        o["expiresAt"].as_u64().map_or("-".into(), |t| t.to_string()),
                        o["version"].to_string(),
                        o["reason"].as_str().unwrap_or("")
                    );
                }
                if let Some(next) = json["next"].as_str() {
                    println!("more: --after {next}");
                }
            }
            OverrideCommand::Audit { .. } => {
                for a in json["audit"].as_array().into_iter().flatten() {
                    println!(
                        "{:>6}  {}  {:<12} {:<7} {} {}",
                        a["version"],
                        a["at"],
                        a["actor"].as_str().unwrap_or(""),
                        a["action"].as_str().unwrap_or(""),
                        a["ruleId"].as_str().unwrap_or(""),
                        a["clientKey"].as_str().unwrap_or("")
                    );
                }
            }
        },
        RulesCommand::Penalty(p) => match p {
            PenaltyCommand::Set { key, .. } => println!(
                "penalty of {key} set: {} until {}",
                penalty_text(&json),
                json["until"]
            ),
            PenaltyCommand::Get { .. } => println!("{}", serde_json::to_string_pretty(&json)?),
            PenaltyCommand::Delete { key } => println!("penalty of {key} lifted"),
            PenaltyCommand::List { .. } => {
                println!("{:<40} {:<14} {:>14}  reason", "client key", "penalty", "until");
                for p in json["penalties"].as_array().into_iter().flatten() {
                    println!(
                        "{:<40} {:<14} {:>14}  {}",
                        p["clientKey"].as_str().unwrap_or(""),
                        penalty_text(p),
                        p["until"].to_string(),
                        p["reason"].as_str().unwrap_or("")
                    );
                }
                if let Some(next) = json["next"].as_str() {
                    println!("more: --after {next}");
                }
            }
        },
        RulesCommand::Audit { .. } => {
            for a in json["audit"].as_array().into_iter().flatten() {
                println!(
                    "{:>6}  {}  {:<12} {:<7} {}",
                    a["version"],
                    a["at"],
                    a["actor"].as_str().unwrap_or(""),
                    a["action"].as_str().unwrap_or(""),
                    a["ruleId"].as_str().unwrap_or("")
                );
            }
        }
    }
    Ok(())
}

/// Every file's rules, checked together as one set (so two files cannot give one id twice).
fn envoy_rules(files: &[std::path::PathBuf]) -> anyhow::Result<Vec<floodgate_core::rules::Rule>> {
    if files.is_empty() {
        bail!("name at least one envoyproxy/ratelimit YAML file");
    }
    let mut rules = Vec::new();
    for f in files {
        let text = std::fs::read_to_string(f).with_context(|| format!("cannot read {}", f.display()))?;
        rules.extend(
            floodgate_core::rules::envoy_config::rules_from_yaml(&text)
                .map_err(|e| anyhow::anyhow!("{}: {e}", f.display()))?,
        );
    }
    floodgate_core::rules::RuleSet::new(rules.clone())?;
    Ok(rules)
}

fn line(r: &Value) -> String {
    let s = |k: &str, d: &str| r[k].as_str().unwrap_or(d).to_string();
    let m = &r["match"];
    let mut matches = Vec::new();
    if let Some(e) = m["endpoint"].as_str() {
        matches.push(format!("endpoint={e}"));
    }
    if let Some(t) = m["tier"].as_str() {
        matches.push(format!("tier={t}"));
    }
    if let Ok(e) = serde_json::from_value::<floodgate_core::rules::EnvoyMatch>(r["envoy"].clone()) {
        matches.push(format!(
            "envoy={}{}",
            e.path(),
            if e.unlimited { " (unlimited)" } else { "" }
        ));
    }
    // A window in seconds; a quota's period; a concurrency rule's lease.
    let window = if let Some(p) = r["period"].as_str() {
        p.to_string()
    } else if r["algorithm"] == "concurrency" {
        format!("{}s lease", r["leaseSeconds"].as_f64().unwrap_or(60.0))
    } else {
        format!("{}s", r["windowSeconds"])
    };
    format!(
        "{:<24} {:>4} {:>12} {:>9}  {:<14} {:<7} {:<8} {}",
        s("id", ""),
        r["version"].to_string(),
        r["limit"].to_string(),
        window,
        s("algorithm", "sliding_window"),
        s("mode", "enforce"),
        s("execution", "sync"),
        if matches.is_empty() {
            "all".into()
        } else {
            matches.join(" ")
        }
    )
}
