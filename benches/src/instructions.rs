//! Instructions per check, counted by callgrind: repeatable where seconds on this shared VM are not.
//!
//! Each scenario starts an agent under `valgrind --tool=callgrind`, warms it up (connections, the
//! script cache, every key checked twice, so a cache-hit scenario's keys are all cached), zeroes the counts (`callgrind_control -z`), drives `n` checks,
//! and dumps the counts (`callgrind_control -d`): startup, warm-up and shutdown are left out, and
//! what is counted is `n` checks' worth. Per function, the self (exclusive) counts say where a
//! check's instructions go; functions are grouped by crate into categories (redis-rs, tokio's
//! timers, tasks and I/O, allocation, formatting, the agent's own code).
//!
//! What callgrind does not count: the kernel's side of every syscall (a socket read or write, an
//! epoll wait), which the /proc CPU figures of the other benchmarks include. The background loops
//! (flush tick, heartbeat) that run between the zero and the dump are counted: a few thousand
//! instructions per 5 ms tick, small against `n` checks, and part of what the agent spends.

use std::collections::HashMap;
use std::path::{Path, PathBuf};
use std::process::Command;
use std::time::Duration;

use anyhow::{bail, Context};
use floodgate_tests::{Agent, RedisServer};
use serde::Serialize;

use crate::targets::{Conn, Target};

/// Rules of the scenarios: `bench` never rejects; `tight` rejects a key's second check for 10 minutes.
const RULES: &str = r#"{"rules":[
 {"id":"bench","dimension":"user","limit":1000000000000,"windowSeconds":60},
 {"id":"tight","dimension":"user","limit":1,"windowSeconds":600},
 {"id":"bench-envoy","dimension":"descriptor","limit":1000000000000,"windowSeconds":60,
  "envoy":{"domain":"bench","descriptors":[{"key":"user"}]}}
]}"#;

/// One path measured.
#[derive(Debug, Clone, Copy)]
pub struct Scenario {
    /// Its name in the report.
    pub name: &'static str,
    /// On Redis (else the embedded store).
    pub redis: bool,
    /// The rule checked.
    pub rule: &'static str,
    /// Connections.
    pub clients: usize,
    /// Checks in flight per connection.
    pub in_flight: usize,
    /// Distinct keys the checks cycle through.
    pub keys: usize,
    /// Over Envoy's RateLimitService, served by this `--grpc-server` (a connection is an HTTP/2
    /// channel and `rule` is ignored: the `bench` domain's descriptor rule); else the frames protocol.
    pub grpc: Option<&'static str>,
    /// Redis is named but nothing listens there: every check is answered by the fail mode (the
    /// limit/N fallback and its write-back ledger), the path every check takes while Redis is away.
    pub gone: bool,
    /// On a Redis Cluster of three masters (through redis-rs, keeping recent admissions for a
    /// failover) instead of one node.
    pub cluster: bool,
}

