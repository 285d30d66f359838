//! Fleet-scale figures (issue 3): Redis commands per 1,000 checks batched vs sync, over-admission with
//! N agents on one key, agent memory per batched key, and Redis memory per tracked pair.

use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::time::Duration;

use anyhow::Context;
use floodgate_tests::{redis_time_ms, sleep_until_window_offset, window_count_at, Agent, RedisServer};
use serde::Serialize;

use crate::targets::{commandstats, Target};

/// Commands a Redis received from clients, as opposed to those its scripts ran: the agent's calls.
const ROUND_TRIP_COMMANDS: [&str; 4] = ["evalsha", "eval", "script|load", "ping"];

fn rules(execution: &str, limit: u64, window_s: u64) -> String {
    format!(
        r#"{{"rules":[{{"id":"bench","dimension":"user","limit":{limit},"windowSeconds":{window_s},"execution":"{execution}"}}]}}"#
    )
}

/// Round-trip commands and every command Redis ran (script-internal included), from
/// `INFO commandstats`.
fn command_counts(redis: &RedisServer) -> anyhow::Result<(u64, u64)> {
    let stats = commandstats(redis)?;
    let (mut round_trips, mut all) = (0, 0);
    for (name, (calls, _)) in stats.entries() {
        if name == "info" {
            continue;
        }
        all += calls;
        if ROUND_TRIP_COMMANDS.contains(&name.as_str()) {
            round_trips += calls;
        }
    }
    Ok((round_trips, all))
}

/// One execution mode's Redis traffic under the open loop.
#[derive(Debug, Serialize)]
pub struct CommandsRow {
    scenario: String,
    offered_per_s: u64,
    answered_per_s: f64,
    p99_us: f64,
    fallback_pct: f64,
    round_trips_per_1000: f64,
    commands_per_1000: f64,
    redis_cpu_us_per_check: f64,
}

/// Redis commands per 1,000 checks over `keys` keys: batched at `rate` offered checks/s, sync
/// (coalescing off and on) at `sync_rate` (what one agent's sync path sustains on this machine; past
/// it, answers come from the fail mode and the count means nothing), one agent each, each against its
/// own fresh Redis.
pub async fn commands(
    rate: u64,
    sync_rate: u64,
    keys: usize,
    seconds: f64,
    connections: usize,
) -> anyhow::Result<Vec<CommandsRow>> {
    let measure = Duration::from_secs_f64(seconds);
    let mut rows = Vec::new();
    for (name, execution, rate, extra) in [
        ("sync, coalescing off", "sync", sync_rate, vec!["--coalesce", "1"]),
        ("sync, coalescing on", "sync", sync_rate, vec![]),
        ("batched, 100 ms flush", "batched", rate, vec![]),
    ] {
        let redis = RedisServer::start();
        let mut b = Agent::builder()
            .redis(&redis.url())
            // Batched rules need limits below 2³² (u32 counters): 10⁹ per minute is never reached.
            .rules(&rules(execution, 1_000_000_000, 60))
            .arg("--redis-timeout-ms")
            .arg("50");
        for a in &extra {
            b = b.arg(a);
        }
        let agent = b.start().await;
        let before = command_counts(&redis)?;
        let redis_pid = redis.pid().context("redis pid")?;
        let cpu_before = crate::cpu_ticks(redis_pid).unwrap_or(0);
        let socket = agent.socket().to_path_buf();
        let result =
            tokio::task::spawn_blocking(move || crate::open::run(&socket, rate, connections, keys, measure))
                .await??;
        // Batched units still pending are not Redis's cost yet; the next flush is (at most 100 ms).
        tokio::time::sleep(Duration::from_millis(200)).await;
        let after = command_counts(&redis)?;
        let cpu = crate::cpu_ticks(redis_pid)
            .unwrap_or(0)
            .saturating_sub(cpu_before);
        let n = result.all_checks.max(1) as f64;
        let row = CommandsRow {
            scenario: name.into(),
            offered_per_s: rate,
            answered_per_s: result.checks as f64 / result.elapsed.as_secs_f64(),
            p99_us: result.hist.value_at_quantile(0.99) as f64 / 1_000.0,
            fallback_pct: result.fallbacks as f64 * 100.0 / result.checks.max(1) as f64,
            round_trips_per_1000: (after.0 - before.0) as f64 * 1_000.0 / n,
            commands_per_1000: (after.1 - before.1) as f64 * 1_000.0 / n,
            redis_cpu_us_per_check: cpu as f64 * 10_000.0 / n,
        };
        println!(
            "  {:<22} offered {:>6}/s answered {:>7.0}/s p99 {:>8.1} µs fail-mode {:>5.2} % round trips/1000 {:>7.2} all commands/1000 {:>7.1} redis CPU {:>5.2} µs/check",
            row.scenario,
            row.offered_per_s,
            row.answered_per_s,
            row.p99_us,
            row.fallback_pct,
            row.round_trips_per_1000,
            row.commands_per_1000,
            row.redis_cpu_us_per_check
        );
        rows.push(row);
    }
    Ok(rows)
}

