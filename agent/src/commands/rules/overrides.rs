//! `floodgate rules override …`: a client key's own limit under one rule, and their audit.

use serde_json::Value;

use floodgate_rules_service::http;

use super::api::{encode, if_match, Api};
use super::args::OverrideCommand;
use super::print::reply;

/// Runs one override command; prints its result.
pub async fn run(api: &Api<'_>, command: &OverrideCommand, json_out: bool) -> anyhow::Result<()> {
    let r = request(api, command).await?;
    if let Some(json) = reply(r, json_out)? {
        print(command, &json)?;
    }
    Ok(())
}

/// The command's request.
async fn request(api: &Api<'_>, command: &OverrideCommand) -> anyhow::Result<http::Response> {
    match command {
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
            let body = body.to_string().into_bytes();
            api.call("PUT", &path, &if_match(*v), Some(&body)).await
        }
        OverrideCommand::Get { rule, key } => {
            let path = format!("/v1/rules/{rule}/overrides/{}", encode(key));
            api.call("GET", &path, &[], None).await
        }
        OverrideCommand::Delete {
            rule,
            key,
            if_match: v,
        } => {
            let path = format!("/v1/rules/{rule}/overrides/{}", encode(key));
            api.call("DELETE", &path, &if_match(*v), None).await
        }
        OverrideCommand::List { rule, after, limit } => {
            let path = format!("/v1/rules/{rule}/overrides?after={}&limit={limit}", encode(after));
            api.call("GET", &path, &[], None).await
        }
        OverrideCommand::Audit { limit } => {
            let path = format!("/v1/overrides/audit?limit={limit}");
            api.call("GET", &path, &[], None).await
        }
    }
}

/// The command's answer as text.
fn print(command: &OverrideCommand, json: &Value) -> anyhow::Result<()> {
    match command {
        OverrideCommand::Set { rule, key, .. } => println!(
            "override of {key} in rule {rule} written: limit {}, version {}",
            json["limit"], json["version"]
        ),
        OverrideCommand::Get { .. } => println!("{}", serde_json::to_string_pretty(json)?),
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
    }
    Ok(())
}