/// The scenarios (BENCHMARKS.md, "Instructions per check (callgrind)"): in-memory (one in flight and
/// pipelined), Redis sync at 16 and 64 in flight, a rejection answered from the cache, and Redis
/// gone (the fail mode).
pub const SCENARIOS: &[Scenario] = &[
    Scenario {
        name: "redis gone, fail mode, 16 clients × 1",
        redis: true,
        rule: "bench",
        clients: 16,
        in_flight: 1,
        keys: 10_000,
        grpc: None,
        gone: true,
        cluster: false,
    },
    Scenario {
        name: "memory, 16 clients × 1",
        redis: false,
        rule: "bench",
        clients: 16,
        in_flight: 1,
        keys: 10_000,
        grpc: None,
        gone: false,
        cluster: false,
    },
    Scenario {
        name: "memory, 16 clients × 64 pipelined",
        redis: false,
        rule: "bench",
        clients: 16,
        in_flight: 64,
        keys: 10_000,
        grpc: None,
        gone: false,
        cluster: false,
    },
    Scenario {
        name: "redis sync, 16 clients × 1",
        redis: true,
        rule: "bench",
        clients: 16,
        in_flight: 1,
        keys: 10_000,
        grpc: None,
        gone: false,
        cluster: false,
    },
    Scenario {
        name: "redis sync, 64 clients × 1",
        redis: true,
        rule: "bench",
        clients: 64,
        in_flight: 1,
        keys: 10_000,
        grpc: None,
        gone: false,
        cluster: false,
    },
    Scenario {
        name: "redis cluster sync, 16 clients × 1",
        redis: true,
        rule: "bench",
        clients: 16,
        in_flight: 1,
        keys: 10_000,
        grpc: None,
        gone: false,
        cluster: true,
    },
    Scenario {
        name: "redis, cache hit, 16 clients × 1",
        redis: true,
        rule: "tight",
        clients: 16,
        in_flight: 1,
        keys: 100,
        grpc: None,
        gone: false,
        cluster: false,
    },
    // The Envoy path against the frames path, both at 64 in flight on one connection (an HTTP/2
    // channel multiplexing 64 streams, a socket pipelining 64 frames).
    Scenario {
        name: "memory, frames, 1 client × 64",
        redis: false,
        rule: "bench",
        clients: 1,
        in_flight: 64,
        keys: 10_000,
        grpc: None,
        gone: false,
        cluster: false,
    },
    Scenario {
        name: "memory, grpc, 1 channel × 64",
        redis: false,
        rule: "bench",
        clients: 1,
        in_flight: 64,
        keys: 10_000,
        grpc: Some("native"),
        gone: false,
        cluster: false,
    },
    Scenario {
        name: "memory, grpc tonic, 1 channel × 64",
        redis: false,
        rule: "bench",
        clients: 1,
        in_flight: 64,
        keys: 10_000,
        grpc: Some("tonic"),
        gone: false,
        cluster: false,
    },
    Scenario {
        name: "memory, grpc h2, 1 channel × 64",
        redis: false,
        rule: "bench",
        clients: 1,
        in_flight: 64,
        keys: 10_000,
        grpc: Some("h2"),
        gone: false,
        cluster: false,
    },
    Scenario {
        name: "redis, frames, 1 client × 64",
        redis: true,
        rule: "bench",
        clients: 1,
        in_flight: 64,
        keys: 10_000,
        grpc: None,
        gone: false,
        cluster: false,
    },
    Scenario {
        name: "redis, grpc, 1 channel × 64",
        redis: true,
        rule: "bench",
        clients: 1,
        in_flight: 64,
        keys: 10_000,
        grpc: Some("native"),
        gone: false,
        cluster: false,
    },
    Scenario {
        name: "redis, grpc tonic, 1 channel × 64",
        redis: true,
        rule: "bench",
        clients: 1,
        in_flight: 64,
        keys: 10_000,
        grpc: Some("tonic"),
        gone: false,
        cluster: false,
    },
    Scenario {
        name: "redis, grpc h2, 1 channel × 64",
        redis: true,
        rule: "bench",
        clients: 1,
        in_flight: 64,
        keys: 10_000,
        grpc: Some("h2"),
        gone: false,
        cluster: false,
    },
];

/// One scenario's counts.
#[derive(Debug, Serialize)]
pub struct Counted {
    /// The scenario.
    pub scenario: String,
    /// Checks counted.
    pub checks: u64,
    /// Instructions per check (all of the agent's threads).
    pub per_check: f64,
    /// The share of the total the functions listed add up to (≈ 1: nothing double-counted or lost).
    pub coverage: f64,
    /// Per category: instructions per check, largest first.
    pub categories: Vec<(String, f64)>,
    /// The functions with the most self instructions per check.
    pub top: Vec<(String, f64)>,
}