/// Over-admission of a batched rule with `n` agents on one key.
#[derive(Debug, Serialize)]
pub struct AccuracyRow {
    agents: usize,
    limit: u64,
    window_ms: u64,
    flush_ms: u64,
    offered_per_window: u64,
    admitted_per_window: Vec<u64>,
    max_over_pct: f64,
    mean_over_pct: f64,
}

/// `n` agents share one key of a batched rule (`limit` per 2 s window, 100 ms flush), offered twice
/// the limit evenly; each whole window's global count is read from Redis half a second into the next.
pub async fn accuracy(agents: &[usize], limit: u64, windows: u64) -> anyhow::Result<Vec<AccuracyRow>> {
    const WINDOW_MS: u64 = 2_000;
    let mut rows = Vec::new();
    for &n in agents {
        let redis = RedisServer::start();
        let mut procs = Vec::new();
        for _ in 0..n {
            procs.push(
                Agent::builder()
                    .redis(&redis.url())
                    .rules(&rules("batched", limit, WINDOW_MS / 1_000))
                    .arg("--redis-timeout-ms")
                    .arg("50")
                    .arg("--heartbeat-ms")
                    .arg("100")
                    .start()
                    .await,
            );
        }
        // Every agent must count N before the load starts (the shares divide by it).
        let deadline = std::time::Instant::now() + Duration::from_secs(10);
        for a in &procs {
            loop {
                let (_, body) = floodgate_tests::http_get(a.admin_addr().await, "/v1/status").await;
                let v: serde_json::Value = serde_json::from_str(&body)?;
                if v["liveAgents"] == n as u64 {
                    break;
                }
                anyhow::ensure!(
                    std::time::Instant::now() < deadline,
                    "agents did not see each other"
                );
                tokio::time::sleep(Duration::from_millis(20)).await;
            }
        }
        let mut conn = redis.conn();
        let start = sleep_until_window_offset(&mut conn, WINDOW_MS, 0);
        let first = start / WINDOW_MS;
        // 2 × limit per window, over all agents, two paced tasks per agent.
        let per_task_per_s = (2 * limit) as f64 / (WINDOW_MS as f64 / 1_000.0) / (2 * n) as f64;
        let period = Duration::from_secs_f64(1.0 / per_task_per_s);
        let stop = Arc::new(AtomicBool::new(false));
        let mut tasks = Vec::new();
        for a in &procs {
            for _ in 0..2 {
                let client = floodgate_sdk::Client::connect(a.socket()).await;
                let stop = stop.clone();
                tasks.push(tokio::spawn(async move {
                    let mut tick = tokio::time::interval(period);
                    tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Burst);
                    while !stop.load(Ordering::Relaxed) {
                        tick.tick().await;
                        let _ = client.allow("user:hot", "bench", 1).await;
                    }
                }));
            }
        }
        let mut admitted = Vec::new();
        for k in first + 1..=first + windows {
            let now = redis_time_ms(&mut conn);
            let at = k * WINDOW_MS + 500;
            if at > now {
                tokio::time::sleep(Duration::from_millis(at - now)).await;
            }
            admitted.push(window_count_at(&mut conn, "bench", "user:hot", k - 1).0);
        }
        stop.store(true, Ordering::Relaxed);
        for t in tasks {
            t.await?;
        }
        let over: Vec<f64> = admitted
            .iter()
            .map(|&a| (a as f64 - limit as f64) * 100.0 / limit as f64)
            .collect();
        let row = AccuracyRow {
            agents: n,
            limit,
            window_ms: WINDOW_MS,
            flush_ms: 100,
            offered_per_window: 2 * limit,
            max_over_pct: over.iter().copied().fold(f64::MIN, f64::max),
            mean_over_pct: over.iter().sum::<f64>() / over.len().max(1) as f64,
            admitted_per_window: admitted,
        };
        println!(
            "  {} agents: admitted per window {:?} (limit {limit}); over-admission max {:.2} %, mean {:.2} %",
            n, row.admitted_per_window, row.max_over_pct, row.mean_over_pct
        );
        rows.push(row);
    }
    Ok(rows)
}

