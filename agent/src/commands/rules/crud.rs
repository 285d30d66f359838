//! One rule at a time: `list`, `get`, `put`, `delete`, and what the rules say about themselves:
//! `dry-run` (log mode's would-be rejections) and `audit`.

use std::path::Path;

use anyhow::Context;

use super::api::{if_match, Api};
use super::print::{line, reply};

/// `list`: every rule, and the global version.
pub async fn list(api: &Api<'_>, json_out: bool) -> anyhow::Result<()> {
    let r = api.call("GET", "/v1/rules", &[], None).await?;
    let Some(json) = reply(r, json_out)? else {
        return Ok(());
    };
    println!("version {}", json["version"]);
    println!(
        "{:<24} {:>4} {:>12} {:>9}  {:<14} {:<7} {:<8} match",
        "id", "ver", "limit", "window", "algorithm", "mode", "exec"
    );
    for r in json["rules"].as_array().into_iter().flatten() {
        println!("{}", line(r));
    }
    Ok(())
}

/// `get`: one rule, as the API's JSON.
pub async fn get(api: &Api<'_>, id: &str, json_out: bool) -> anyhow::Result<()> {
    let r = api.call("GET", &format!("/v1/rules/{id}"), &[], None).await?;
    let Some(json) = reply(r, json_out)? else {
        return Ok(());
    };
    println!("{}", serde_json::to_string_pretty(&json)?);
    Ok(())
}

/// `put`: a rule created or replaced from a JSON file, or `-` for standard input.
pub async fn put(
    api: &Api<'_>,
    id: &str,
    file: &Path,
    version: Option<u64>,
    json_out: bool,
) -> anyhow::Result<()> {
    let body = if file.as_os_str() == "-" {
        let mut s = Vec::new();
        std::io::Read::read_to_end(&mut std::io::stdin(), &mut s)?;
        s
    } else {
        std::fs::read(file).with_context(|| format!("cannot read {}", file.display()))?
    };
    let path = format!("/v1/rules/{id}");
    let r = api.call("PUT", &path, &if_match(version), Some(&body)).await?;
    let Some(json) = reply(r, json_out)? else {
        return Ok(());
    };
    println!("rule {id} written: version {}", json["version"]);
    Ok(())
}

/// `delete`: a rule removed.
pub async fn delete(api: &Api<'_>, id: &str, version: Option<u64>, json_out: bool) -> anyhow::Result<()> {
    let path = format!("/v1/rules/{id}");
    let r = api.call("DELETE", &path, &if_match(version), None).await?;
    if reply(r, json_out)?.is_some() {
        println!("rule {id} deleted");
    }
    Ok(())
}

/// `dry-run`: what a rule in log mode would have rejected since its version: count and top keys.
pub async fn dry_run(api: &Api<'_>, id: &str, json_out: bool) -> anyhow::Result<()> {
    let r = api
        .call("GET", &format!("/v1/rules/{id}/dry-run"), &[], None)
        .await?;
    let Some(json) = reply(r, json_out)? else {
        return Ok(());
    };
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
    Ok(())
}

/// `audit`: who changed which rule, newest first.
pub async fn audit(api: &Api<'_>, limit: u32, json_out: bool) -> anyhow::Result<()> {
    let r = api
        .call("GET", &format!("/v1/audit?limit={limit}"), &[], None)
        .await?;
    let Some(json) = reply(r, json_out)? else {
        return Ok(());
    };
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
    Ok(())
}
