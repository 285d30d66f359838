//! Per-client overrides (`loadgen overrides`): the time from a `PUT /v1/rules/{id}/overrides/{key}`
//! to every agent holding it, and the memory an agent spends per override held.

use std::time::{Duration, Instant};

use floodgate_core::overrides::{Override, OverrideChange, Overrides};
use floodgate_rules_service::http::request;
use floodgate_tests::{http_get, Agent, RulesServer};
use serde::Serialize;

use crate::fleet::rss_bytes;

/// The report.
#[derive(Debug, Serialize)]
pub struct Report {
    /// Agents following the service.
    pub agents: usize,
    /// Overrides written.
    pub changes: usize,
    /// PUT → every agent holding it, ms.
    pub p50_ms: f64,
    /// Its 99th percentile.
    pub p99_ms: f64,
    /// The slowest.
    pub max_ms: f64,
    /// Memory rows.
    pub memory: Vec<MemoryRow>,
}

/// An agent's memory for n overrides.
#[derive(Debug, Serialize)]
pub struct MemoryRow {
    /// Overrides held.
    pub overrides: usize,
    /// Bytes per override (the process's RSS growth).
    pub bytes_per_override: f64,
    /// How long applying them took, ms.
    pub apply_ms: f64,
}

async fn held_version(admin: std::net::SocketAddr) -> u64 {
    let (_, body) = http_get(admin, "/v1/status").await;
    serde_json::from_str::<serde_json::Value>(&body)
        .ok()
        .and_then(|v| v["overrides"]["version"].as_u64())
        .unwrap_or(0)
}

/// `agents` agents follow one rules service; each of `changes` overrides is PUT, then the agents'
/// status is polled every 2 ms until all hold it. Then the memory for each of `counts` overrides,
/// applied in this process as an agent applies the service's pages.
pub async fn run(agents: usize, changes: usize, counts: &[usize]) -> anyhow::Result<Report> {
    let dir = tempfile::tempdir()?;
    let server = RulesServer::start(
        &format!("sqlite://{}", dir.path().join("rules.db").display()),
        &["bench:t"],
    )
    .await;
    let put = |path: String, body: String| {
        let url = server.url();
        async move {
            request(
                &url,
                "PUT",
                &path,
                Some("t"),
                &[],
                Some(body.as_bytes()),
                Duration::from_secs(10),
            )
            .await
            .map_err(anyhow::Error::msg)
        }
    };
    let r = put(
        "/v1/rules/api".into(),
        r#"{"dimension":"api_key","limit":100,"windowSeconds":60}"#.into(),
    )
    .await?;
    anyhow::ensure!(r.status == 201, "rule refused: {}", r.status);
    let mut procs = Vec::new();
    for _ in 0..agents {
        procs.push(
            Agent::builder()
                .arg("--rules-url")
                .arg(&server.url())
                .arg("--rules-token")
                .arg("t")
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
        let t = Instant::now();
        let r = put(
            format!("/v1/rules/api/overrides/apikey:customer-{}", i % 7),
            format!(r#"{{"limit":{},"reason":"bench"}}"#, 1_000 + i),
        )
        .await?;
        anyhow::ensure!(r.status == 200 || r.status == 201, "PUT refused: {}", r.status);
        let version = serde_json::from_slice::<serde_json::Value>(&r.body)?["version"]
            .as_u64()
            .unwrap_or(0);
        for admin in &admins {
            while held_version(*admin).await < version {
                anyhow::ensure!(
                    t.elapsed() < Duration::from_secs(60),
                    "override {i} did not propagate"
                );
                tokio::time::sleep(Duration::from_millis(2)).await;
            }
        }
        took.push(t.elapsed().as_secs_f64() * 1_000.0);
        tokio::time::sleep(Duration::from_millis(50 + (i as u64 * 389) % 300)).await;
    }
    took.sort_by(|a, b| a.total_cmp(b));
    let q = |p: f64| took[((took.len() as f64 - 1.0) * p).round() as usize];
    let (p50_ms, p99_ms, max_ms) = (q(0.5), q(0.99), took.last().copied().unwrap_or(0.0));
    println!(
        "  {agents} agents, {changes} overrides: PUT → all holding it p50 {p50_ms:.1} ms, p99 {p99_ms:.1} ms, max {max_ms:.1} ms"
    );
    let mut memory = Vec::new();
    for &n in counts {
        memory.push(memory_for(n)?);
    }
    Ok(Report {
        agents,
        changes,
        p50_ms,
        p99_ms,
        max_ms,
        memory,
    })
}

/// The RSS growth of this process for `n` overrides held, applied in pages of 10,000 as an agent
/// applies the service's.
fn memory_for(n: usize) -> anyhow::Result<MemoryRow> {
    let pid = std::process::id();
    let held = Overrides::default();
    let before = rss_bytes(pid)?;
    let t = Instant::now();
    let mut version = 0u64;
    for page in (0..n).collect::<Vec<_>>().chunks(10_000) {
        let changes: Vec<OverrideChange> = page
            .iter()
            .map(|&i| {
                version += 1;
                OverrideChange {
                    rule_id: "api-per-key".into(),
                    client_key: format!("apikey:customer-{i:08}"),
                    set: Some(Override {
                        limit: std::num::NonZeroU64::new(5_000).unwrap_or(std::num::NonZeroU64::MIN),
                        window_seconds: None,
                        burst: None,
                        expires_at: Some(1_900_000_000_000),
                        reason: "enterprise plan".into(),
                        version,
                        updated_at: 1_800_000_000_000,
                    }),
                    penalty: None,
                    version,
                }
            })
            .collect();
        held.apply(changes, version);
    }
    let apply_ms = t.elapsed().as_secs_f64() * 1_000.0;
    let grown = rss_bytes(pid)? - before;
    anyhow::ensure!(held.len() == n, "held {} of {n}", held.len());
    let row = MemoryRow {
        overrides: n,
        bytes_per_override: grown as f64 / n as f64,
        apply_ms,
    };
    println!(
        "  {n} overrides held: {:.0} B each (RSS growth), applied in {:.0} ms",
        row.bytes_per_override, row.apply_ms
    );
    drop(held);
    Ok(row)
}
