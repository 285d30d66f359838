//! The Rust SDK against an agent that is already running: the same-run baseline the Python and Node
//! SDK benchmarks divide by (`loadgen sdk --socket …`).

use std::path::Path;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use serde::Serialize;

use crate::gateway::closed_clients;

/// One concurrency level.
#[derive(Serialize)]
pub struct SdkRow {
    /// Concurrent callers (tasks on one SDK client, as one process would have).
    pub clients: usize,
    /// Latency of one `allow`, µs.
    pub p50_us: f64,
    /// 99th percentile, µs.
    pub p99_us: f64,
    /// Checks answered per second while measuring.
    pub checks_per_s: f64,
    /// Calls the SDK answered by its fail policy (its 10 ms timeout or the agent unreachable),
    /// warm-up included; their latencies are in the percentiles too.
    pub fail_policy: u64,
}

/// The report: one row per concurrency level.
#[derive(Serialize)]
pub struct SdkReport {
    /// The rows, in the order asked.
    pub results: Vec<SdkRow>,
}

/// Drives `allow(user:N, rule, 1)` over 10,000 keys from `clients` tasks on one SDK client (its
/// default configuration, as the other SDKs' benchmarks use theirs), after a warm-up of a quarter of
/// `seconds`; answers by the fail policy are counted, not hidden.
pub async fn run(socket: &Path, rule: &str, levels: &[usize], seconds: f64) -> anyhow::Result<SdkReport> {
    let client = floodgate_sdk::Client::connect(socket).await;
    let measure = Duration::from_secs_f64(seconds);
    let mut results = Vec::new();
    for &clients in levels {
        let c = client.clone();
        let rule = rule.to_string();
        let fail_policy = Arc::new(AtomicU64::new(0));
        let fp = fail_policy.clone();
        let hist = closed_clients(clients, measure, move |user| {
            let (c, rule, fp) = (c.clone(), rule.clone(), fp.clone());
            async move {
                let key = format!("user:{user}");
                let t = Instant::now();
                let d = c.allow(&key, &rule, 1).await?;
                let took = t.elapsed();
                if !d.from_agent_answer() {
                    fp.fetch_add(1, Ordering::Relaxed);
                }
                Ok(took)
            }
        })
        .await?;
        results.push(SdkRow {
            clients,
            p50_us: hist.value_at_quantile(0.5) as f64 / 1000.0,
            p99_us: hist.value_at_quantile(0.99) as f64 / 1000.0,
            checks_per_s: hist.len() as f64 / seconds,
            fail_policy: fail_policy.load(Ordering::Relaxed),
        });
    }
    Ok(SdkReport { results })
}
