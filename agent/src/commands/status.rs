//! `floodgate status`: the agent's breakers, fallback, live agents, rules version and batch state,
//! read from its admin API for people (or as JSON).

use std::time::Duration;

use anyhow::{bail, Context};
use serde_json::Value;

use floodgate_rules_service::http;

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
