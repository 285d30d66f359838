//! Rule propagation (BENCHMARKS.md, "rule propagation"): the time from a `PUT /v1/rules/{id}` to
//! every agent enforcing the new rule set, over many changes, with the long-poll watch and without
//! it (poll only).

use std::time::{Duration, Instant};

use floodgate_rules_service::http::request;
use floodgate_tests::{http_get, Agent, RulesServer};
use serde::Serialize;

/// One configuration's figures.
#[derive(Debug, Serialize)]
pub struct PropagationRow {
    agents: usize,
    changes: usize,
    watch: bool,
    poll_ms: u64,
    p50_ms: f64,
    p99_ms: f64,
    max_ms: f64,
}

async fn rules_version(admin: std::net::SocketAddr) -> u64 {
    let (_, body) = http_get(admin, "/v1/status").await;
    serde_json::from_str::<serde_json::Value>(&body)
        .ok()
        .and_then(|v| v["rulesVersion"].as_u64())
        .unwrap_or(0)
}

/// `agents` agents follow one rules service (SQLite); each of `changes` PUTs changes a rule's limit,
/// then the agents' admin status is polled every 2 ms until all of them hold the new version. With
/// `watch` off they pull every `poll_ms`.
pub async fn run(agents: usize, changes: usize, watch: bool, poll_ms: u64) -> anyhow::Result<PropagationRow> {
    let dir = tempfile::tempdir()?;
    let server = RulesServer::start(
        &format!("sqlite://{}", dir.path().join("rules.db").display()),
        &["bench:t"],
    )
    .await;
    let mut procs = Vec::new();
    for _ in 0..agents {
        procs.push(
            Agent::builder()
                .arg("--rules-url")
                .arg(&server.url())
                .arg("--rules-token")
                .arg("t")
                .arg("--rules-watch-s")
                .arg(if watch { "25" } else { "0" })
                .arg("--rules-poll-ms")
                .arg(&poll_ms.to_string())
                .start()
                .await,
        );
    }
    let mut admins = Vec::new();
    for a in &procs {
        admins.push(a.admin_addr().await);
    }
    let mut took = Vec::new();
    for i in 0..changes {
        let body = format!(
            r#"{{"dimension":"user","limit":{},"windowSeconds":60}}"#,
            1_000 + i
        );
        let t = Instant::now();
        let r = request(
            &server.url(),
            "PUT",
            "/v1/rules/bench",
            Some("t"),
            &[],
            Some(body.as_bytes()),
            Duration::from_secs(10),
        )
        .await
        .map_err(anyhow::Error::msg)?;
        anyhow::ensure!(r.status == 200 || r.status == 201, "PUT refused: {}", r.status);
        let version = {
            let set = request(
                &server.url(),
                "GET",
                "/v1/rules",
                Some("t"),
                &[],
                None,
                Duration::from_secs(10),
            )
            .await
            .map_err(anyhow::Error::msg)?;
            serde_json::from_slice::<serde_json::Value>(&set.body)?["version"]
                .as_u64()
                .unwrap_or(0)
        };
        for admin in &admins {
            while rules_version(*admin).await < version {
                anyhow::ensure!(
                    t.elapsed() < Duration::from_secs(120),
                    "change {i} did not propagate"
                );
                tokio::time::sleep(Duration::from_millis(2)).await;
            }
        }
        took.push(t.elapsed().as_secs_f64() * 1_000.0);
        // Changes spaced at random within a second, so that a poll-only agent's phase varies.
        tokio::time::sleep(Duration::from_millis(50 + (i as u64 * 389) % 700)).await;
    }
    took.sort_by(|a, b| a.total_cmp(b));
    let q = |p: f64| took[((took.len() as f64 - 1.0) * p).round() as usize];
    let row = PropagationRow {
        agents,
        changes,
        watch,
        poll_ms,
        p50_ms: q(0.5),
        p99_ms: q(0.99),
        max_ms: took.last().copied().unwrap_or(0.0),
    };
    println!(
        "  {agents} agents, {changes} changes, watch {}: PUT → all enforcing p50 {:.1} ms, p99 {:.1} ms, max {:.1} ms",
        if watch { "on".to_string() } else { format!("off (poll every {poll_ms} ms)") },
        row.p50_ms,
        row.p99_ms,
        row.max_ms
    );
    Ok(row)
}
