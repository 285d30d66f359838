//! Hostile gRPC peers against one agent (embedded store, one worker thread), one attack at a time,
//! while honest clients measure: a tonic client with 16 ShouldRateLimit calls in flight on one
//! channel, then the Rust SDK with 16 checks in flight over the Unix socket. Per attack and run: the
//! honest p50/p99 of both, beside the same run's no-attack phase, the agent's largest RSS while
//! the attack ran (sampled every 50 ms), and how many connections the attackers opened (each one
//! the agent ended is reopened). BENCHMARKS.md, "Hostile gRPC peers", has the figures.

use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use floodgate_agent::envoy::proto::{Entry, RateLimitClient, RateLimitDescriptor, RateLimitRequest};
use floodgate_tests::raw_h2::{
    frame_bytes, grpc_message, CONTINUATION, DATA, END_HEADERS, END_STREAM, HEADERS, PATH, RST_STREAM,
    SETTINGS,
};
use floodgate_tests::Agent;
use serde::Serialize;
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::TcpStream;

use crate::gateway::{closed_clients, median, us};

use crate::grpc::RULES;

/// The attacks, each with the connections it keeps open at once.
const ATTACKS: [(&str, usize); 6] = [
    ("none", 0),
    // SETTINGS_INITIAL_WINDOW_SIZE 0, then valid calls as fast as they go: answers park.
    ("zero-window", 20),
    // 64 answers parked, then 16 KiB SETTINGS frames of 2,730 window changes each.
    ("settings-flood", 4),
    // A stream opened and reset, again and again (CVE-2023-44487).
    ("rapid-reset", 4),
    // A header block kept open by empty CONTINUATIONs as fast as they go.
    ("continuation", 4),
    // Valid calls of 16 descriptors with 800-byte values (13 KiB) from a tonic client (flow control
    // kept), 256 in flight on one channel: one connection's worth of work ahead of everyone else's.
    ("large-flood", 1),
];

/// One attack in one run.
#[derive(Serialize, Debug, Clone)]
pub struct Row {
    /// The run (0-based).
    pub run: usize,
    /// The attack.
    pub attack: String,
    /// Honest gRPC calls: p50 and p99, µs.
    pub grpc_p50_us: f64,
    /// The same, p99.
    pub grpc_p99_us: f64,
    /// Honest frames checks over the Unix socket: p50, µs.
    pub frames_p50_us: f64,
    /// The same, p99.
    pub frames_p99_us: f64,
    /// The agent's largest RSS while the attack ran, MiB.
    pub max_rss_mib: f64,
    /// Connections the attackers opened.
    pub attack_connections: u64,
}

fn rss_kib(pid: u32) -> u64 {
    std::fs::read_to_string(format!("/proc/{pid}/status"))
        .ok()
        .and_then(|s| {
            s.lines()
                .find_map(|l| l.strip_prefix("VmRSS:"))
                .and_then(|v| v.trim().trim_end_matches(" kB").trim().parse().ok())
        })
        .unwrap_or(0)
}

fn call(user: &str, descriptors: usize, value_len: usize) -> Vec<u8> {
    let request = RateLimitRequest {
        domain: "bench".into(),
        descriptors: (0..descriptors)
            .map(|i| RateLimitDescriptor {
                entries: vec![Entry {
                    key: "user".into(),
                    value: format!("{user}-{i}-{}", "v".repeat(value_len)),
                }],
                ..Default::default()
            })
            .collect(),
        hits_addend: 1,
    };
    grpc_message(&request)
}

fn request_block() -> Vec<u8> {
    floodgate_tests::raw_h2::block(&[
        (":method", "POST"),
        (":scheme", "http"),
        (":path", PATH),
        (":authority", "agent"),
        ("content-type", "application/grpc"),
    ])
}

