//! `floodgate rules penalty …`: a temporary penalty on a client key over every rule.

use serde_json::Value;

use floodgate_rules_service::http;

use super::api::{encode, Api};
use super::args::PenaltyCommand;
use super::print::{penalty_text, reply};

/// Runs one penalty command; prints its result.
pub async fn run(api: &Api<'_>, command: &PenaltyCommand, json_out: bool) -> anyhow::Result<()> {
    let r = request(api, command).await?;
    if let Some(json) = reply(r, json_out)? {
        print(command, &json)?;
    }
    Ok(())
}

/// The command's request.
async fn request(api: &Api<'_>, command: &PenaltyCommand) -> anyhow::Result<http::Response> {
    match command {
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
            let body = body.to_string().into_bytes();
            api.call("PUT", &path, &[], Some(&body)).await
        }
        PenaltyCommand::Get { key } => {
            let path = format!("/v1/penalties/{}", encode(key));
            api.call("GET", &path, &[], None).await
        }
        PenaltyCommand::Delete { key } => {
            let path = format!("/v1/penalties/{}", encode(key));
            api.call("DELETE", &path, &[], None).await
        }
        PenaltyCommand::List { after, limit } => {
            let path = format!("/v1/penalties?after={}&limit={limit}", encode(after));
            api.call("GET", &path, &[], None).await
        }
    }
}

/// The command's answer as text.
fn print(command: &PenaltyCommand, json: &Value) -> anyhow::Result<()> {
    match command {
        PenaltyCommand::Set { key, .. } => println!(
            "penalty of {key} set: {} until {}",
            penalty_text(json),
            json["until"]
        ),
        PenaltyCommand::Get { .. } => println!("{}", serde_json::to_string_pretty(json)?),
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
    }
    Ok(())
}
