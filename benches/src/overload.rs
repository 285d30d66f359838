//! The overload scenario: one agent on Redis (the shipped 5 ms store timeout), its closed-loop
//! capacity measured first, then an open loop offering 0.5×, 1×, 1.5× and 3× of it to the same agent
//! in the same run. Per level: what was answered and how fast (from each request's intended send
//! time, so a queue shows), and the share the rule's fail mode answered. Past capacity the agent
//! should shed (answer by the fail mode at once) rather than queue: every level's answered p99 within
//! the store timeout plus 1 ms, and at 0.5× the seed's p99 < 2 ms with no fail-mode answer.

use std::time::Duration;

use floodgate_tests::{Agent, RedisServer};
use serde::Serialize;

use crate::targets::Target;
use crate::{closed, open, RULES};

/// One level of one run.
#[derive(Serialize, Debug, Clone)]
pub struct Level {
    /// The run (0-based).
    pub run: usize,
    /// Offered load as a multiple of the measured capacity.
    pub factor: f64,
    /// Checks/s offered.
    pub offered: f64,
    /// Checks/s answered while measuring.
    pub answered: f64,
    /// Answered latency from the intended send time, µs.
    pub p50_us: f64,
    /// The same, p99.
    pub p99_us: f64,
    /// The same, p99.9.
    pub p999_us: f64,
    /// Share of the measured answers the fail mode gave (source fallback), %.
    pub fail_mode_pct: f64,
    /// The p99 of the store's answers alone (every answer but the fail mode's), µs: a check queued
    /// toward Redis waits up to its budget there.
    pub store_p99_us: f64,
    /// The p99 of the fail mode's answers alone, µs: a shed check is answered at once, so what it
    /// waited is the agent being behind on reading (0 with none).
    pub fail_mode_p99_us: f64,
    /// Checks offered in all (warm-up included) that got no answer within 5 s of the end.
    pub unanswered: u64,
    /// The same rate against the bare Unix-socket echo server, same run: its p99, µs (what this
    /// machine, shared by the load generator, adds at that rate with no limiter at all).
    pub echo_p99_us: f64,
}

/// The report: the capacity each run measured, and its levels.
#[derive(Serialize, Debug)]
pub struct Report {
    /// Closed-loop checks/s per run (`clients` connections, one check in flight each).
    pub capacity: Vec<f64>,
    /// Every level of every run.
    pub levels: Vec<Level>,
}

/// What to offer: the levels and how each is measured.
pub(crate) struct Setup {
    /// Runs (each measures the capacity again, unless `fixed`).
    pub runs: usize,
    /// Offered load as multiples of the capacity.
    pub factors: Vec<f64>,
    /// Seconds measured per level.
    pub seconds: f64,
    /// Closed-loop connections for the capacity.
    pub clients: usize,
    /// Connections the open loop spreads its requests over.
    pub connections: usize,
    /// Distinct keys.
    pub keys: usize,
    /// The agent's worker threads.
    pub agent_threads: usize,
    /// The rate the factors multiply instead of the measured capacity.
    pub fixed: Option<f64>,
}

/// Runs the scenario `runs` times on one agent.
pub(crate) async fn run(setup: Setup) -> anyhow::Result<Report> {
    let Setup {
        runs,
        ref factors,
        seconds,
        clients,
        connections,
        keys,
        agent_threads,
        fixed,
    } = setup;
    let measure = Duration::from_secs_f64(seconds);
    let redis = RedisServer::start();
    let agent = Agent::builder()
        .redis(&redis.url())
        .shipped_timeout()
        .rules(RULES)
        .arg("--threads")
        .arg(&agent_threads.to_string())
        .start()
        .await;
    let socket = agent.socket().to_path_buf();
    let dir = tempfile::tempdir()?;
    let echo_socket = dir.path().join("echo.sock");
    let _echo = crate::echo::spawn(&echo_socket)?;
    let mut report = Report {
        capacity: Vec::new(),
        levels: Vec::new(),
    };
    for run in 0..runs.max(1) {
        let capacity = match fixed {
            Some(rate) => {
                println!("run {}: offered multiples of {rate:.0} checks/s (given)", run + 1);
                rate
            }
            None => {
                let closed = closed::run(&Target::Agent(socket.clone()), clients, 1, keys, measure).await?;
                let capacity = closed.checks as f64 / closed.elapsed.as_secs_f64();
                println!(
                    "run {}: closed-loop capacity {capacity:.0} checks/s ({clients} clients)",
                    run + 1
                );
                capacity
            }
        };
        report.capacity.push(capacity);
        for &factor in factors {
            let rate = (capacity * factor).max(1.0) as u64;
            let socket = socket.clone();
            let result =
                tokio::task::spawn_blocking(move || open::run(&socket, rate, connections, keys, measure))
                    .await??;
            let echo_socket = echo_socket.clone();
            let echo = tokio::task::spawn_blocking(move || {
                open::run(&echo_socket, rate, connections, keys, measure)
            })
            .await??;
            let offered_all = (rate as f64 * (measure + measure / 4).as_secs_f64()).round() as u64;
            let q = |p: f64| result.hist.value_at_quantile(p) as f64 / 1e3;
            let mut store_hist = result.hist.clone();
            store_hist.subtract(&result.fallback_hist)?;
            let level = Level {
                run,
                factor,
                offered: rate as f64,
                answered: result.checks as f64 / measure.as_secs_f64(),
                p50_us: q(0.5),
                p99_us: q(0.99),
                p999_us: q(0.999),
                fail_mode_pct: 100.0 * result.fallbacks as f64 / result.checks.max(1) as f64,
                store_p99_us: store_hist.value_at_quantile(0.99) as f64 / 1e3,
                fail_mode_p99_us: result.fallback_hist.value_at_quantile(0.99) as f64 / 1e3,
                unanswered: offered_all.saturating_sub(result.all_checks),
                echo_p99_us: echo.hist.value_at_quantile(0.99) as f64 / 1e3,
            };
            println!(
                "  {factor:>4}x  offered {:>8.0}/s  answered {:>8.0}/s  p50 {:>9.1} µs  p99 {:>9.1} µs  p99.9 {:>9.1} µs  fail mode {:>5.1} %  p99 store {:>9.1} µs  p99 fail mode {:>9.1} µs  unanswered {}  echo p99 {:>9.1} µs",
                level.offered, level.answered, level.p50_us, level.p99_us, level.p999_us, level.fail_mode_pct, level.store_p99_us, level.fail_mode_p99_us, level.unanswered, level.echo_p99_us
            );
            report.levels.push(level);
        }
    }
    println!("\nmedians over {} runs", runs.max(1));
    for &factor in factors {
        let of = |f: fn(&Level) -> f64| {
            let mut v: Vec<f64> = report
                .levels
                .iter()
                .filter(|l| l.factor == factor)
                .map(f)
                .collect();
            v.sort_by(f64::total_cmp);
            v[v.len() / 2]
        };
        println!(
            "  {factor:>4}x  answered {:>8.0}/s  p99 {:>9.1} µs  fail mode {:>5.1} %  p99 store {:>9.1} µs  p99 fail mode {:>9.1} µs  echo p99 {:>9.1} µs",
            of(|l| l.answered),
            of(|l| l.p99_us),
            of(|l| l.fail_mode_pct),
            of(|l| l.store_p99_us),
            of(|l| l.fail_mode_p99_us),
            of(|l| l.echo_p99_us)
        );
    }
    Ok(report)
}