/// Counts every scenario whose name contains `only` (all when empty).
pub async fn run(checks: u64, only: &str, out_dir: &Path, ledger: bool) -> anyhow::Result<Vec<Counted>> {
    std::fs::create_dir_all(out_dir)?;
    let redis = RedisServer::start();
    let mut all = Vec::new();
    for s in SCENARIOS.iter().filter(|s| s.name.contains(only)) {
        let file = out_dir.join(format!("callgrind.{}.out", slug(s.name)));
        let ledger = ledger.then(|| out_dir.join(format!("ledger.{}.jsonl", slug(s.name))));
        let (dumped, checks) = measure(s, &redis, checks, &file, ledger.as_deref()).await?;
        let counts = profile(&dumped)?;
        let per = |x: u64| x as f64 / checks as f64;
        let mut functions: Vec<(String, f64)> = counts
            .iter()
            .filter(|(f, _)| f.as_str() != TOTAL)
            .map(|(f, &v)| (f.clone(), per(v)))
            .collect();
        functions.sort_by(|a, b| b.1.total_cmp(&a.1));
        let mut cats: HashMap<&'static str, f64> = HashMap::new();
        for (f, v) in &functions {
            *cats.entry(category(f)).or_default() += v;
        }
        let mut categories: Vec<(String, f64)> = cats.into_iter().map(|(k, v)| (k.to_string(), v)).collect();
        categories.sort_by(|a, b| b.1.total_cmp(&a.1));
        let total = counts.get(TOTAL).copied().unwrap_or(0);
        let listed: u64 = counts
            .iter()
            .filter(|(f, _)| f.as_str() != TOTAL)
            .map(|(_, c)| c)
            .sum();
        let counted = Counted {
            scenario: s.name.into(),
            checks,
            per_check: per(total),
            coverage: listed as f64 / total.max(1) as f64,
            categories,
            top: functions.into_iter().take(25).collect(),
        };
        print(&counted);
        all.push(counted);
    }
    Ok(all)
}

/// One agent under callgrind: warm-up, zero, about `n` checks, dump; returns the dump's path and the
/// checks sent between the zero and the dump.
async fn measure(
    s: &Scenario,
    redis: &RedisServer,
    n: u64,
    file: &Path,
    ledger: Option<&Path>,
) -> anyhow::Result<(PathBuf, u64)> {
    let out = format!("--callgrind-out-file={}", file.display());
    let cluster = s.cluster.then(|| floodgate_tests::Cluster::start(3));
    let mut b = Agent::builder()
        .rules(RULES)
        .under(&["valgrind", "--tool=callgrind", "--quiet", &out])
        .ready_within(Duration::from_secs(120));
    if s.gone {
        // A port nothing listens on (bound, then let go): every connect is refused at once, the
        // breaker opens and stays open, and the fail mode answers.
        let port = std::net::TcpListener::bind("127.0.0.1:0")?.local_addr()?.port();
        b = b.redis(&format!("redis://127.0.0.1:{port}"));
    } else if s.redis {
        // Everything runs ~50× slower under callgrind: a patient store timeout keeps every check on
        // the path measured instead of the fail mode's.
        let url = match &cluster {
            Some(c) => {
                b = b.arg("--redis-cluster");
                c.urls()
            }
            None => redis.url(),
        };
        b = b
            .redis(&url)
            .arg("--redis-timeout-ms")
            .arg("5000")
            .arg("--breaker-min-streak-ms")
            .arg("60000");
    }
    if let Some(path) = ledger {
        b = b.arg("--ledger").arg(&path.display().to_string());
    }
    if let Some(server) = s.grpc {
        b = b
            .arg("--grpc")
            .arg("127.0.0.1:0")
            .arg("--grpc-server")
            .arg(server);
    }
    let mut agent = b.start().await;
    let target = if s.grpc.is_some() {
        Target::Grpc(
            agent
                .logged_addr("RateLimitService (gRPC) listening")
                .await
                .to_string(),
        )
    } else {
        Target::Agent(agent.socket().to_path_buf())
    };
    let pid = agent.pid().context("agent pid")?.to_string();
    let mut conns = Vec::new();
    for _ in 0..s.clients {
        conns.push(target.connect().await?);
    }
    // Every key seen once (a cache-hit scenario's keys rejected and cached), every connection used.
    let warm = (2 * s.keys as u64)
        .div_ceil(s.clients as u64)
        .max(s.in_flight as u64 * 4);
    conns = drive(s, conns, warm).await?.0;
    callgrind_control(&["-z", &pid])?;
    let per_client = (n / s.clients as u64).max(1);
    let (_, fallbacks) = drive(s, conns, per_client).await?;
    callgrind_control(&["-d", &pid])?;
    let measured = per_client * s.clients as u64;
    if s.gone && fallbacks != measured {
        bail!("{fallbacks} of {measured} checks answered by the fail mode: not the path measured");
    }
    if !s.gone && fallbacks > 0 {
        bail!("{fallbacks} checks answered by the fail mode: not the path measured");
    }
    agent.terminate_within(Duration::from_secs(120)).await;
    let dumped = PathBuf::from(format!("{}.1", file.display()));
    if !dumped.exists() {
        bail!(
            "callgrind wrote no {}; agent log:\n{}",
            dumped.display(),
            agent.log()
        );
    }
    Ok((dumped, measured))
}

