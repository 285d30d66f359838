//! The chaos scenario: a Redis outage under a fixed offered load through two agents, then an agent
//! restart under load through the SDK. It reports what the fault costs callers: p99 during the outage,
//! the share answered by the fallback, the admitted rate against the limit, the time from Redis's
//! return to answers from Redis, and SDK errors and p99 across an agent restart.

use std::io::{Read, Write};
use std::os::unix::net::UnixStream;
use std::path::Path;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use floodgate_protocol::{decode, Body, DecodeError, Source};
use floodgate_sdk::{Client, Origin};
use floodgate_tests::{Agent, RedisServer};
use hdrhistogram::Histogram;
use serde::Serialize;

use crate::targets::check_frame;

/// The chaos rule: 5,000 per second on one hot key, offered 10,000/s.
const RULES: &str = r#"{"rules":[{"id":"bench","dimension":"user","limit":5000,"windowSeconds":1}]}"#;
const LIMIT_PER_S: f64 = 5_000.0;

/// One answered request of the open loop.
#[derive(Clone, Copy)]
struct Sample {
    /// Intended send time, from the start.
    at: Duration,
    latency: Duration,
    source: Option<Source>,
    allowed: bool,
}

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
    let sa = spawn_open(a.socket(), per_agent, t0, end);
    let sb = spawn_open(b.socket(), per_agent, t0, end);
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

/// An open loop on one connection: sends at `rate` from `t0` to `t0 + end`, records every answer.
fn spawn_open(
    socket: &Path,
    rate: u64,
    t0: Instant,
    end: Duration,
) -> std::thread::JoinHandle<anyhow::Result<Vec<Sample>>> {
    let socket = socket.to_path_buf();
    std::thread::spawn(move || {
        let stream = UnixStream::connect(&socket)?;
        let mut reader = stream.try_clone()?;
        let mut writer = stream;
        let interval = 1e9 / rate as f64;
        let intended = move |i: u64| Duration::from_nanos((i as f64 * interval) as u64);
        let total = (end.as_secs_f64() * rate as f64) as u64;
        let done = Arc::new(AtomicBool::new(false));
        let done_w = done.clone();
        let sender = std::thread::spawn(move || -> anyhow::Result<()> {
            let mut i = 0u64;
            let mut out = Vec::with_capacity(4096);
            while i < total {
                let now = Instant::now();
                let next = t0 + intended(i);
                if next > now {
                    // Sleep rather than spin: two spinning senders would take both cores from the
                    // agents and Redis they measure (a late send still counts: latency is measured
                    // from the intended time).
                    std::thread::sleep(next - now);
                    continue;
                }
                out.clear();
                while i < total && t0 + intended(i) <= now {
                    check_frame((i + 1) as u32, 0, &mut out);
                    i += 1;
                }
                writer.write_all(&out)?;
            }
            done_w.store(true, Ordering::Release);
            Ok(())
        });
        let mut samples = Vec::with_capacity(total as usize);
        let mut buf = vec![0u8; 64 * 1024];
        let mut filled = 0;
        reader.set_read_timeout(Some(Duration::from_millis(100)))?;
        let give_up = t0 + end + Duration::from_secs(5);
        while (samples.len() as u64) < total && Instant::now() < give_up {
            match reader.read(&mut buf[filled..]) {
                Ok(0) => break,
                Ok(n) => filled += n,
                Err(e)
                    if matches!(
                        e.kind(),
                        std::io::ErrorKind::WouldBlock | std::io::ErrorKind::TimedOut
                    ) =>
                {
                    continue
                }
                Err(e) => return Err(e.into()),
            }
            let now = Instant::now();
            let mut pos = 0;
            loop {
                match decode(&buf[pos..filled]) {
                    Ok((frame, used)) => {
                        pos += used;
                        let i = u64::from(frame.request_id).saturating_sub(1);
                        let at = intended(i);
                        let (source, allowed) = match &frame.body {
                            Body::Decision(d) => (Some(d.combined.source), d.combined.allowed),
                            _ => (None, false),
                        };
                        samples.push(Sample {
                            at,
                            latency: now.saturating_duration_since(t0 + at),
                            source,
                            allowed,
                        });
                    }
                    Err(DecodeError::Incomplete) => break,
                    Err(e) => anyhow::bail!("bad frame: {e}"),
                }
            }
            buf.copy_within(pos..filled, 0);
            filled -= pos;
        }
        sender.join().map_err(|_| anyhow::anyhow!("sender panicked"))??;
        let _ = done.load(Ordering::Acquire);
        Ok(samples)
    })
}

/// SDK calls at 2,000/s while the agent is killed (kill -9) and restarted a second later.
async fn agent_restart(redis: &RedisServer) -> anyhow::Result<RestartReport> {
    let mut agent = Agent::builder().redis(&redis.url()).rules(RULES).start().await;
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
