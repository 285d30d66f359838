//! The core path's closed (and optional open) loop: the echo server, bare EVALSHA, and agents on the
//! embedded store and on Redis, at each client count, with ratios to the same-run baselines
//! (`loadgen` without a subcommand).

use std::path::PathBuf;
use std::time::Duration;

use anyhow::Context;
use floodgate_tests::{Agent, RedisServer};

use crate::report::{self, Row, Table};
use crate::targets::{commandstats, Target};
use crate::{closed, cpu_split, cpu_ticks, echo, open, RULES};

#[derive(clap::Args, Clone)]
pub(crate) struct RunArgs {
    /// Concurrent clients (connections) for the closed loop, comma-separated.
    #[arg(long, value_delimiter = ',', default_value = "1,16,64")]
    clients: Vec<usize>,
    /// Checks in flight per client in the closed loop.
    #[arg(long, default_value_t = 1)]
    pipeline: usize,
    /// Seconds measured per scenario (after a warm-up of a quarter of that).
    #[arg(long, default_value_t = 5.0)]
    seconds: f64,
    /// Distinct keys the checks cycle through.
    #[arg(long, default_value_t = 10_000)]
    keys: usize,
    /// Which agent paths to measure: memory, redis, or both.
    #[arg(long, default_value = "both")]
    store: String,
    /// Also run an open loop at this many checks/s against each agent path (0: skip).
    #[arg(long, default_value_t = 0)]
    open_rate: u64,
    /// Connections the open loop spreads its requests over.
    #[arg(long, default_value_t = 4)]
    open_connections: usize,
    /// Skip the baselines (they are needed for ratios).
    #[arg(long)]
    no_baselines: bool,
    /// The Redis agent's store timeout (the agent's default is 5 ms); checks past it are answered by
    /// the rule's fail mode and counted in the `fallback %` column.
    #[arg(long, default_value_t = 5)]
    redis_timeout_ms: u64,
    /// The Redis agent's `--coalesce` (most check items per script call; 1 turns coalescing off).
    #[arg(long, default_value_t = floodgate_redis::DEFAULT_COALESCE)]
    coalesce: usize,
    /// Worker threads of the agents under test (the agent's default is 1; 0: one per core).
    #[arg(long, default_value_t = 1)]
    agent_threads: usize,
    /// Repeat every scenario this many times and report medians (the machine is noisy).
    #[arg(long, default_value_t = 1)]
    runs: usize,
    /// Where to write the JSON results.
    #[arg(long, default_value = "target/loadgen.json")]
    json: PathBuf,
}

pub(crate) async fn run(args: RunArgs) -> anyhow::Result<()> {
    let measure = Duration::from_secs_f64(args.seconds);
    let want_memory = args.store == "memory" || args.store == "both";
    let want_redis = args.store == "redis" || args.store == "both";
    let dir = tempfile::tempdir()?;

    let echo_socket = dir.path().join("echo.sock");
    let echo = echo::spawn(&echo_socket)?;
    let redis = (want_redis || !args.no_baselines).then(RedisServer::start);
    let memory_agent = if want_memory {
        Some(
            Agent::builder()
                .rules(RULES)
                .arg("--threads")
                .arg(&args.agent_threads.to_string())
                .start()
                .await,
        )
    } else {
        None
    };
    let redis_agent = match (&redis, want_redis) {
        (Some(r), true) => Some(
            Agent::builder()
                .redis(&r.url())
                .rules(RULES)
                .arg("--redis-timeout-ms")
                .arg(&args.redis_timeout_ms.to_string())
                .arg("--coalesce")
                .arg(&args.coalesce.to_string())
                .arg("--threads")
                .arg(&args.agent_threads.to_string())
                .start()
                .await,
        ),
        _ => None,
    };

    let mut tables = Vec::new();
    for run in 0..args.runs.max(1) {
        println!("run {} of {}", run + 1, args.runs.max(1));
        tables.push(
            run_once(
                &args,
                measure,
                &echo_socket,
                redis.as_ref(),
                &memory_agent,
                &redis_agent,
                Some(echo.pid()),
            )
            .await?,
        );
    }
    let mut table = Table::median(&tables);
    table.print();
    if let Some(parent) = args.json.parent() {
        std::fs::create_dir_all(parent)?;
    }
    std::fs::write(&args.json, report::json(&table, &tables)?)?;
    println!("\nJSON written to {}", args.json.display());
    Ok(())
}

async fn run_once(
    args: &RunArgs,
    measure: Duration,
    echo_socket: &std::path::Path,
    redis: Option<&RedisServer>,
    memory_agent: &Option<Agent>,
    redis_agent: &Option<Agent>,
    echo_pid: Option<u32>,
) -> anyhow::Result<Table> {
    let mut table = Table::default();
    for &clients in &args.clients {
        let run_one = async |name: &str, target: Target, pid: Option<u32>| -> anyhow::Result<Row> {
            let before = match redis {
                Some(r) => Some(commandstats(r)?),
                None => None,
            };
            let cpu_before = pid.and_then(cpu_split);
            let redis_cpu_before = redis.and_then(RedisServer::pid).and_then(cpu_ticks);
            let result = closed::run(&target, clients, args.pipeline, args.keys, measure).await?;
            let cpu = match (pid.and_then(cpu_split), cpu_before) {
                (Some(after), Some(before)) => {
                    Some((after.0.saturating_sub(before.0), after.1.saturating_sub(before.1)))
                }
                _ => None,
            };
            let redis_calls = match (redis, before) {
                (Some(r), Some(b)) => {
                    let mut d = commandstats(r)?.since(&b);
                    let after = r.pid().and_then(cpu_ticks);
                    d.process_ticks = after
                        .zip(redis_cpu_before)
                        .map_or(0, |(a, b)| a.saturating_sub(b));
                    Some(d)
                }
                _ => None,
            };
            let mut row = Row::closed(name, clients, args.pipeline, result, redis_calls);
            row.set_process_cpu(cpu);
            Ok(row)
        };
        if !args.no_baselines {
            let row = run_one(
                "bare uds round trip",
                Target::Echo(echo_socket.to_path_buf()),
                echo_pid,
            )
            .await?;
            table.push(row);
            let r = redis.context("redis for the EVALSHA baseline")?;
            let row = run_one("bare EVALSHA", Target::Evalsha(r.url()), None).await?;
            table.push(row);
        }
        if let Some(a) = &memory_agent {
            let row = run_one(
                "agent, in-memory",
                Target::Agent(a.socket().to_path_buf()),
                a.pid(),
            )
            .await?;
            table.push(row);
        }
        if let Some(a) = &redis_agent {
            let row = run_one("agent, redis", Target::Agent(a.socket().to_path_buf()), a.pid()).await?;
            table.push(row);
        }
    }
    if args.open_rate > 0 {
        let agents = [("agent, in-memory", memory_agent), ("agent, redis", redis_agent)];
        for (name, agent) in agents {
            let Some(a) = agent else { continue };
            let result = open::run(
                a.socket(),
                args.open_rate,
                args.open_connections,
                args.keys,
                measure,
            )?;
            table.push(Row::open(name, args.open_rate, args.open_connections, result));
        }
        if !args.no_baselines {
            let result = open::run(
                echo_socket,
                args.open_rate,
                args.open_connections,
                args.keys,
                measure,
            )?;
            table.push(Row::open(
                "bare uds round trip",
                args.open_rate,
                args.open_connections,
                result,
            ));
        }
    }
    table.compute_ratios();
    Ok(table)
}
