//! The chaos scenario: a Redis outage under a fixed offered load through two agents, then an agent
//! restart under load through the SDK. It reports what the fault costs callers: p99 during the outage,
//! the share answered by the fallback, the admitted rate against the limit, the time from Redis's
//! return to answers from Redis, and SDK errors and p99 across an agent restart.

use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use floodgate_protocol::Source;
use floodgate_sdk::{Client, Origin};
use floodgate_tests::{Agent, RedisServer};
use hdrhistogram::Histogram;
use serde::Serialize;

use crate::open::{drive, Answer as Sample};

/// The chaos rule: 5,000 per second on one hot key, offered 10,000/s.
const RULES: &str = r#"{"rules":[{"id":"bench","dimension":"user","limit":5000,"windowSeconds":1}]}"#;
const LIMIT_PER_S: f64 = 5_000.0;

/// Figures of one phase.
#[derive(Debug, Serialize)]
pub struct Phase {
    name: &'static str,
    checks: usize,
    p50_us: f64,
    p99_us: f64,
    max_us: f64,
    fallback_share: f64,
    admitted_per_s: f64,
    admitted_over_limit: f64,
}

/// The whole chaos report.
#[derive(Debug, Serialize)]
pub struct Report {
    offered_per_s: u64,
    redis_timeout_ms: u64,
    phases: Vec<Phase>,
    recovery_ms: Option<f64>,
    agent_restart: RestartReport,
}

/// The agent-restart part.
#[derive(Debug, Serialize)]
pub struct RestartReport {
    calls: usize,
    sdk_errors: usize,
    degraded: usize,
    p99_us: f64,
    max_us: f64,
    sdk_timeout_ms: u64,
}

/// Runs both scenarios and prints and returns the report.
pub async fn run(rate: u64, redis_timeout_ms: u64) -> anyhow::Result<Report> {
    let mut redis = RedisServer::start();
    let timeout = redis_timeout_ms.to_string();
    let agent = |url: String| {
        let timeout = timeout.clone();
        async move {
            Agent::builder()
                .redis(&url)
                .rules(RULES)
                .arg("--redis-timeout-ms")
                .arg(&timeout)
                .start()
                .await
        }
    };
    let a = agent(redis.url()).await;
    let b = agent(redis.url()).await;
    // Both agents heartbeat within a second; let them learn N = 2 before the load starts.
    tokio::time::sleep(Duration::from_millis(2_500)).await;

    let (kill_at, restart_at, end) = (
        Duration::from_secs(2),
        Duration::from_secs(5),
        Duration::from_secs(9),
    );
    let t0 = Instant::now() + Duration::from_millis(20);
    let per_agent = rate / 2;
    let sa = drive(a.socket(), per_agent as f64, Duration::ZERO, t0, end, |_| 0)?;
    let sb = drive(b.socket(), per_agent as f64, Duration::ZERO, t0, end, |_| 0)?;
    sleep_until(t0 + kill_at).await;
    redis.kill();
    sleep_until(t0 + restart_at).await;
    redis.restart();
    let mut samples = sa.join().map_err(|_| anyhow::anyhow!("load thread panicked"))??;
    samples.extend(sb.join().map_err(|_| anyhow::anyhow!("load thread panicked"))??);
    samples.sort_by_key(|s| s.at);

    let phases = vec![
        phase("before the outage", &samples, Duration::from_millis(500), kill_at),
        phase(
            "Redis down (kill -9)",
            &samples,
            kill_at + Duration::from_millis(100),
            restart_at,
        ),
        phase(
            "after the restart",
            &samples,
            restart_at + Duration::from_secs(1),
            end,
        ),
    ];
    let recovery_ms = samples
        .iter()
        .find(|s| s.at >= restart_at && s.source == Some(Source::Redis))
        .map(|s| (s.at + s.latency - restart_at).as_secs_f64() * 1_000.0);
    drop((a, b));

    let agent_restart = agent_restart(&redis).await?;
    let report = Report {
        offered_per_s: rate,
        redis_timeout_ms,
        phases,
        recovery_ms,
        agent_restart,
    };
    print(&report);
    Ok(report)
}

async fn sleep_until(t: Instant) {
    tokio::time::sleep_until(tokio::time::Instant::from_std(t)).await;
}