/// `per_client` checks on every connection at once, `in_flight` at a time, keys cycling; returns the
/// connections and how many answers came from the fail mode.
async fn drive(s: &Scenario, conns: Vec<Conn>, per_client: u64) -> anyhow::Result<(Vec<Conn>, u64)> {
    let tasks: Vec<_> = conns
        .into_iter()
        .enumerate()
        .map(|(c, mut conn)| {
            let s = *s;
            tokio::spawn(async move {
                let (mut k, mut sent, mut fallbacks) = (c, 0, 0);
                let mut batch = Vec::with_capacity(s.in_flight);
                while sent < per_client {
                    batch.clear();
                    for _ in 0..s.in_flight.min((per_client - sent) as usize) {
                        batch.push(k % s.keys);
                        k += s.clients;
                    }
                    sent += batch.len() as u64;
                    fallbacks += conn.round_trip_on(s.rule, &batch).await?;
                }
                anyhow::Ok((conn, fallbacks))
            })
        })
        .collect();
    let mut out = (Vec::new(), 0);
    for t in tasks {
        let (conn, f) = t.await??;
        out.0.push(conn);
        out.1 += f;
    }
    Ok(out)
}

fn callgrind_control(args: &[&str]) -> anyhow::Result<()> {
    valgrind_tool(Command::new("callgrind_control").args(args)).map(drop)
}

/// Runs one of valgrind's tools to its end; its standard output, or its standard error as the error.
fn valgrind_tool(cmd: &mut Command) -> anyhow::Result<Vec<u8>> {
    let what = format!("{cmd:?}");
    let out = cmd.output().with_context(|| format!("{what} (valgrind)"))?;
    if !out.status.success() {
        bail!("{what}: {}", String::from_utf8_lossy(&out.stderr));
    }
    Ok(out.stdout)
}

const TOTAL: &str = "PROGRAM TOTALS";

/// Self instructions per function (and the program's total) from `callgrind_annotate`.
fn profile(file: &Path) -> anyhow::Result<HashMap<String, u64>> {
    let out = valgrind_tool(
        Command::new("callgrind_annotate")
            .args(["--threshold=100", "--auto=no", "--show-percs=no"])
            .arg(file),
    )?;
    let mut map = HashMap::new();
    for line in String::from_utf8_lossy(&out).lines() {
        let line = line.trim_start();
        let Some((count, rest)) = line.split_once(char::is_whitespace) else {
            continue;
        };
        let Ok(count) = count.replace(',', "").parse::<u64>() else {
            continue;
        };
        let name = rest.trim();
        // `file:function [object]`: the function (with its object when the file is unknown).
        let name = name.split_once(':').map_or(name, |(_, f)| f);
        // A trailing ` [/path/to/object]` names the binary; `[` inside a name (`<impl [T]>`) stays.
        let name = match name.rsplit_once(" [") {
            Some((f, obj)) if obj.ends_with(']') && obj.starts_with('/') => f,
            _ => name,
        };
        let name = name.trim().to_string();
        *map.entry(name).or_insert(0) += count;
    }
    // A dump taken mid-run lists the frames still on a thread's stack (thread start, the runtime's
    // worker loop) with the whole total as their own: they are not where anything is spent.
    let total = map.get(TOTAL).copied().unwrap_or(0);
    map.retain(|f, c| f == TOTAL || *c < total / 2);
    Ok(map)
}

