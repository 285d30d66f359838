//! Concurrency rules: an acquire and its release against one sync check of a rate rule, measured in
//! the same run on the same agent; the Redis round trips and CPU a pair costs; the memory a key
//! holding leases costs in Redis and in the agent (`loadgen leases`).

use floodgate_tests::{Agent, RedisServer};
use serde::Serialize;

use crate::fleet::{rss_bytes, used_memory};
use crate::pairs::{measure, patient, PairRow};

const RULES: &str = r#"{"rules":[
  {"id":"bench","dimension":"user","limit":1000000000,"windowSeconds":3600},
  {"id":"slots","dimension":"user","limit":1000000,"algorithm":"concurrency","leaseSeconds":3600}
]}"#;

/// Memory per key.
#[derive(Serialize)]
pub struct MemoryRow {
    /// What was measured.
    pub what: String,
    /// Keys holding leases.
    pub keys: usize,
    /// Bytes per key.
    pub bytes_per_key: f64,
}

/// The report.
#[derive(Serialize)]
pub struct Report {
    /// Latency rows.
    pub pairs: Vec<PairRow>,
    /// Memory rows.
    pub memory: Vec<MemoryRow>,
}

/// Runs every level `runs` times on each store, then the memory passes over `keys` keys.
pub async fn run(levels: &[usize], seconds: f64, runs: usize, keys: usize) -> anyhow::Result<Report> {
    let pairs = measure(
        RULES,
        levels,
        seconds,
        runs,
        "acquire+release",
        |c, user| async move {
            let (_, lease) = c.acquire(&format!("user:{user}"), "slots", 1).await?;
            let lease = lease.ok_or_else(|| anyhow::anyhow!("no lease held"))?;
            c.release(&lease).await?;
            Ok(())
        },
    )
    .await?;
    let memory = memory(keys).await?;
    Ok(Report { pairs, memory })
}

/// Redis and agent memory per key holding leases: `keys` keys with one lease each (never released,
/// an hour's lease time), then three more leases on each.
async fn memory(keys: usize) -> anyhow::Result<Vec<MemoryRow>> {
    let mut rows = Vec::new();
    let mut push = |what: &str, bytes: i64| {
        let row = MemoryRow {
            what: what.into(),
            keys,
            bytes_per_key: bytes as f64 / keys as f64,
        };
        println!("  {:<60} {:>7.1} B per key", row.what, row.bytes_per_key);
        rows.push(row);
    };
    let hold = |client: floodgate_sdk::Client, leases: usize| async move {
        let mut tasks = Vec::new();
        for t in 0..16 {
            let c = client.clone();
            tasks.push(tokio::spawn(async move {
                for k in (t..keys).step_by(16) {
                    for _ in 0..leases {
                        let (_, lease) = c.acquire(&format!("user:{k}"), "slots", 1).await?;
                        lease.ok_or_else(|| anyhow::anyhow!("no lease held"))?;
                    }
                }
                anyhow::Ok(())
            }));
        }
        for t in tasks {
            t.await??;
        }
        anyhow::Ok(())
    };
    let redis = RedisServer::start();
    let agent = Agent::builder().redis(&redis.url()).rules(RULES).start().await;
    let client = patient(agent.socket()).await;
    client.acquire("user:warm", "slots", 1).await?;
    let before = used_memory(&redis)?;
    hold(client.clone(), 1).await?;
    let one = used_memory(&redis)?;
    push("Redis, a key holding 1 lease", one - before);
    hold(client.clone(), 3).await?;
    push("Redis, a key holding 4 leases", used_memory(&redis)? - before);
    let agent = Agent::builder().rules(RULES).start().await;
    let pid = agent.pid().ok_or_else(|| anyhow::anyhow!("agent pid"))?;
    let client = patient(agent.socket()).await;
    client.acquire("user:warm", "slots", 1).await?;
    let before = rss_bytes(pid)?;
    hold(client.clone(), 1).await?;
    push(
        "agent (embedded store) RSS, a key holding 1 lease",
        rss_bytes(pid)? - before,
    );
    hold(client, 3).await?;
    push(
        "agent (embedded store) RSS, a key holding 4 leases",
        rss_bytes(pid)? - before,
    );
    Ok(rows)
}
