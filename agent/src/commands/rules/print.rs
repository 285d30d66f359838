//! How the rules API's answers are shown: a refusal as an error naming its fields, `--json` as the
//! API's JSON, and the text of the lines that several commands share.

use anyhow::bail;
use serde_json::Value;

use floodgate_rules_service::http;

/// The answer's JSON for the command to print as text; `None` once `--json` printed it; an error
/// (the status, the API's reason and every bad field) if the request was refused.
pub fn reply(r: http::Response, json_out: bool) -> anyhow::Result<Option<Value>> {
    let json: Value = if r.body.is_empty() {
        Value::Null
    } else {
        serde_json::from_slice(&r.body)
            .unwrap_or_else(|_| Value::String(String::from_utf8_lossy(&r.body).into()))
    };
    if !(200..300).contains(&r.status) {
        if json_out {
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
    if json_out {
        println!(
            "{}",
            if json.is_null() {
                "{}".to_string()
            } else {
                json.to_string()
            }
        );
        return Ok(None);
    }
    Ok(Some(json))
}

/// A penalty as a word: `blocked`, or `factor 0.1`.
pub fn penalty_text(p: &Value) -> String {
    if p["block"].as_bool() == Some(true) {
        "blocked".into()
    } else {
        format!("factor {}", p["factor"])
    }
}

/// One rule as a row of `list`'s table.
pub fn line(r: &Value) -> String {
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
