//! Reservations (protocol version 6): a reserve and its commit against one sync check, measured in
//! the same run on the same agent, with the Redis round trips and CPU a pair costs; and the budget's
//! overshoot when 1,000 requests in flight together on one key, across two agents, spend what they
//! learn only after their response: reserving `max_tokens`, reserving an estimate, and the peek
//! then charge that the middleware do today (`loadgen reservations`).

use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;

use floodgate_tests::{Agent, RedisServer};
use serde::Serialize;

use crate::pairs::{measure, patient, PairRow};

const RULES: &str = r#"{"rules":[
  {"id":"bench","dimension":"user","limit":1000000000,"windowSeconds":3600},
  {"id":"tokens","dimension":"user","limit":1000000000,"windowSeconds":3600},
  {"id":"budget","dimension":"api_key","limit":200000,"algorithm":"quota","period":"year"}
]}"#;

/// The budget of the overshoot runs, and each request's `max_tokens`.
const BUDGET: u64 = 200_000;
const MAX_TOKENS: u32 = 1_000;

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

/// What request `n` uses after its response: 1 to `MAX_TOKENS`, by a fixed sequence.
fn used(n: u64) -> u32 {
    ((n.wrapping_mul(0x9e37_79b9_7f4a_7c15) >> 40) % u64::from(MAX_TOKENS)) as u32 + 1
}

/// Runs every level `runs` times on each store, then `runs` overshoot runs of each way.
pub async fn run(levels: &[usize], seconds: f64, runs: usize) -> anyhow::Result<Report> {
    let pairs = measure(
        RULES,
        levels,
        seconds,
        runs,
        "reserve+commit",
        |c, user| async move {
            let (_, r) = c.reserve(&format!("user:{user}"), "tokens", MAX_TOKENS).await?;
            let r = r.ok_or_else(|| anyhow::anyhow!("no reservation held"))?;
            c.commit(&r, &[used(user as u64)]).await?;
            Ok(())
        },
    )
    .await?;
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