/// The category a function's self instructions count under.
fn category(f: &str) -> &'static str {
    let has = |p: &str| f.contains(p);
    // Our crates first (`floodgate_redis::…` contains `redis::`), by the one named first: in
    // `<floodgate_redis::…::RedisStore as floodgate_core::…::SharedStore>::check` it is the store's code.
    const OURS: [(&str, &str); 4] = [
        ("floodgate_protocol", "floodgate-protocol (decode, encode)"),
        (
            "floodgate_core",
            "floodgate-core (engine, rules, cache, memory store)",
        ),
        ("floodgate_redis", "floodgate-redis (store, coalescer, shards)"),
        ("floodgate_agent", "floodgate-agent (connection loop)"),
    ];
    if let Some((_, c)) = OURS
        .iter()
        .filter_map(|(name, c)| f.find(name).map(|at| (at, *c)))
        .min_by_key(|(at, _)| *at)
    {
        c
    } else if has("malloc") || has("free") || has("realloc") || has("calloc") || has("alloc::alloc") {
        "allocation (malloc/free)"
    } else if has("memcpy") || has("memmove") || has("memset") || has("memcmp") {
        "memcpy/memmove/memset"
    } else if has("redis::") || has("<redis") || has("combine::") {
        "redis-rs (commands, parser, multiplexer)"
    } else if has("tokio::runtime::time") || has("tokio::time") {
        "tokio timers"
    } else if has("tokio::runtime::task") || has("tokio::runtime::scheduler") || has("tokio::sync") {
        "tokio tasks, scheduler, channels"
    } else if has("tokio::") || has("mio::") {
        "tokio I/O and other"
    } else if has("core::fmt") || has("alloc::fmt") || has("alloc::string") || has("itoa") {
        "formatting (fmt, itoa), String"
    } else if has("metrics") {
        "metrics"
    } else if has("str::converts::from_utf8") {
        "UTF-8 validation (frames, RESP replies)"
    } else if has("futures_util") || has("futures::") {
        "futures (join_all, FuturesUnordered)"
    } else if has("hashbrown") || has("dashmap") || has("core::hash") || has("std::hash") {
        "hashing, hash maps"
    } else if has("syscall") || has("libc") || has("pthread") || has("epoll") || has("__GI") {
        "libc (syscall wrappers, locks)"
    } else {
        "other"
    }
}

fn print(c: &Counted) {
    println!(
        "\n{}: {:.0} instructions per check ({} checks; functions listed cover {:.1} %)",
        c.scenario,
        c.per_check,
        c.checks,
        100.0 * c.coverage
    );
    for (k, v) in &c.categories {
        if v.abs() >= 1.0 {
            println!("  {v:>9.0}  {k}");
        }
    }
    println!("  top functions (self):");
    for (f, v) in c.top.iter().take(15) {
        let f: String = f.chars().take(110).collect();
        println!("  {v:>9.0}  {f}");
    }
}

fn slug(name: &str) -> String {
    name.chars()
        .map(|c| if c.is_ascii_alphanumeric() { c } else { '-' })
        .collect::<String>()
        .split('-')
        .filter(|s| !s.is_empty())
        .collect::<Vec<_>>()
        .join("-")
}

/// Where the callgrind files go by default.
pub fn default_dir() -> PathBuf {
    PathBuf::from("target/bench/callgrind")
}
