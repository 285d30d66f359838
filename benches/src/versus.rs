//! Side by side on one redis-server (BENCHMARKS.md, "Side by side: the agent's sync path vs
//! rate-limiter-flexible vs bare EVALSHA"): the agent's sync path (frames over its socket, one
//! check per client in flight), rate-limiter-flexible (`RateLimiterRedis` over ioredis, Node, the
//! SDK benchmark's `rlf.js`) and a bare EVALSHA of the check script, at each level of in-flight
//! calls: checks/s, p50/p99, and the CPU per check of the agent process and of the Node process.
//! Each run measures every side at every level, the sides' order reversed every other run.

use std::path::{Path, PathBuf};
use std::process::Command;
use std::time::Duration;

use anyhow::{bail, Context};
use floodgate_tests::{Agent, RedisServer};
use serde::Serialize;

use crate::closed;
use crate::targets::Target;

/// One side at one level in one run.
#[derive(Debug, Clone, Serialize)]
pub struct Side {
    /// `agent sync`, `rate-limiter-flexible` or `bare EVALSHA`.
    pub side: String,
    /// Calls in flight.
    pub in_flight: usize,
    /// Run number.
    pub run: usize,
    /// Checks per second measured.
    pub checks_per_s: f64,
    /// Latency percentiles in µs.
    pub p50_us: f64,
    /// See `p50_us`.
    pub p99_us: f64,
    /// CPU (user + system) of the process that decides per check, in µs: the agent, or the Node
    /// process running rate-limiter-flexible (none for the bare EVALSHA: the load generator).
    pub cpu_us_per_check: Option<f64>,
    /// Answers not on the path measured (the agent's fail mode, rate-limiter-flexible's errors).
    pub degraded: u64,
}

/// Runs `runs` rounds of every side at every level.
pub async fn run(runs: usize, levels: &[usize], seconds: f64, rlf: &Path) -> anyhow::Result<Vec<Side>> {
    if !rlf.exists() {
        bail!(
            "no {}: build the Node benchmark first (cd sdk-node && npm ci && npx tsc -p tsconfig.json)",
            rlf.display()
        );
    }
    let redis = RedisServer::start();
    let agent = Agent::builder()
        .redis(&redis.url())
        .shipped_timeout()
        .rules(crate::RULES)
        .start()
        .await;
    let measure = Duration::from_secs_f64(seconds);
    let mut all = Vec::new();
    for run in 0..runs.max(1) {
        for &level in levels {
            let mut sides = ["agent sync", "rate-limiter-flexible", "bare EVALSHA"];
            if run % 2 == 1 {
                sides.reverse();
            }
            for side in sides {
                let row = match side {
                    "agent sync" => agent_side(&agent, level, measure, run).await?,
                    "rate-limiter-flexible" => rlf_side(rlf, &redis, level, seconds, run)?,
                    _ => evalsha_side(&redis, level, measure, run).await?,
                };
                println!(
                    "run {run}  {:<22} in flight {level:>3}  {:>9.0} checks/s  p50 {:>8.1} µs  p99 {:>8.1} µs  cpu/check {}",
                    row.side,
                    row.checks_per_s,
                    row.p50_us,
                    row.p99_us,
                    row.cpu_us_per_check.map_or("-".into(), |c| format!("{c:.1} µs")),
                );
                all.push(row);
            }
        }
    }
    summary(&all, levels);
    Ok(all)
}

async fn agent_side(agent: &Agent, level: usize, measure: Duration, run: usize) -> anyhow::Result<Side> {
    let pid = agent.pid().context("agent pid")?;
    let before = crate::cpu_ticks(pid);
    let r = closed::run(
        &Target::Agent(agent.socket().to_path_buf()),
        level,
        1,
        10_000,
        measure,
    )
    .await?;
    let ticks = crate::cpu_ticks(pid)
        .zip(before)
        .map(|(a, b)| a.saturating_sub(b));
    // Ticks of 10 ms over the warm-up and the measurement, over every check of both.
    let cpu = ticks.map(|t| t as f64 * 10_000.0 / r.all_checks.max(1) as f64);
    Ok(closed_side("agent sync", level, run, &r, cpu))
}

