//! Fleet-scale figures (BENCHMARKS.md, "fleet scale"): Redis commands per 1,000 checks batched vs
//! sync, over-admission with N agents on one key, agent memory per batched key, and Redis memory per
//! tracked pair.

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

pub(crate) fn used_memory(redis: &RedisServer) -> anyhow::Result<i64> {
    let info: String = redis::cmd("INFO").arg("memory").query(&mut redis.conn())?;
    info.lines()
        .find_map(|l| l.strip_prefix("used_memory:"))
        .and_then(|v| v.trim().parse().ok())
        .context("used_memory in INFO memory")
}

pub(crate) fn rss_bytes(pid: u32) -> anyhow::Result<i64> {
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
            "Redis, monthly quota (bucketed hashes, one per period), via the agent",
            r#"{"rules":[{"id":"bench","dimension":"user","limit":1000000000,"algorithm":"quota","period":"month"}]}"#
                .to_string(),
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
    // The baseline: the per-pair layout the bucket hashes replaced, one hash {w, c, p} per (client,
    // rule) with a TTL.
    // An expiry an hour ahead: a fixed one had passed, and Redis dropped the keys as it wrote them.
    let expire_at = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map_or(0, |d| d.as_millis() as u64)
        + 3_600_000;
    let bytes = write_directly(keys, |pipe, k| {
        let key = format!("fg:{{user:{k}}}:bench");
        pipe.cmd("HSET")
            .arg(&key)
            .arg("w")
            .arg(29_403_955u64)
            .arg("c")
            .arg(1)
            .arg("p")
            .arg(0);
        pipe.cmd("PEXPIREAT").arg(&key).arg(expire_at);
    })?;
    push(
        "Redis, one hash per client (the layout before), written directly",
        bytes,
    );
    // The original design's layout: two string counters per client (this window and the one before),
    // each with a TTL.
    let bytes = write_directly(keys, |pipe, k| {
        for w in [29_403_954u64, 29_403_955] {
            let key = format!("rl:{{user:{k}}}:bench:{w}");
            pipe.cmd("SET").arg(&key).arg(3).arg("PXAT").arg(expire_at);
        }
    })?;
    push(
        "Redis, two string keys per client with TTLs (the seed's), written directly",
        bytes,
    );
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
    use floodgate_core::store::Layout;
    use floodgate_redis::shards::rendezvous;
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

/// What rejected cross-shard checks leave behind.
#[derive(Debug, Serialize)]
pub struct CompensationRow {
    checks: u64,
    clients: usize,
    rejected: u64,
    units_taken_back: u64,
    take_back_failed: u64,
    max_transient_over_count: u64,
    residual_over_count: u64,
}

/// `checks` two-item checks on 3 shards, `clients` at a time: item 1 on a hot key of a generous rule,
/// item 2 on a key (another shard) whose rule is spent, so every check is rejected after item 1's
/// shard committed. Reports the hot key's count as Redis holds it: sampled during the load (units
/// committed and not yet taken back) and after (what stayed). The rejection cache is off, or it
/// would answer item 2 locally and nothing would need taking back, and so is hot-key promotion (the
/// hot key would be counted locally and taken back exactly).
pub async fn compensation(checks: u64, clients: usize) -> anyhow::Result<CompensationRow> {
    use floodgate_core::store::Layout;
    use floodgate_protocol::Item;
    use floodgate_redis::shards::rendezvous;
    let shards = floodgate_tests::Shards::start(3);
    let agent = Agent::builder()
        .redis(&shards.urls())
        .rules(
            r#"{"rules":[{"id":"many","dimension":"user","limit":1000000000,"windowSeconds":60},
                {"id":"one","dimension":"user","limit":1,"windowSeconds":60}]}"#,
        )
        .arg("--redis-timeout-ms")
        .arg("200")
        .arg("--rejection-cache")
        .arg("0")
        // The hot key would be promoted to batched execution (and taken back locally, exactly).
        .arg("--hot-key-rate")
        .arg("0")
        .start()
        .await;
    let layout = Layout::default();
    let urls: Vec<String> = shards.servers.iter().map(RedisServer::url).collect();
    let names: Vec<&str> = urls.iter().map(String::as_str).collect();
    let shard = |k: &str| rendezvous(&names, layout.bucket(k));
    let hot = "user:hot".to_string();
    let spent = (0..)
        .map(|i| format!("user:spent{i}"))
        .find(|k| shard(k) != shard(&hot))
        .context("a key on another shard")?;
    let client = floodgate_sdk::Client::connect(agent.socket()).await;
    let mut conn = shards.servers[shard(&hot)].conn();
    let start = sleep_until_window_offset(&mut conn, 60_000, 0);
    let window = start / 60_000;
    client.allow(&spent, "one", 1).await?;

    let stop = Arc::new(AtomicBool::new(false));
    let sampler = {
        let (stop, url) = (stop.clone(), urls[shard(&hot)].clone());
        tokio::task::spawn_blocking(move || -> anyhow::Result<u64> {
            let mut conn = redis::Client::open(url)?.get_connection()?;
            let mut max = 0;
            while !stop.load(Ordering::Relaxed) {
                max = max.max(window_count_at(&mut conn, "many", "user:hot", window).0);
            }
            Ok(max)
        })
    };
    let per_client = checks / clients as u64;
    let mut tasks = Vec::new();
    for _ in 0..clients {
        let (client, hot, spent) = (client.clone(), hot.clone(), spent.clone());
        tasks.push(tokio::spawn(async move {
            let mut rejected = 0;
            for _ in 0..per_client {
                let d = client
                    .check(vec![Item::new(&hot, "many", 1), Item::new(&spent, "one", 1)])
                    .await?;
                rejected += u64::from(!d.allowed);
            }
            anyhow::Ok(rejected)
        }));
    }
    let mut rejected = 0;
    for t in tasks {
        rejected += t.await??;
    }
    // Take-backs are off the request path: wait until the agent says each one finished.
    let admin = agent.admin_addr().await;
    let status = loop {
        let (_, body) = floodgate_tests::http_get(admin, "/v1/status").await;
        let v: serde_json::Value = serde_json::from_str(&body)?;
        let tb = &v["takenBack"];
        let (req, done, failed) = (
            tb["requestedUnits"].as_u64().unwrap_or(0),
            tb["doneUnits"].as_u64().unwrap_or(0),
            tb["failedUnits"].as_u64().unwrap_or(0),
        );
        if req == done + failed {
            break (done, failed);
        }
        tokio::time::sleep(Duration::from_millis(10)).await;
    };
    stop.store(true, Ordering::Relaxed);
    let max = sampler.await??;
    let residual = window_count_at(&mut conn, "many", "user:hot", window).0;
    let row = CompensationRow {
        checks: per_client * clients as u64,
        clients,
        rejected,
        units_taken_back: status.0,
        take_back_failed: status.1,
        max_transient_over_count: max,
        residual_over_count: residual,
    };
    println!(
        "  {} cross-shard checks ({} clients), {} rejected; taken back {} units ({} failed); hot key's count: max {} while in flight, {} after",
        row.checks, clients, row.rejected, row.units_taken_back, row.take_back_failed, row.max_transient_over_count, row.residual_over_count
    );
    Ok(row)
}

/// Redis memory used by writing `keys` clients' state with `write` on a fresh server, pipelined.
fn write_directly(keys: usize, write: impl Fn(&mut redis::Pipeline, usize)) -> anyhow::Result<i64> {
    let redis = RedisServer::start();
    let mut conn = redis.conn();
    let before = used_memory(&redis)?;
    for start in (0..keys).step_by(1_000) {
        let mut pipe = redis::pipe();
        for k in start..(start + 1_000).min(keys) {
            write(&mut pipe, k);
        }
        pipe.query::<()>(&mut conn)?;
    }
    Ok(used_memory(&redis)? - before)
}
