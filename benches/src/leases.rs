//! Concurrency rules: an acquire and its release against one sync check of a rate rule, measured in
//! the same run on the same agent; the Redis round trips and CPU a pair costs; the memory a key
//! holding leases costs in Redis and in the agent (`loadgen leases`).

use std::time::{Duration, Instant};

use floodgate_tests::{Agent, RedisServer};
use serde::Serialize;

use crate::fleet::{rss_bytes, used_memory};
use crate::gateway::closed_clients;
use crate::targets::commandstats;

const RULES: &str = r#"{"rules":[
  {"id":"bench","dimension":"user","limit":1000000000,"windowSeconds":3600},
  {"id":"slots","dimension":"user","limit":1000000,"algorithm":"concurrency","leaseSeconds":3600}
]}"#;

/// One store, level and run.
#[derive(Serialize)]
pub struct PairRow {
    /// `memory` or `redis`.
    pub store: String,
    /// Concurrent callers on one SDK client.
    pub clients: usize,
    /// Which run (the two sides' order alternates).
    pub run: usize,
    /// One sync `allow` of a sliding-window rule, µs.
    pub check_p50_us: f64,
    /// Its 99th percentile, µs.
    pub check_p99_us: f64,
    /// An `acquire` and then its `release`, together, µs.
    pub pair_p50_us: f64,
    /// Its 99th percentile, µs.
    pub pair_p99_us: f64,
    /// pair p50 / check p50.
    pub ratio_p50: f64,
    /// pair p99 / check p99.
    pub ratio_p99: f64,
    /// Redis: EVALSHA round trips per pair (coalescing may put several checks in one).
    pub evalsha_per_pair: Option<f64>,
    /// Redis: EVALSHA CPU µs per pair, the scripts' own commands included.
    pub redis_usec_per_pair: Option<f64>,
    /// Redis: the same for one sync check, for the ratio.
    pub redis_usec_per_check: Option<f64>,
}

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

/// A client that waits a second for an answer: on this busy machine the default 10 ms would answer
/// some calls by the fail policy, which holds no lease.
async fn patient(socket: &std::path::Path) -> floodgate_sdk::Client {
    let config = floodgate_sdk::ClientConfig {
        timeout: Duration::from_secs(1),
        ..Default::default()
    };
    floodgate_sdk::Client::with_config(socket, config).await
}

fn us(h: &hdrhistogram::Histogram<u64>, q: f64) -> f64 {
    h.value_at_quantile(q) as f64 / 1000.0
}

/// Runs every level `runs` times on each store, then the memory passes over `keys` keys.
pub async fn run(levels: &[usize], seconds: f64, runs: usize, keys: usize) -> anyhow::Result<Report> {
    let measure = Duration::from_secs_f64(seconds);
    let mut pairs = Vec::new();
    for store in ["memory", "redis"] {
        let redis = (store == "redis").then(RedisServer::start);
        let mut b = Agent::builder().rules(RULES);
        if let Some(r) = &redis {
            b = b.redis(&r.url()).arg("--redis-timeout-ms").arg("200");
        }
        let agent = b.start().await;
        let client = patient(agent.socket()).await;
        for &clients in levels {
            for run in 0..runs {
                let mut check = None;
                let mut pair = None;
                // The two sides' order alternates run by run.
                for side in if run % 2 == 0 { [0, 1] } else { [1, 0] } {
                    let before = redis.as_ref().map(commandstats).transpose()?;
                    let c = client.clone();
                    let hist = if side == 0 {
                        closed_clients(clients, measure, move |user| {
                            let c = c.clone();
                            async move {
                                let key = format!("user:{user}");
                                let t = Instant::now();
                                c.allow(&key, "bench", 1).await?;
                                Ok(t.elapsed())
                            }
                        })
                        .await?
                    } else {
                        closed_clients(clients, measure, move |user| {
                            let c = c.clone();
                            async move {
                                let key = format!("user:{user}");
                                let t = Instant::now();
                                let (_, lease) = c.acquire(&key, "slots", 1).await?;
                                let lease = lease.ok_or_else(|| anyhow::anyhow!("no lease held"))?;
                                c.release(&lease).await?;
                                Ok(t.elapsed())
                            }
                        })
                        .await?
                    };
                    // Every operation of the side, warm-up included, against Redis's counts.
                    let delta = match (&redis, before) {
                        (Some(r), Some(b)) => Some(commandstats(r)?.since(&b)),
                        _ => None,
                    };
                    let ops = hist.len() as f64 * 1.25;
                    let per = delta.map(|d| (d.evalsha as f64 / ops, d.evalsha_usec as f64 / ops));
                    if side == 0 {
                        check = Some((hist, per));
                    } else {
                        pair = Some((hist, per));
                    }
                }
                let (check, check_redis) = check.expect("measured");
                let (pair, pair_redis) = pair.expect("measured");
                let row = PairRow {
                    store: store.into(),
                    clients,
                    run,
                    check_p50_us: us(&check, 0.5),
                    check_p99_us: us(&check, 0.99),
                    pair_p50_us: us(&pair, 0.5),
                    pair_p99_us: us(&pair, 0.99),
                    ratio_p50: us(&pair, 0.5) / us(&check, 0.5),
                    ratio_p99: us(&pair, 0.99) / us(&check, 0.99),
                    evalsha_per_pair: pair_redis.map(|p| p.0),
                    redis_usec_per_pair: pair_redis.map(|p| p.1),
                    redis_usec_per_check: check_redis.map(|p| p.1),
                };
                println!(
                    "  {store:<6} clients={clients:<3} run={run}  check p50 {:>7.1} µs p99 {:>7.1} µs | acquire+release p50 {:>7.1} µs p99 {:>7.1} µs | ratio p50 {:.2} p99 {:.2}{}",
                    row.check_p50_us,
                    row.check_p99_us,
                    row.pair_p50_us,
                    row.pair_p99_us,
                    row.ratio_p50,
                    row.ratio_p99,
                    match (row.evalsha_per_pair, row.redis_usec_per_pair, row.redis_usec_per_check) {
                        (Some(e), Some(u), Some(c)) =>
                            format!(" | Redis: {e:.2} EVALSHA, {u:.1} µs per pair ({c:.1} µs per check)"),
                        _ => String::new(),
                    }
                );
                pairs.push(row);
            }
        }
    }
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
