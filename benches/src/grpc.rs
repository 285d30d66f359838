//! Envoy's ShouldRateLimit over gRPC against the agent's own protocol (the Rust SDK over the Unix
//! socket) in the same run, on the same agent: p50/p99, checks/s and agent CPU per check at each
//! concurrency level (requests in flight on one HTTP/2 channel, or on one SDK client). BENCHMARKS.md,
//! "Envoy's ShouldRateLimit over gRPC vs the frames protocol", has the figures.

use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use floodgate_agent::envoy::proto::{Code, Entry, RateLimitClient, RateLimitDescriptor, RateLimitRequest};
use floodgate_tests::{Agent, RedisServer};
use serde::Serialize;

use crate::gateway::{closed_clients, median, us};

/// The same limit twice: once for item checks (`bench`), once as an Envoy descriptor (`user`).
pub(crate) const RULES: &str = r#"{"rules":[
  {"id":"bench","dimension":"user","limit":1000000000000,"windowSeconds":60},
  {"id":"bench-envoy","dimension":"descriptor","limit":1000000000000,"windowSeconds":60,
   "envoy":{"domain":"bench","descriptors":[{"key":"user"}]}}]}"#;

/// ShouldRateLimit of domain `bench` for one user (the `bench-envoy` rule's descriptor).
pub(crate) fn user_request(user: usize) -> RateLimitRequest {
    RateLimitRequest {
        domain: "bench".into(),
        descriptors: vec![RateLimitDescriptor {
            entries: vec![Entry {
                key: "user".into(),
                value: user.to_string(),
            }],
            ..Default::default()
        }],
        hits_addend: 1,
    }
}

/// One side of one run.
#[derive(Serialize, Clone)]
pub struct Side {
    /// p50, µs.
    pub p50_us: f64,
    /// p99, µs.
    pub p99_us: f64,
    /// Checks/s while measuring.
    pub rate: f64,
    /// Agent CPU (user + system) per check, µs.
    pub cpu_us: f64,
}

/// gRPC vs frames at one level, one run.
#[derive(Serialize)]
pub struct GrpcRun {
    /// `memory` or `redis`.
    pub store: String,
    /// Requests in flight.
    pub clients: usize,
    /// ShouldRateLimit over gRPC.
    pub grpc: Side,
    /// The Rust SDK's allow over the Unix socket.
    pub frames: Side,
}

async fn measure<F, Fut>(pid: Option<u32>, clients: usize, seconds: f64, request: F) -> anyhow::Result<Side>
where
    F: Fn(usize) -> Fut + Clone + Send + 'static,
    Fut: std::future::Future<Output = anyhow::Result<Duration>> + Send,
{
    let all = Arc::new(AtomicU64::new(0));
    let counted = {
        let all = all.clone();
        move |user| {
            all.fetch_add(1, Ordering::Relaxed);
            request(user)
        }
    };
    let cpu = || pid.and_then(crate::cpu_ticks).unwrap_or(0);
    let before = cpu();
    let hist = closed_clients(clients, Duration::from_secs_f64(seconds), counted).await?;
    let ticks = cpu().saturating_sub(before);
    Ok(Side {
        p50_us: us(&hist, 0.5),
        p99_us: us(&hist, 0.99),
        rate: hist.len() as f64 / seconds,
        // Ticks of 10 ms over every request, warm-up included.
        cpu_us: ticks as f64 * 10_000.0 / all.load(Ordering::Relaxed).max(1) as f64,
    })
}

/// How the agent measured runs.
pub struct AgentArgs {
    /// Its `--grpc-server`.
    pub server: String,
    /// Its `--threads`.
    pub threads: usize,
}

/// `runs` runs at each level in `levels`, on the embedded store and on Redis, alternating which
/// side goes first.
pub async fn run(
    runs: usize,
    levels: &[usize],
    seconds: f64,
    stores: &[String],
    agent_args: &AgentArgs,
) -> anyhow::Result<Vec<GrpcRun>> {
    let mut out = Vec::new();
    for store in stores {
        let redis = (store == "redis").then(RedisServer::start);
        let mut b = Agent::builder()
            .rules(RULES)
            .arg("--grpc")
            .arg("127.0.0.1:0")
            .arg("--grpc-server")
            .arg(&agent_args.server)
            .arg("--threads")
            .arg(&agent_args.threads.to_string());
        if let Some(r) = &redis {
            // A patient store timeout: every answer is Redis's, none the fail mode's.
            b = b.redis(&r.url());
        }
        let agent = b.start().await;
        let addr = agent.logged_addr("RateLimitService (gRPC) listening").await;
        let grpc = RateLimitClient::connect(format!("http://{addr}")).await?;
        let sdk = floodgate_tests::patient_client(agent.socket()).await;
        for &clients in levels {
            let mut rows = Vec::new();
            for run in 0..runs.max(1) {
                let g = grpc.clone();
                let grpc_side = || {
                    let g = g.clone();
                    measure(agent.pid(), clients, seconds, move |user| {
                        let mut g = g.clone();
                        async move {
                            let t = Instant::now();
                            let r = g.should_rate_limit(user_request(user)).await?;
                            let took = t.elapsed();
                            anyhow::ensure!(
                                r.overall_code == Code::Ok as i32 && r.statuses[0].current_limit.is_some(),
                                "unexpected answer {r:?}"
                            );
                            Ok(took)
                        }
                    })
                };
                let s = sdk.clone();
                let frames_side = || {
                    let s = s.clone();
                    measure(agent.pid(), clients, seconds, move |user| {
                        let s = s.clone();
                        async move {
                            let key = format!("user:{user}");
                            let t = Instant::now();
                            let d = s.allow(&key, "bench", 1).await?;
                            let took = t.elapsed();
                            anyhow::ensure!(d.allowed && d.from_agent_answer(), "unexpected answer {d:?}");
                            Ok(took)
                        }
                    })
                };
                let (g, f) = if run % 2 == 0 {
                    let g = grpc_side().await?;
                    (g, frames_side().await?)
                } else {
                    let f = frames_side().await?;
                    (grpc_side().await?, f)
                };
                println!(
                    "{store} clients {clients:>3} run {}: grpc p50 {:>6.0} µs p99 {:>6.0} µs {:>7.0}/s {:>5.1} µs CPU · frames p50 {:>6.0} µs p99 {:>6.0} µs {:>7.0}/s {:>5.1} µs CPU",
                    run + 1,
                    g.p50_us,
                    g.p99_us,
                    g.rate,
                    g.cpu_us,
                    f.p50_us,
                    f.p99_us,
                    f.rate,
                    f.cpu_us
                );
                rows.push(GrpcRun {
                    store: store.clone(),
                    clients,
                    grpc: g,
                    frames: f,
                });
            }
            let m = |f: &dyn Fn(&GrpcRun) -> f64| median(rows.iter().map(f).collect());
            println!(
                "{store} clients {clients:>3} median of {}: p50 grpc/frames {:.2}, p99 {:.2}, checks/s {:.2}, CPU/check {:.2} ({:.1} vs {:.1} µs)",
                rows.len(),
                m(&|r| r.grpc.p50_us / r.frames.p50_us.max(0.001)),
                m(&|r| r.grpc.p99_us / r.frames.p99_us.max(0.001)),
                m(&|r| r.grpc.rate / r.frames.rate.max(0.001)),
                m(&|r| r.grpc.cpu_us / r.frames.cpu_us.max(0.001)),
                m(&|r| r.grpc.cpu_us),
                m(&|r| r.frames.cpu_us),
            );
            out.extend(rows);
        }
    }
    Ok(out)
}