fn phase(name: &'static str, samples: &[Sample], from: Duration, to: Duration) -> Phase {
    let mut hist = Histogram::<u64>::new_with_bounds(1, 60_000_000_000, 3).expect("histogram");
    let inside: Vec<&Sample> = samples.iter().filter(|s| s.at >= from && s.at < to).collect();
    for s in &inside {
        hist.saturating_record(s.latency.as_nanos() as u64);
    }
    let secs = (to - from).as_secs_f64();
    let admitted = inside.iter().filter(|s| s.allowed).count() as f64 / secs;
    let fallback = inside
        .iter()
        .filter(|s| s.source == Some(Source::Fallback))
        .count();
    Phase {
        name,
        checks: inside.len(),
        p50_us: hist.value_at_quantile(0.5) as f64 / 1e3,
        p99_us: hist.value_at_quantile(0.99) as f64 / 1e3,
        max_us: hist.max() as f64 / 1e3,
        fallback_share: fallback as f64 / inside.len().max(1) as f64,
        admitted_per_s: admitted,
        admitted_over_limit: admitted / LIMIT_PER_S,
    }
}

/// SDK calls at 2,000/s while the agent is killed (kill -9) and restarted a second later.
async fn agent_restart(redis: &RedisServer) -> anyhow::Result<RestartReport> {
    let mut agent = Agent::builder()
        .redis(&redis.url())
        .shipped_timeout()
        .rules(RULES)
        .start()
        .await;
    let socket = agent.socket().to_path_buf();
    let client = Client::connect(&socket).await;
    let sdk_timeout = floodgate_sdk::ClientConfig::default().timeout;
    let results = Arc::new(Mutex::new(Vec::new()));
    let start = tokio::time::Instant::now();
    let mut tick = tokio::time::interval(Duration::from_millis(1));
    let mut calls = Vec::new();
    let mut replacement = None;
    let mut killed = false;
    while start.elapsed() < Duration::from_secs(4) {
        tick.tick().await;
        if !killed && start.elapsed() >= Duration::from_secs(1) {
            agent.kill();
            killed = true;
        }
        if killed && replacement.is_none() && start.elapsed() >= Duration::from_secs(2) {
            replacement = Some(
                Agent::builder()
                    .redis(&redis.url())
                    .rules(RULES)
                    .socket(&socket)
                    .shipped_timeout()
                    .start()
                    .await,
            );
        }
        for _ in 0..2 {
            let (client, results) = (client.clone(), results.clone());
            calls.push(tokio::spawn(async move {
                let t = Instant::now();
                let r = client.allow("user:restart", "bench", 1).await;
                results.lock().unwrap().push((t.elapsed(), r.map(|d| d.origin)));
            }));
        }
    }
    for c in calls {
        c.await?;
    }
    drop(replacement);
    let results = results.lock().unwrap();
    let mut hist = Histogram::<u64>::new_with_bounds(1, 60_000_000_000, 3)?;
    for (took, _) in results.iter() {
        hist.saturating_record(took.as_nanos() as u64);
    }
    Ok(RestartReport {
        calls: results.len(),
        sdk_errors: results.iter().filter(|(_, r)| r.is_err()).count(),
        degraded: results
            .iter()
            .filter(|(_, r)| matches!(r, Ok(o) if !matches!(o, Origin::Agent(_))))
            .count(),
        p99_us: hist.value_at_quantile(0.99) as f64 / 1e3,
        max_us: hist.max() as f64 / 1e3,
        sdk_timeout_ms: sdk_timeout.as_millis() as u64,
    })
}

fn print(r: &Report) {
    println!(
        "\nchaos: {} checks/s offered through two agents (2 × {}), limit {LIMIT_PER_S}/s on one key, agents' Redis timeout {} ms",
        r.offered_per_s,
        r.offered_per_s / 2,
        r.redis_timeout_ms
    );
    println!(
        "{:<22} {:>8} {:>9} {:>9} {:>9} {:>10} {:>12} {:>10}",
        "phase", "checks", "p50 µs", "p99 µs", "max µs", "fallback", "admitted/s", "/ limit"
    );
    for p in &r.phases {
        println!(
            "{:<22} {:>8} {:>9.1} {:>9.1} {:>9.1} {:>9.1}% {:>12.0} {:>10.2}",
            p.name,
            p.checks,
            p.p50_us,
            p.p99_us,
            p.max_us,
            p.fallback_share * 100.0,
            p.admitted_per_s,
            p.admitted_over_limit
        );
    }
    match r.recovery_ms {
        Some(ms) => println!("Redis back → first answer from Redis: {ms:.0} ms"),
        None => println!("Redis back → no answer from Redis before the end"),
    }
    let a = &r.agent_restart;
    println!(
        "agent kill -9 + restart under 2,000 SDK calls/s: {} calls, {} SDK errors, {} answered by the SDK's fail policy, p99 {:.1} µs, max {:.1} µs (SDK timeout {} ms)",
        a.calls, a.sdk_errors, a.degraded, a.p99_us, a.max_us, a.sdk_timeout_ms
    );
}