/// One attacking connection, from its preface until the agent ends it or `until`.
async fn attack_once(kind: &str, addr: std::net::SocketAddr, until: Instant) -> std::io::Result<()> {
    let io = TcpStream::connect(addr).await?;
    let (mut rd, mut wr) = io.into_split();
    // Whatever the agent sends is read and dropped, so that it never waits on this side.
    let drain = tokio::spawn(async move {
        let mut buf = vec![0u8; 64 * 1024];
        while matches!(rd.read(&mut buf).await, Ok(n) if n > 0) {}
    });
    let settings = if matches!(kind, "zero-window" | "settings-flood") {
        vec![0, 4, 0, 0, 0, 0]
    } else {
        vec![]
    };
    let mut out = b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n".to_vec();
    out.extend(frame_bytes(SETTINGS, 0, 0, &settings));
    wr.write_all(&out).await?;
    let block = request_block();
    let small = call("attacker", 1, 8);
    let mut id = 1u32;
    let mut batch = Vec::with_capacity(64 * 1024);
    let result = async {
        if kind == "settings-flood" {
            for _ in 0..64 {
                batch.extend(frame_bytes(HEADERS, END_HEADERS, id, &block));
                batch.extend(frame_bytes(DATA, END_STREAM, id, &small));
                id += 2;
            }
        }
        let mut entries = Vec::with_capacity(16_380);
        for i in 0..2_730u32 {
            entries.extend_from_slice(&4u16.to_be_bytes());
            entries.extend_from_slice(&(i % 2).to_be_bytes());
        }
        while Instant::now() < until && !drain.is_finished() {
            match kind {
                "zero-window" => {
                    for _ in 0..32 {
                        batch.extend(frame_bytes(HEADERS, END_HEADERS, id, &block));
                        batch.extend(frame_bytes(DATA, END_STREAM, id, &small));
                        id += 2;
                    }
                }
                "settings-flood" => batch.extend(frame_bytes(SETTINGS, 0, 0, &entries)),
                "rapid-reset" => {
                    for _ in 0..32 {
                        batch.extend(frame_bytes(HEADERS, END_HEADERS, id, &block));
                        batch.extend(frame_bytes(RST_STREAM, 0, id, &8u32.to_be_bytes()));
                        id += 2;
                    }
                }
                "continuation" => {
                    if id == 1 {
                        batch.extend(frame_bytes(HEADERS, 0, 1, &block));
                        id = 3;
                    }
                    for _ in 0..32 {
                        batch.extend(frame_bytes(CONTINUATION, 0, 1, &[]));
                    }
                }
                _ => break,
            }
            wr.write_all(&batch).await?;
            batch.clear();
            if id > 2_000_000_000 {
                break;
            }
        }
        std::io::Result::Ok(())
    }
    .await;
    drain.abort();
    result
}

/// 256 large calls in flight on one tonic channel until `until`: `loadgen flood`, run as a process
/// of its own so that its client's CPU is not the honest clients' runtime's.
pub async fn flood(addr: std::net::SocketAddr, until: Instant) -> anyhow::Result<()> {
    let client = RateLimitClient::connect(format!("http://{addr}")).await?;
    let request = RateLimitRequest {
        domain: "bench".into(),
        descriptors: (0..16)
            .map(|i| RateLimitDescriptor {
                entries: vec![Entry {
                    key: "user".into(),
                    value: format!("flood-{i}-{}", "v".repeat(800)),
                }],
                ..Default::default()
            })
            .collect(),
        hits_addend: 1,
    };
    let mut calls = Vec::new();
    for _ in 0..256 {
        let (mut client, request) = (client.clone(), request.clone());
        calls.push(tokio::spawn(async move {
            while Instant::now() < until {
                let _ = client.should_rate_limit(request.clone()).await;
            }
        }));
    }
    for c in calls {
        c.await?;
    }
    Ok(())
}

/// [`flood`] in a child process of this same binary until `until`.
fn large_flood(addr: std::net::SocketAddr, until: Instant, opened: Arc<AtomicU64>) {
    opened.fetch_add(1, Ordering::Relaxed);
    let seconds = until.saturating_duration_since(Instant::now()).as_secs_f64();
    let exe = std::env::current_exe().expect("the load generator's own path");
    let child = tokio::process::Command::new(exe)
        .args([
            "flood",
            "--addr",
            &addr.to_string(),
            "--seconds",
            &format!("{seconds:.3}"),
        ])
        .kill_on_drop(true)
        .spawn();
    tokio::spawn(async move {
        if let Ok(mut child) = child {
            let _ = child.wait().await;
        }
    });
}

