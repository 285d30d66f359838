//! Reservations (protocol version 6): a reserve and its commit against one sync check, measured in
//! the same run on the same agent, with the Redis round trips and CPU a pair costs; and the budget's
//! overshoot when 1,000 requests in flight together on one key, across two agents, spend what they
//! learn only after their response: reserving `max_tokens`, reserving an estimate, and the peek
//! then charge that the middleware do today (`loadgen reservations`).

use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use floodgate_sdk::Client;
use floodgate_tests::{Agent, RedisServer};
use serde::Serialize;

use crate::gateway::closed_clients;
use crate::targets::commandstats;

const RULES: &str = r#"{"rules":[
  {"id":"bench","dimension":"user","limit":1000000000,"windowSeconds":3600},
  {"id":"tokens","dimension":"user","limit":1000000000,"windowSeconds":3600},
  {"id":"budget","dimension":"api_key","limit":200000,"algorithm":"quota","period":"year"}
]}"#;

/// The budget of the overshoot runs, and each request's `max_tokens`.
const BUDGET: u64 = 200_000;
const MAX_TOKENS: u32 = 1_000;

/// One store, level and run of the latency pair.
#[derive(Serialize)]
pub struct PairRow {
    /// `memory` or `redis`.
    pub store: String,
    /// Concurrent callers on one SDK client.
    pub clients: usize,
    /// Which run (the two sides' order alternates).
    pub run: usize,
    /// One sync `allow`, µs.
    pub check_p50_us: f64,
    /// Its 99th percentile, µs.
    pub check_p99_us: f64,
    /// A `reserve` and then its `commit`, together, µs.
    pub pair_p50_us: f64,
    /// Its 99th percentile, µs.
    pub pair_p99_us: f64,
    /// pair p50 / check p50.
    pub ratio_p50: f64,
    /// pair p99 / check p99.
    pub ratio_p99: f64,
    /// Redis: EVALSHA calls per pair (the commit's take-back and its look are two).
    pub evalsha_per_pair: Option<f64>,
    /// Redis: EVALSHA CPU µs per pair.
    pub redis_usec_per_pair: Option<f64>,
    /// Redis: the same for one sync check.
    pub redis_usec_per_check: Option<f64>,
}

/// One way of spending a budget whose cost comes after the response.
#[derive(Serialize)]
pub struct OvershootRow {
    /// `reserve max_tokens`, `reserve an estimate` or `peek, then charge`.
    pub how: String,
    /// Which run.
    pub run: usize,
    /// Requests admitted of 1,000.
    pub admitted: u64,
    /// Tokens the admitted requests used.
    pub spent: u64,
    /// What the store counts at the end.
    pub counted: u64,
    /// spent − budget, 0 if within it.
    pub overshoot: u64,
    /// The largest (used − reserved) of one request: the bound item 7 of issue 35 names.
    pub one_request_excess: u64,
}

/// The report.
#[derive(Serialize)]
pub struct Report {
    /// Latency rows.
    pub pairs: Vec<PairRow>,
    /// Overshoot rows.
    pub overshoot: Vec<OvershootRow>,
}

async fn patient(socket: &std::path::Path) -> Client {
    let config = floodgate_sdk::ClientConfig {
        timeout: Duration::from_secs(2),
        ..Default::default()
    };
    Client::with_config(socket, config).await
}

fn us(h: &hdrhistogram::Histogram<u64>, q: f64) -> f64 {
    h.value_at_quantile(q) as f64 / 1000.0
}

/// What request `n` uses after its response: 1 to `MAX_TOKENS`, by a fixed sequence.
fn used(n: u64) -> u32 {
    ((n.wrapping_mul(0x9e37_79b9_7f4a_7c15) >> 40) % u64::from(MAX_TOKENS)) as u32 + 1
}