/// Memory figures.
#[derive(Debug, Serialize)]
pub struct MemoryRow {
    what: String,
    keys: usize,
    bytes_total: i64,
    bytes_per_key: f64,
}

fn used_memory(redis: &RedisServer) -> anyhow::Result<i64> {
    let info: String = redis::cmd("INFO").arg("memory").query(&mut redis.conn())?;
    info.lines()
        .find_map(|l| l.strip_prefix("used_memory:"))
        .and_then(|v| v.trim().parse().ok())
        .context("used_memory in INFO memory")
}

fn rss_bytes(pid: u32) -> anyhow::Result<i64> {
    let status = std::fs::read_to_string(format!("/proc/{pid}/status"))?;
    let kb: i64 = status
        .lines()
        .find_map(|l| l.strip_prefix("VmRSS:"))
        .and_then(|v| v.trim().trim_end_matches("kB").trim().parse().ok())
        .context("VmRSS")?;
    Ok(kb * 1024)
}

/// Sends one check for each of `keys` distinct keys through an agent (16 connections × 64 in
/// flight).
async fn touch_keys(socket: &std::path::Path, keys: usize) -> anyhow::Result<()> {
    let clients = 16;
    let mut tasks = Vec::new();
    for c in 0..clients {
        let mut conn = Target::Agent(socket.to_path_buf()).connect().await?;
        tasks.push(tokio::spawn(async move {
            let mut k = c;
            let mut batch = Vec::with_capacity(64);
            while k < keys {
                batch.clear();
                while batch.len() < 64 && k < keys {
                    batch.push(k);
                    k += clients;
                }
                conn.round_trip(&batch).await?;
            }
            anyhow::Ok(())
        }));
    }
    for t in tasks {
        t.await??;
    }
    Ok(())
}

/// Redis memory per tracked (key, rule) pair (this layout, through an agent: sliding window and token
/// bucket; and for comparison the one-hash-per-client layout Floodgate used before, written
/// directly), and agent RSS per batched key.
pub async fn memory(keys: usize) -> anyhow::Result<Vec<MemoryRow>> {
    let mut rows = Vec::new();
    let mut push = |what: &str, total: i64| {
        let row = MemoryRow {
            what: what.into(),
            keys,
            bytes_total: total,
            bytes_per_key: total as f64 / keys as f64,
        };
        println!(
            "  {:<64} {:>12} B total  {:>7.1} B per key",
            row.what, row.bytes_total, row.bytes_per_key
        );
        rows.push(row);
    };
    for (what, rule) in [
        (
            "Redis, sliding window (bucketed hashes), via the agent",
            rules("sync", 1_000_000_000, 3_600),
        ),
        (
            "Redis, token bucket (one hash per client), via the agent",
            // A slow refill, so that no bucket is full (and expired) again before it is measured.
            r#"{"rules":[{"id":"bench","dimension":"user","limit":10,"windowSeconds":3600,"burst":1000000,"algorithm":"token_bucket"}]}"#
                .to_string(),
        ),
    ] {
        let redis = RedisServer::start();
        let agent = Agent::builder()
            .redis(&redis.url())
            .rules(&rule)
            .arg("--redis-timeout-ms")
            .arg("200")
            .start()
            .await;
        // Warm up the script cache and connections before the baseline.
        touch_keys(agent.socket(), 1).await?;
        let before = used_memory(&redis)?;
        touch_keys(agent.socket(), keys).await?;
        push(what, used_memory(&redis)? - before);
    }
    {
        // Steady state: a client active in two consecutive windows has a field in both hashes. Two
        // passes over every key, one in each of two 30 s windows (a pass takes ~15 s here).
        let redis = RedisServer::start();
        let agent = Agent::builder()
            .redis(&redis.url())
            .rules(&rules("sync", 1_000_000_000, 30))
            .arg("--redis-timeout-ms")
            .arg("200")
            .start()
            .await;
        touch_keys(agent.socket(), 1).await?;
        let mut conn = redis.conn();
        sleep_until_window_offset(&mut conn, 30_000, 0);
        let before = used_memory(&redis)?;
        touch_keys(agent.socket(), keys).await?;
        sleep_until_window_offset(&mut conn, 30_000, 0);
        touch_keys(agent.socket(), keys).await?;
        push(
            "Redis, sliding window, two live windows per client (steady state)",
            used_memory(&redis)? - before,
        );
    }
    {
        // The layout before this issue: one hash {w, c, p} per (client, rule) with a TTL.
        let redis = RedisServer::start();
        let mut conn = redis.conn();
        let before = used_memory(&redis)?;
        for chunk in (0..keys).collect::<Vec<_>>().chunks(1_000) {
            let mut pipe = redis::pipe();
            for k in chunk {
                let key = format!("fg:{{user:{k}}}:bench");
                pipe.cmd("HSET")
                    .arg(&key)
                    .arg("w")
                    .arg(29_403_955u64)
                    .arg("c")
                    .arg(1)
                    .arg("p")
                    .arg(0)
                    .ignore();
                pipe.cmd("PEXPIREAT").arg(&key).arg(1_796_300_000_000u64).ignore();
            }
            pipe.query::<()>(&mut conn)?;
        }
        push(
            "Redis, one hash per client (the layout before), written directly",
            used_memory(&redis)? - before,
        );
    }
    {
        let redis = RedisServer::start();
        let agent = Agent::builder()
            .redis(&redis.url())
            .rules(&rules("batched", 1_000_000_000, 3_600))
            .arg("--batch-max-keys")
            .arg(&(keys + 10).to_string())
            .start()
            .await;
        touch_keys(agent.socket(), 1).await?;
        let pid = agent.pid().context("agent pid")?;
        let before = rss_bytes(pid)?;
        touch_keys(agent.socket(), keys).await?;
        push(
            "agent RSS, batched counters (one per key)",
            rss_bytes(pid)? - before,
        );
    }
    Ok(rows)
}