async fn evalsha_side(
    redis: &RedisServer,
    level: usize,
    measure: Duration,
    run: usize,
) -> anyhow::Result<Side> {
    let r = closed::run(&Target::Evalsha(redis.url()), level, 1, 10_000, measure).await?;
    Ok(closed_side("bare EVALSHA", level, run, &r, None))
}

/// A closed-loop side's row (`cpu`: the deciding process's CPU per check, when there is one).
fn closed_side(side: &str, level: usize, run: usize, r: &closed::LoopResult, cpu: Option<f64>) -> Side {
    Side {
        side: side.into(),
        in_flight: level,
        run,
        checks_per_s: r.checks as f64 / r.elapsed.as_secs_f64(),
        p50_us: r.hist.value_at_quantile(0.5) as f64 / 1e3,
        p99_us: r.hist.value_at_quantile(0.99) as f64 / 1e3,
        cpu_us_per_check: cpu,
        degraded: r.fallbacks,
    }
}

fn rlf_side(rlf: &Path, redis: &RedisServer, level: usize, seconds: f64, run: usize) -> anyhow::Result<Side> {
    let dir = tempfile::tempdir()?;
    let json = dir.path().join("rlf.json");
    let out = Command::new("node")
        .arg(rlf)
        .args(["--redis", &redis.url(), "--clients", &level.to_string()])
        .args(["--seconds", &seconds.to_string()])
        .arg("--json")
        .arg(&json)
        .output()
        .context("node (rate-limiter-flexible)")?;
    if !out.status.success() {
        bail!("rlf.js failed: {}", String::from_utf8_lossy(&out.stderr));
    }
    #[derive(serde::Deserialize)]
    struct Report {
        results: Vec<Row>,
    }
    #[derive(serde::Deserialize)]
    struct Row {
        p50_us: f64,
        p99_us: f64,
        checks_per_s: f64,
        degraded: u64,
        cpu_us_per_check: Option<f64>,
    }
    let report: Report = serde_json::from_slice(&std::fs::read(&json)?)?;
    let row = report
        .results
        .into_iter()
        .next()
        .context("rlf.js reported no row")?;
    Ok(Side {
        side: "rate-limiter-flexible".into(),
        in_flight: level,
        run,
        checks_per_s: row.checks_per_s,
        p50_us: row.p50_us,
        p99_us: row.p99_us,
        cpu_us_per_check: row.cpu_us_per_check,
        degraded: row.degraded,
    })
}

fn median(mut xs: Vec<f64>) -> f64 {
    xs.sort_by(f64::total_cmp);
    match xs.len() {
        0 => f64::NAN,
        n if n % 2 == 1 => xs[n / 2],
        n => (xs[n / 2 - 1] + xs[n / 2]) / 2.0,
    }
}

fn summary(all: &[Side], levels: &[usize]) {
    println!("\nmedians of the runs:");
    println!("| in flight | side | checks/s | p50 µs | p99 µs | CPU µs/check |");
    println!("|---:|---|---:|---:|---:|---:|");
    for &level in levels {
        for side in ["agent sync", "rate-limiter-flexible", "bare EVALSHA"] {
            let rows: Vec<&Side> = all
                .iter()
                .filter(|r| r.in_flight == level && r.side == side)
                .collect();
            let m = |f: fn(&Side) -> f64| median(rows.iter().map(|r| f(r)).collect());
            let cpu: Vec<f64> = rows.iter().filter_map(|r| r.cpu_us_per_check).collect();
            println!(
                "| {level} | {side} | {:.0} | {:.1} | {:.1} | {} |",
                m(|r| r.checks_per_s),
                m(|r| r.p50_us),
                m(|r| r.p99_us),
                if cpu.is_empty() {
                    "–".into()
                } else {
                    format!("{:.1}", median(cpu))
                },
            );
        }
    }
}

/// Where the Node benchmark's build puts `rlf.js`.
pub fn default_rlf() -> PathBuf {
    PathBuf::from("sdk-node/dist/bench/rlf.js")
}