/// Runs every level `runs` times on each store, then `runs` overshoot runs of each way.
pub async fn run(levels: &[usize], seconds: f64, runs: usize) -> anyhow::Result<Report> {
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
                let (mut check, mut pair) = (None, None);
                for side in if run % 2 == 0 { [0, 1] } else { [1, 0] } {
                    let before = redis.as_ref().map(commandstats).transpose()?;
                    let c = client.clone();
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
                            let c = c.clone();
                            async move {
                                let t = Instant::now();
                                let (_, r) = c.reserve(&format!("user:{user}"), "tokens", MAX_TOKENS).await?;
                                let r = r.ok_or_else(|| anyhow::anyhow!("no reservation held"))?;
                                c.commit(&r, &[used(user as u64)]).await?;
                                Ok(t.elapsed())
                            }
                        })
                        .await?
                    };
                    let delta = match (&redis, before) {
                        (Some(r), Some(b)) => Some(commandstats(r)?.since(&b)),
                        _ => None,
                    };
                    // Every operation of the side, warm-up included, against Redis's counts.
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
                    "  {store:<6} clients={clients:<3} run={run}  check p50 {:>7.1} µs p99 {:>7.1} µs | reserve+commit p50 {:>7.1} µs p99 {:>7.1} µs | ratio p50 {:.2} p99 {:.2}{}",
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
    let mut overshoot = Vec::new();
    for run in 0..runs {
        for how in [Way::MaxTokens, Way::Estimate, Way::PeekCharge] {
            overshoot.push(spend(how, run).await?);
        }
    }
    Ok(Report { pairs, overshoot })
}

#[derive(Clone, Copy)]
enum Way {
    /// Reserve each request's `max_tokens`, commit what it used.
    MaxTokens,
    /// Reserve half of `max_tokens`, commit what it used (up to twice that).
    Estimate,
    /// What a middleware's charge route does: a peek of 0 before, a charge after.
    PeekCharge,
}

impl Way {
    fn name(self) -> &'static str {
        match self {
            Way::MaxTokens => "reserve max_tokens",
            Way::Estimate => "reserve an estimate (max_tokens / 2)",
            Way::PeekCharge => "peek, then charge (no reservation)",
        }
    }
}

/// 1,000 requests at once on one key of a 200,000-token budget, over two agents on one Redis;
/// each learns what it used after its response, while the others run.
async fn spend(how: Way, run: usize) -> anyhow::Result<OvershootRow> {
    let redis = RedisServer::start();
    let agents = [
        Agent::builder().redis(&redis.url()).rules(RULES).start().await,
        Agent::builder().redis(&redis.url()).rules(RULES).start().await,
    ];
    let clients = [
        Arc::new(patient(agents[0].socket()).await),
        Arc::new(patient(agents[1].socket()).await),
    ];
    let key = "apikey:spend";
    let (spent, admitted, excess) = (
        Arc::new(AtomicU64::new(0)),
        Arc::new(AtomicU64::new(0)),
        Arc::new(AtomicU64::new(0)),
    );
    let tasks: Vec<_> = (0..1_000u64)
        .map(|n| {
            let c = clients[n as usize % 2].clone();
            let (spent, admitted, excess) = (spent.clone(), admitted.clone(), excess.clone());
            tokio::spawn(async move {
                let u = used(n + 1_000 * run as u64);
                let reserved = match how {
                    Way::MaxTokens => MAX_TOKENS,
                    Way::Estimate => MAX_TOKENS / 2,
                    Way::PeekCharge => 0,
                };
                let reservation = match how {
                    Way::MaxTokens | Way::Estimate => {
                        let (_, r) = c.reserve(key, "budget", reserved).await?;
                        match r {
                            Some(r) => Some(r),
                            None => return anyhow::Ok(()),
                        }
                    }
                    Way::PeekCharge => {
                        if !c.peek(key, "budget", 0).await?.allowed {
                            return Ok(());
                        }
                        None
                    }
                };
                admitted.fetch_add(1, Ordering::Relaxed);
                // The response streams while other requests start and end.
                tokio::task::yield_now().await;
                spent.fetch_add(u64::from(u), Ordering::Relaxed);
                excess.fetch_max(u64::from(u.saturating_sub(reserved)), Ordering::Relaxed);
                match reservation {
                    Some(r) => c.commit(&r, &[u]).await?,
                    None => c.charge(key, "budget", u).await?,
                };
                Ok(())
            })
        })
        .collect();
    for t in tasks {
        t.await??;
    }
    let spent = spent.load(Ordering::Relaxed);
    let left = clients[0].peek(key, "budget", 0).await?.remaining;
    let row = OvershootRow {
        how: how.name().into(),
        run,
        admitted: admitted.load(Ordering::Relaxed),
        spent,
        counted: BUDGET - left.min(BUDGET),
        overshoot: spent.saturating_sub(BUDGET),
        one_request_excess: excess.load(Ordering::Relaxed),
    };
    println!(
        "  {:<38} run={run}  admitted {:>4} of 1000, spent {:>6} of {BUDGET} (counted {:>6}): overshoot {:>6}, one request's excess {:>4}",
        row.how, row.admitted, row.spent, row.counted, row.overshoot, row.one_request_excess
    );
    Ok(row)
}