/// Keeps `conns` connections attacking until `until`, reopening each one the agent ends.
fn start_attack(
    kind: &'static str,
    conns: usize,
    addr: std::net::SocketAddr,
    until: Instant,
    opened: Arc<AtomicU64>,
) {
    if kind == "large-flood" {
        return large_flood(addr, until, opened);
    }
    for _ in 0..conns {
        let opened = opened.clone();
        tokio::spawn(async move {
            while Instant::now() < until {
                opened.fetch_add(1, Ordering::Relaxed);
                if attack_once(kind, addr, until).await.is_err() {
                    tokio::time::sleep(Duration::from_millis(5)).await;
                }
            }
        });
    }
}

/// Runs every attack `runs` times on one agent.
pub async fn run(runs: usize, seconds: f64, only: &str) -> anyhow::Result<Vec<Row>> {
    let agent = Agent::builder()
        .rules(RULES)
        .arg("--grpc")
        .arg("127.0.0.1:0")
        .start()
        .await;
    let pid = agent.pid().expect("the agent runs");
    let addr = agent.logged_addr("RateLimitService (gRPC) listening").await;
    let grpc = RateLimitClient::connect(format!("http://{addr}")).await?;
    let sdk = floodgate_tests::patient_client(agent.socket()).await;
    let measure = Duration::from_secs_f64(seconds);
    let mut rows = Vec::new();
    for run in 0..runs.max(1) {
        for (attack, conns) in ATTACKS.iter().filter(|(a, _)| *a == "none" || a.contains(only)) {
            // Two measured phases, each with a quarter of warm-up, and a second to get going.
            let until = Instant::now() + measure.mul_f64(2.5) + Duration::from_secs(1);
            let opened = Arc::new(AtomicU64::new(0));
            start_attack(attack, *conns, addr, until, opened.clone());
            let sampler = tokio::spawn(async move {
                let mut max = 0;
                while Instant::now() < until {
                    max = max.max(rss_kib(pid));
                    tokio::time::sleep(Duration::from_millis(50)).await;
                }
                max
            });
            tokio::time::sleep(Duration::from_secs(1)).await;
            let g = grpc.clone();
            let grpc_hist = closed_clients(16, measure, move |user| {
                let mut g = g.clone();
                async move {
                    let t = Instant::now();
                    g.should_rate_limit(crate::grpc::user_request(user)).await?;
                    Ok(t.elapsed())
                }
            })
            .await?;
            let s = sdk.clone();
            let frames_hist = closed_clients(16, measure, move |user| {
                let s = s.clone();
                async move {
                    let key = format!("user:{user}");
                    let t = Instant::now();
                    let d = s.allow(&key, "bench", 1).await?;
                    anyhow::ensure!(d.from_agent_answer(), "an answer by the fail policy: {d:?}");
                    Ok(t.elapsed())
                }
            })
            .await?;
            let max_rss = sampler.await?;
            let row = Row {
                run,
                attack: attack.to_string(),
                grpc_p50_us: us(&grpc_hist, 0.5),
                grpc_p99_us: us(&grpc_hist, 0.99),
                frames_p50_us: us(&frames_hist, 0.5),
                frames_p99_us: us(&frames_hist, 0.99),
                max_rss_mib: max_rss as f64 / 1024.0,
                attack_connections: opened.load(Ordering::Relaxed),
            };
            println!(
                "run {} {:<15} grpc p50 {:>6.0} µs p99 {:>6.0} µs · frames p50 {:>6.0} µs p99 {:>6.0} µs · max RSS {:>6.1} MiB · {} attack connections",
                run + 1,
                row.attack,
                row.grpc_p50_us,
                row.grpc_p99_us,
                row.frames_p50_us,
                row.frames_p99_us,
                row.max_rss_mib,
                row.attack_connections
            );
            rows.push(row);
            // Let the last attackers' connections end before the next attack.
            tokio::time::sleep(Duration::from_millis(1_500)).await;
        }
    }
    for (attack, _) in ATTACKS.iter().filter(|(a, _)| *a == "none" || a.contains(only)) {
        let of =
            |f: &dyn Fn(&Row) -> f64| median(rows.iter().filter(|r| r.attack == *attack).map(f).collect());
        println!(
            "median {:<15} grpc p50 {:>6.0} p99 {:>6.0} µs · frames p50 {:>6.0} p99 {:>6.0} µs · max RSS {:>6.1} MiB",
            attack,
            of(&|r| r.grpc_p50_us),
            of(&|r| r.grpc_p99_us),
            of(&|r| r.frames_p50_us),
            of(&|r| r.frames_p99_us),
            of(&|r| r.max_rss_mib),
        );
    }
    Ok(rows)
}