/// Where keys live on independent shards, and how many move when a node is added.
#[derive(Debug, Serialize)]
pub struct PlacementRow {
    nodes_before: usize,
    keys: usize,
    buckets: u32,
    share_per_node_pct: Vec<f64>,
    moved_keys: usize,
    moved_pct: f64,
    ideal_moved_pct: f64,
    moved_to_new_node_only: bool,
}

/// Places `keys` client keys (`user:0..`) on `nodes` independent shards with the default layout,
/// then on `nodes + 1`, and counts the keys whose shard changed (rendezvous hashing: only those the
/// new node wins, ideally 1 / (nodes + 1)).
pub fn placement(keys: usize, nodes: usize) -> PlacementRow {
    use floodgate_agent::store::shards::rendezvous;
    use floodgate_agent::store::Layout;
    let layout = Layout::default();
    let names: Vec<String> = (0..=nodes)
        .map(|i| format!("redis://10.0.0.{}:6379", i + 1))
        .collect();
    let before: Vec<&str> = names[..nodes].iter().map(String::as_str).collect();
    let after: Vec<&str> = names.iter().map(String::as_str).collect();
    let by_bucket_before: Vec<usize> = (0..layout.buckets()).map(|b| rendezvous(&before, b)).collect();
    let by_bucket_after: Vec<usize> = (0..layout.buckets()).map(|b| rendezvous(&after, b)).collect();
    let mut per_node = vec![0usize; nodes];
    let (mut moved, mut only_new) = (0, true);
    for k in 0..keys {
        let b = layout.bucket(&format!("user:{k}")) as usize;
        per_node[by_bucket_before[b]] += 1;
        if by_bucket_before[b] != by_bucket_after[b] {
            moved += 1;
            only_new &= by_bucket_after[b] == nodes;
        }
    }
    let row = PlacementRow {
        nodes_before: nodes,
        keys,
        buckets: layout.buckets(),
        share_per_node_pct: per_node.iter().map(|&n| n as f64 * 100.0 / keys as f64).collect(),
        moved_keys: moved,
        moved_pct: moved as f64 * 100.0 / keys as f64,
        ideal_moved_pct: 100.0 / (nodes + 1) as f64,
        moved_to_new_node_only: only_new,
    };
    println!(
        "  {nodes} → {} nodes, {keys} keys over {} buckets: shares before {:?} %; moved {} keys = {:.2} % (ideal {:.2} %), all to the new node: {}",
        nodes + 1,
        row.buckets,
        row.share_per_node_pct.iter().map(|p| format!("{p:.1}")).collect::<Vec<_>>(),
        row.moved_keys,
        row.moved_pct,
        row.ideal_moved_pct,
        row.moved_to_new_node_only
    );
    row
}
