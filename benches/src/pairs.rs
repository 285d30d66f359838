//! One request's pair of calls (an acquire and its release, a reserve and its commit) against one
//! sync check of a rate rule, measured in the same run on the same agent and client, the sides'
//! order alternating run by run; with the Redis round trips and CPU each costs. `loadgen leases`
//! and `loadgen reservations` share it.

use std::future::Future;
use std::time::{Duration, Instant};

use floodgate_sdk::Client;
use floodgate_tests::{Agent, RedisServer};
use serde::Serialize;

use crate::gateway::closed_clients;
use crate::targets::commandstats;

/// One store, level and run.
#[derive(Serialize)]
pub struct PairRow {
    /// `memory` or `redis`.
    pub store: String,
    /// Concurrent callers on one SDK client.
    pub clients: usize,
    /// Which run (the two sides' order alternates).
    pub run: usize,
    /// One sync `allow` of the rules' sliding-window rule `bench`, µs.
    pub check_p50_us: f64,
    /// Its 99th percentile, µs.
    pub check_p99_us: f64,
    /// The pair, together, µs.
    pub pair_p50_us: f64,
    /// Its 99th percentile, µs.
    pub pair_p99_us: f64,
    /// pair p50 / check p50.
    pub ratio_p50: f64,
    /// pair p99 / check p99.
    pub ratio_p99: f64,
    /// Redis: EVALSHA calls per pair (coalescing may put several checks in one).
    pub evalsha_per_pair: Option<f64>,
    /// Redis: EVALSHA CPU µs per pair, the scripts' own commands included.
    pub redis_usec_per_pair: Option<f64>,
    /// Redis: the same for one sync check, for the ratio.
    pub redis_usec_per_check: Option<f64>,
}

/// A client that waits a second for an answer: on this busy machine the default 10 ms would answer
/// some calls by the fail policy, which holds nothing.
pub async fn patient(socket: &std::path::Path) -> Client {
    let config = floodgate_sdk::ClientConfig {
        timeout: Duration::from_secs(1),
        ..Default::default()
    };
    Client::with_config(socket, config).await
}

fn us(h: &hdrhistogram::Histogram<u64>, q: f64) -> f64 {
    h.value_at_quantile(q) as f64 / 1000.0
}

/// Every level `runs` times on each store (the embedded one, then a Redis of its own) of an agent
/// on `rules` (which has a sliding-window rule `bench`): `pair(client, user)` against one
/// `allow(user:<user>, bench, 1)`, each side `seconds` after a quarter of that as warm-up. `what`
/// names the pair in the lines printed.
pub async fn measure<F, Fut>(
    rules: &str,
    levels: &[usize],
    seconds: f64,
    runs: usize,
    what: &str,
    pair: F,
) -> anyhow::Result<Vec<PairRow>>
where
    F: Fn(Client, usize) -> Fut + Clone + Send + Sync + 'static,
    Fut: Future<Output = anyhow::Result<()>> + Send,
{
    let measure = Duration::from_secs_f64(seconds);
    let mut rows = Vec::new();
    for store in ["memory", "redis"] {
        let redis = (store == "redis").then(RedisServer::start);
        let mut b = Agent::builder().rules(rules);
        if let Some(r) = &redis {
            b = b.redis(&r.url()).arg("--redis-timeout-ms").arg("200");
        }
        let agent = b.start().await;
        let client = patient(agent.socket()).await;
        for &clients in levels {
            for run in 0..runs {
                let (mut check, mut paired) = (None, None);
                for side in if run % 2 == 0 { [0, 1] } else { [1, 0] } {
                    let before = redis.as_ref().map(commandstats).transpose()?;
                    let (c, pair) = (client.clone(), pair.clone());
                    let hist = if side == 0 {
                        closed_clients(clients, measure, move |user| {
                            let c = c.clone();
                            async move {
                                let t = Instant::now();
                                c.allow(&format!("user:{user}"), "bench", 1).await?;
                                Ok(t.elapsed())
                            }
                        })
                        .await?
                    } else {
                        closed_clients(clients, measure, move |user| {
                            let (c, pair) = (c.clone(), pair.clone());
                            async move {
                                let t = Instant::now();
                                pair(c, user).await?;
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
                        paired = Some((hist, per));
                    }
                }
                let (check, check_redis) = check.expect("measured");
                let (paired, pair_redis) = paired.expect("measured");
                let row = PairRow {
                    store: store.into(),
                    clients,
                    run,
                    check_p50_us: us(&check, 0.5),
                    check_p99_us: us(&check, 0.99),
                    pair_p50_us: us(&paired, 0.5),
                    pair_p99_us: us(&paired, 0.99),
                    ratio_p50: us(&paired, 0.5) / us(&check, 0.5),
                    ratio_p99: us(&paired, 0.99) / us(&check, 0.99),
                    evalsha_per_pair: pair_redis.map(|p| p.0),
                    redis_usec_per_pair: pair_redis.map(|p| p.1),
                    redis_usec_per_check: check_redis.map(|p| p.1),
                };
                println!(
                    "  {store:<6} clients={clients:<3} run={run}  check p50 {:>7.1} µs p99 {:>7.1} µs | {what} p50 {:>7.1} µs p99 {:>7.1} µs | ratio p50 {:.2} p99 {:.2}{}",
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
                rows.push(row);
            }
        }
    }
    Ok(rows)
}
